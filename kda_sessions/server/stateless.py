"""Sessions created by chat completions that named no ``session_id``: held for a while, then forgotten.

An OpenAI-style client sends its whole history with every request; each such request becomes a new session
(started from the longest stored prefix) whose id the response carries, so the client may continue it. Nobody
deletes those sessions, so without a bound every request would keep a session (its token history, checkpoint
states, and a slot and KV pages or, once evicted, a snapshot written to the store) for the life of the server.
``StatelessSessions`` forgets such a session from the engine's memory once it has been idle for
``stateless_session_ttl_s`` (120 s) or when more than ``max_stateless_sessions`` (32) are held (least recently used first).
A session the client saved (``POST /v1/sessions/{id}/save``) resumes from the store afterwards; an unsaved one
answers 404, and a copy the engine wrote only to evict it under memory pressure is deleted from the store when
it is forgotten, so the store does not grow with every request either. Sessions created through
``/v1/sessions`` are never forgotten.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..engine.tenancy import TenantEngine

log = logging.getLogger(__name__)

Key = tuple[str | None, str]


class StatelessSessions:
    """LRU of (tenant, session id) -> last use, for sessions created by stateless requests."""

    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._last_used: OrderedDict[Key, float] = OrderedDict()
        self._in_use: dict[Key, int] = {}
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._last_used)

    def __contains__(self, key: object) -> bool:
        return key in self._last_used

    @asynccontextmanager
    async def use(self, view: TenantEngine, session_id: str, *, created: bool) -> AsyncIterator[None]:
        """Around one request on ``session_id``: track it if ``created`` (or already tracked), keep it from
        being forgotten while the request runs, then forget what is idle too long or too many."""
        key = (view.tenant, session_id)
        tracked = created or key in self._last_used
        if tracked:
            self._in_use[key] = self._in_use.get(key, 0) + 1
            self._touch(key)
        try:
            yield
        finally:
            if tracked:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]
                self._touch(key)
            await self.sweep(view)

    def _touch(self, key: Key) -> None:
        self._last_used[key] = time.monotonic()
        self._last_used.move_to_end(key)

    async def sweep(self, view: TenantEngine) -> int:
        """Forget tracked sessions idle longer than the TTL, then the least recently used beyond the cap
        (sessions of other tenants are forgotten through their own views). How many were forgotten."""
        now = time.monotonic()
        over = len(self._last_used) - self.max_sessions
        victims = []
        for key, used in self._last_used.items():  # oldest first
            if key[0] != view.tenant or key in self._in_use:
                continue
            if now - used > self.ttl_s or over > 0:
                victims.append(key)
                over -= 1
            else:
                break
        n = 0
        for key in victims:
            if await view.forget(key[1], drop_unsaved=True) or not view.holds(key[1]):
                self._last_used.pop(key, None)
                n += 1
        self.forgotten += n
        if n:
            log.debug("forgot %d idle stateless sessions (%d held)", n, len(self._last_used))
        return n
