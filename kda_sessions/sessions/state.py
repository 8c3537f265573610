"""Per-session bookkeeping: plain objects with counters. Tensors live in the engine's pools, except the
host copies of checkpoint states (small next to the KV cache: one [L, H, K, V] per checkpoint)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from torch import Tensor


class SessionLock:
    """One operation at a time on a session. Not owned by a task (unlike ``anyio.Lock``): a stream's async
    generator may be finalised by another task than the one that started it, and must still release."""

    def __init__(self) -> None:
        self._sem = anyio.Semaphore(1)

    async def acquire(self) -> None:
        await self._sem.acquire()

    def release(self) -> None:
        self._sem.release()

    def locked(self) -> bool:
        return self._sem.value == 0

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Checkpoint:
    """The prefix ``tokens[:position]``. Its model state is held at ``state_pos`` (<= ``target`` =
    position - 1; the tokens in between are fed again by whoever continues from it). ``kda`` [L, H, K, V] float32 and
    ``conv`` [L, W - 1, Dc] are host copies (None when only the store has them); ``pages`` are pool pages
    (refcounted) covering ``state_pos`` tokens, or empty when not resident."""

    name: str
    position: int
    state_pos: int
    kda: Tensor | None = None
    conv: Tensor | None = None
    pages: list[int] = field(default_factory=list)
    state_blob: str | None = None
    page_blobs: list[str] | None = None
    num_messages: int = 0
    turn_open: bool = False
    created_at: float = field(default_factory=time.time)

    @property
    def resident(self) -> bool:
        return self.kda is not None

    @property
    def target(self) -> int:
        """Where the state is kept once exact: one token short of the prefix, so that whoever continues
        feeds that last token and gets logits to sample from (no logits are ever stored)."""
        return max(self.position - 1, 0)


@dataclass
class SessionState:
    id: str
    tenant: str | None = None
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    """Tokens whose effect is in the pools (KDA slot + KV pages); the rest of ``tokens`` is pending."""
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn_open: bool = False
    """True when the last assistant turn ended without its end-of-turn token (length or stop)."""
    parent: str | None = None
    generation: int = 0
    """Saves so far; 0 means never saved."""
    stored_by_eviction_only: bool = False
    """The store holds this session only because the engine evicted it to make room (no save was asked for):
    forgetting it with ``drop_unsaved`` deletes that copy too, so it does not outlive its use."""
    stored_digests: set[str] = field(default_factory=set)
    """Blobs known to be in the store already (not encoded again on the next save)."""
    head_blobs: tuple[str, list[str]] | None = None
    """(state blob, page blobs) of the head as last saved; how an evicted session comes back."""
    last_used: float = field(default_factory=time.monotonic)
    lock: SessionLock = field(default_factory=SessionLock)
    next_message_index: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def resident(self) -> bool:
        return self.slot is not None

    def touch(self) -> None:
        self.last_used = time.monotonic()
