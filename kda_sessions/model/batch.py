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
    scratch_slot: int | None = None
    """A KDA/conv slot that no session owns: padded rows of a CUDA-graph decode batch read and write it."""
    scratch_page: int | None = None
    """A KV page that no session owns: padded rows write their latent row there."""
    kda_layers: Tensor | None = None
    """Where the pools hold them so (``HybridModel.allocate_pools``): every KDA layer's states in one tensor [L_kda,
    S, H, K, V], ``kda[i]`` its ``[i]``, so a slot's state in every layer is copied by one strided copy."""
    conv_layers: Tensor | None = None
    """Likewise the conv tails, [L_kda, S, W - 1, Dc]."""

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
    offsets: list[int] = field(init=False)
    """``cu_seqlens`` on the host: kernels that need the offsets read these, never the device's."""

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
        self.offsets = offsets
        self.cu_seqlens = torch.tensor(offsets, dtype=torch.long).to(self.input_ids.device, non_blocking=True)

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
class DecodeInputs:
    """Device tensors of a decode step (one new token per sequence), enough for the step to run without a host
    sync or a host-to-device copy, so it can be captured in a CUDA graph and replayed with new contents.

    input_ids [N] int, slots [N] int (KDA/conv slot), page_table [N, max_pages] int32, seq_lens [N] int32
    (tokens in the context including the new one, so the new token sits at position seq_lens - 1),
    cu_seqlens [N + 1] int64 (arange: one token each).
    """

    input_ids: Tensor
    slots: Tensor
    page_table: Tensor
    seq_lens: Tensor
    cu_seqlens: Tensor

    @staticmethod
    def from_batch(batch: ForwardBatch) -> DecodeInputs:
        """The eager path's inputs: one host-to-device copy (seq_lens) on top of the batch's tensors."""
        assert batch.is_decode
        seq_lens = torch.tensor([s + 1 for s in batch.start], dtype=torch.int32, device=batch.input_ids.device)
        return DecodeInputs(batch.input_ids, batch.slots, batch.page_table, seq_lens, batch.cu_seqlens)

    def kv_rows(self, page_size: int) -> Tensor:
        """[N] int64 flat row (page * P + offset) of each new token in the paged cache, computed on the device."""
        pos = self.seq_lens.long() - 1  # [N]
        page = self.page_table.gather(1, (pos // page_size)[:, None]).squeeze(1).long()  # [N]
        return page * page_size + pos % page_size


@dataclass
class PaddedPrefill:
    """Device tensors of a short prefill step laid out at fixed shapes, so it can be captured in a CUDA graph and
    replayed with new contents (``prefill_graphs.PrefillGraphs``): N sequences, each chunk padded to Tb tokens.

    input_ids [N * Tb] int (padding: any id); slots [N] int; starts [N] int32 >= 1, each sequence's cached tokens;
    lens [N] int64 in [1, Tb], its chunk's real tokens; kv_rows [N * Tb] int64, each token's flat cache row (the
    padding's on a scratch page); page_table [N, max_pages] int32 covering each sequence's cached rows; last [N]
    int64, the flat index of each chunk's last real token; bounds [N + 1] int64, arange(N + 1) * Tb (the packed
    sequences as the conv kernel takes them). ``mla_splits``: the cached rows' splits in the MLA layers (fixed when
    captured: ``absorbed_splits`` at the longest context the page table holds). ``ck_lens`` [N] int32 in [1, lens[n]]
    or None: the step also returns each sequence's KDA states and conv tails after that many of its chunk's tokens
    (a checkpoint inside the chunk).

    Padding tokens leave a sequence's state as its real tokens left it: their KDA gate and beta are zeroed (no
    decay, no update), its conv tail is taken after its real tokens, their cache rows land on the scratch page,
    and no real query attends to them (causal)."""

    input_ids: Tensor
    slots: Tensor
    starts: Tensor
    lens: Tensor
    kv_rows: Tensor
    page_table: Tensor
    last: Tensor
    bounds: Tensor
    mla_splits: int
    ck_lens: Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.slots.shape[0]

    @property
    def chunk(self) -> int:
        """Tb."""
        return self.input_ids.shape[0] // self.slots.shape[0]

    def valid(self, lens: Tensor | None = None) -> Tensor:
        """[N * Tb] bool: True at each chunk's first ``lens`` [N] tokens (default: its real ones)."""
        lens = self.lens if lens is None else lens
        return (torch.arange(self.chunk, device=lens.device)[None, :] < lens[:, None]).reshape(-1)


@dataclass
class CheckpointStates:
    """States at requested positions, in (sequence, position) order: kda [M, L_kda, H, K, V] float32 and
    conv [M, L_kda, W - 1, Dc]."""

    kda: Tensor
    conv: Tensor
