"""What one forward step reads and writes: the state pools and the batch descriptor.

Pools are owned by the engine and indexed by slot (KDA) or page (MLA); the model never keeps per-session
tensors. Shapes: KDA state [S, H, K, V] float32 and conv tails [S, W - 1, Dc] (Dc = 2 H K + H V, q|k|v rows
before the conv) per KDA layer; latent KV pages [num_pages, P, r + dr] per MLA layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class StatePools:
    kda: list[Tensor]
    conv: list[Tensor]
    kv: list[Tensor]
    page_size: int

    @property
    def num_slots(self) -> int:
        return self.kda[0].shape[0] if self.kda else 0

    @property
    def num_pages(self) -> int:
        return self.kv[0].shape[0] if self.kv else 0


@dataclass
class ForwardBatch:
    """N sequences, each feeding ``num_new[n]`` tokens after ``start[n]`` cached ones.

    input_ids [T_total] (packed in sequence order), slots [N] (KDA/conv slot of each sequence), page_table
    [N, max_pages] int32 (pages covering at least start + num_new tokens, allocated by the caller).
    ``checkpoint_positions[n]`` lists positions p in [1, num_new[n]] (relative to this call) whose state is
    returned. ``all_logits`` returns logits for every token instead of each sequence's last.
    """

    input_ids: Tensor
    num_new: list[int]
    start: list[int]
    slots: Tensor
    page_table: Tensor
    checkpoint_positions: list[list[int]] | None = None
    all_logits: bool = False
    kv_rows: Tensor | None = None
    """Optional [T_total] flat row (page * P + offset) of each new token's KV entry, built by a caller that
    keeps page tables on the host, so the model needs no device-to-host copy of ``page_table``."""
    cu_seqlens: Tensor = field(init=False)

    def __post_init__(self) -> None:
        N = len(self.num_new)
        if len(self.start) != N or self.slots.shape[0] != N or self.page_table.shape[0] != N:
            raise ValueError(f"num_new, start, slots and page_table must all describe N={N} sequences")
        if any(t < 1 for t in self.num_new):
            raise ValueError(f"every sequence must feed at least one token, got num_new={self.num_new}")
        if self.input_ids.shape[0] != sum(self.num_new):
            raise ValueError(f"input_ids holds {self.input_ids.shape[0]} tokens, num_new sums to {sum(self.num_new)}")
        offsets = [0]
        for t in self.num_new:
            offsets.append(offsets[-1] + t)
        self.cu_seqlens = torch.tensor(offsets, dtype=torch.long, device=self.input_ids.device)

    @staticmethod
    def rows_for(pages: list[list[int]], start: list[int], num_new: list[int], page_size: int) -> list[int]:
        """Flat KV rows of the new tokens of each sequence, from host-side page lists."""
        rows: list[int] = []
        for table, s, t in zip(pages, start, num_new):
            rows.extend(table[p // page_size] * page_size + p % page_size for p in range(s, s + t))
        return rows

    @property
    def is_decode(self) -> bool:
        return all(t == 1 for t in self.num_new) and not self.checkpoint_positions


@dataclass
class CheckpointStates:
    """States at requested positions, in (sequence, position) order: kda [M, L_kda, H, K, V] float32 and
    conv [M, L_kda, W - 1, Dc]."""

    kda: Tensor
    conv: Tensor
