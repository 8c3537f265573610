"""What the step machinery knows of a context: its tokens, how many are in the pools, where they are, and the
checkpoints a failed step can roll back to. Plain bookkeeping; the tensors live in ``Pools``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Checkpoint:
    """The prefix ``tokens[:position]``. Its model state is held at ``state_pos`` (<= ``target`` = position - 1;
    the tokens in between are fed again by whoever continues from it). ``state_id`` names the KDA and conv state
    in the host pool (``Pools.host``; None when only the store has it); ``pages`` are pool pages (refcounted)
    covering ``state_pos`` tokens, or empty when not resident. ``state_blob`` / ``page_blobs`` name the same
    state in the store once saved."""

    name: str
    position: int
    state_pos: int
    state_id: int | None = None
    pages: list[int] = field(default_factory=list)
    state_blob: str | None = None
    page_blobs: list[str] | None = None
    num_messages: int = 0
    turn_open: bool = False
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    """When it was captured or last started another context: what the checkpoint memory policy keeps longest."""

    @property
    def resident(self) -> bool:
        """Whether its state is in the host pool (its pages may still have to be loaded)."""
        return self.state_id is not None

    @property
    def target(self) -> int:
        """Where the state is kept once exact: one token short of the prefix, so that whoever continues
        feeds that last token and gets logits to sample from (no logits are ever stored)."""
        return max(self.position - 1, 0)


@dataclass(eq=False)
class Sequence:
    """One context in the pools. ``tokens[:num_cached]`` have run through the model: their effect is in the KDA
    slot and the KV ``pages``; the rest is pending."""

    id: str
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def resident(self) -> bool:
        return self.slot is not None
