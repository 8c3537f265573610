"""Sessions answered through chat completions: saved after every turn, held in memory for a while, expired
from the store by a documented policy.

An OpenAI-style client sends its whole history with every request; each such request becomes a new session
(id ``s_chat_...``, started from the longest stored prefix) whose id the response carries, so the client may
continue it with ``session_id``. The policy (``ServerSettings``; flags of ``kda-sessions serve``):

* Durable: once a chat completion's reply is sent, its session is saved (``save_chat_sessions``). The client
  does not wait for the write and other sessions' decode does not either (snapshot I/O runs off the forward
  path; only this session's next request waits for it). Its ``session_id`` then answers after the session is
  forgotten from memory, evicted, or the server restarts.
* Memory: a session created without ``session_id`` is forgotten from the engine's memory (its slot, KV pages and
  checkpoint states) once idle for ``stateless_session_ttl_s`` (120 s) or when more than
  ``max_stateless_sessions`` (32) are held, least recently used first; its next request resumes it from the
  store. One whose last save failed is kept in memory until a save succeeds.
* Store: an ``s_chat_`` session not used for ``chat_session_retention_s`` (7 days; 0: never) is deleted from
  the store; until then it answers. Sessions created through ``/v1/sessions`` are never forgotten or expired.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict

import anyio

from ..sessions.session import Session
from ..sessions.tenancy import TenantSessions

log = logging.getLogger(__name__)

Key = tuple[str | None, str]
CHAT_SESSION_PREFIX = "s_chat_"


def new_chat_session_id() -> str:
    """An id for a session a chat completion creates: 128 random bits, marked for the retention policy."""
    return CHAT_SESSION_PREFIX + secrets.token_hex(16)


class StatelessSessions:
    """LRU of (tenant, session id) -> last use, for sessions created by chat completions, and their saves."""

    def __init__(self, ttl_s: float, max_sessions: int, *, save: bool = True, retention_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.save = save
        self.retention_s = retention_s
        self._last_used: OrderedDict[Key, float] = OrderedDict()
        self._in_use: dict[Key, int] = {}
        self._unsaved: set[Key] = set()
        self._expired_at: dict[str | None, float] = {}
        self.forgotten = 0
        self.saved = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._last_used)

    def __contains__(self, key: object) -> bool:
        return key in self._last_used

    def begin(self, view: TenantSessions, session_id: str, *, created: bool) -> None:
        """Before a request on ``session_id``: track it if ``created`` (or already tracked) and keep it from
        being forgotten until ``finish``."""
        key = (view.tenant, session_id)
        self._in_use[key] = self._in_use.get(key, 0) + 1
        if created or key in self._last_used:
            self._touch(key)

    async def finish(self, view: TenantSessions, session: Session, *, answered: bool = True) -> None:
        """After the request (its reply sent): save the session, then forget what is idle too long or too many
        and expire what the retention policy says. A request that failed (``answered`` False) saves nothing: a
        session it created is forgotten with the next sweep. Never raises: the reply is already out."""
        key = (view.tenant, session.id)
        with anyio.CancelScope(shield=True):
            try:
                if self.save and answered:
                    await self._save(key, session)
            finally:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]
                if key in self._last_used:
                    self._touch(key)
            await self.tidy(view)
            await self.tidy(view, expire=True)

    async def tidy(self, view: TenantSessions, *, expire: bool = False) -> None:
        """``sweep`` (or ``expire``), logging instead of raising: a store outage waits for the next request.
        Routes sweep before they answer too, so the bounds hold as soon as a reply is out."""
        try:
            await (self.expire(view) if expire else self.sweep(view))
        except Exception as e:
            log.warning("sweeping chat sessions failed: %s: %s", type(e).__name__, e)

    async def _save(self, key: Key, session: Session) -> None:
        try:
            await session.save()
        except Exception as e:  # kept in memory (and retried before it is forgotten)
            self._unsaved.add(key)
            log.warning("session %s: save after the turn failed: %s: %s", key[1], type(e).__name__, e)
        else:
            self._unsaved.discard(key)
            self.saved += 1

    def _touch(self, key: Key) -> None:
        self._last_used[key] = time.monotonic()
        self._last_used.move_to_end(key)

    async def sweep(self, view: TenantSessions) -> int:
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
            if key in self._unsaved and view.holds(key[1]):
                await self._save(key, await view.resume(key[1]))
                if key in self._unsaved:
                    continue
            # saved sessions stay in the store; a copy that exists only because the engine evicted the session
            # (saving off, or a request that failed) is dropped with it
            if await view.forget(key[1], drop_unsaved=True) or not view.holds(key[1]):
                self._last_used.pop(key, None)
                n += 1
        self.forgotten += n
        if n:
            log.debug("forgot %d idle chat sessions (%d held)", n, len(self._last_used))
        return n

    async def expire(self, view: TenantSessions, *, force: bool = False) -> int:
        """Delete this tenant's stored ``s_chat_`` sessions unused for longer than the retention (at most every
        quarter of it, and at least hourly); how many were deleted."""
        if self.retention_s <= 0:
            return 0
        now = time.time()
        if not force and now - self._expired_at.get(view.tenant, 0.0) < min(self.retention_s / 4, 3600.0):
            return 0
        self._expired_at[view.tenant] = now
        n = 0
        for sid in await view.io.list_stored():
            if not sid.startswith(CHAT_SESSION_PREFIX) or view.holds(sid):
                continue
            try:
                manifest = await view.io.snapshots.load_manifest(sid)
            except Exception:  # unreadable or deleted meanwhile: not ours to judge
                continue
            if now - manifest.saved_at > self.retention_s:
                await view.delete_session(sid)
                n += 1
        self.expired += n
        if n:
            log.info("deleted %d chat sessions unused for %.0f s", n, self.retention_s)
        return n
