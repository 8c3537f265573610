"""Per-session bookkeeping: a plain object with counters. Tensors live in the pools (``engine.pool.Pools``),
checkpoint states included (in its host pool, by id)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..engine.sequence import Checkpoint, Sequence
from .prefix_index import TokenList

__all__ = ["Checkpoint", "SessionLock", "SessionState"]


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


@dataclass(eq=False)  # compared by identity
class SessionState(Sequence):
    """A conversation: the sequence the engine runs (tokens, slot, pages, checkpoints) and what the session
    layer adds (tenant, chat messages, store generation, lock)."""

    tenant: str | None = None
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

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, TokenList):  # keeps its page chain as it grows (the prefix index's)
            self.tokens = TokenList(self.tokens)

    def touch(self) -> None:
        self.last_used = time.monotonic()
