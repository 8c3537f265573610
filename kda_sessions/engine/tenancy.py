"""Sessions of one tenant: the public session API, scoped.

Every tenant has its own snapshot store namespace (blob keys, manifests), its own prefix index and its own
session ids: another tenant's valid id answers exactly like an unknown one, and prefix reuse never crosses
tenants. ``Engine``'s own methods act for the default tenant (None); a server maps each API key to a tenant and
uses ``engine.for_tenant(name)``.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import CheckpointNotFound, SessionNotFound
from ..sessions.state import SessionState
from ..storage.manifest import SESSION_ID_PATTERN
from .constraint import check_tools
from .types import SessionInfo

if TYPE_CHECKING:
    from ..sessions.session import Session
    from .engine import Engine
    from .snapshots import SnapshotIO

log = logging.getLogger(__name__)

TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def tenant_store_url(url: str, tenant: str) -> str:
    """The store URL of a tenant's namespace: a sub-folder on disk, a key prefix in Redis, its own memory."""
    if not re.match(TENANT_PATTERN, tenant):
        raise ValueError(f"tenant must match {TENANT_PATTERN}, got {tenant!r}")
    scheme, _, rest = url.partition(":")
    if scheme == "disk":
        from ..storage.backends.registry import default_disk_root

        root = rest or str(default_disk_root())
        return f"disk:{root.rstrip('/')}/tenants/{tenant}"
    if scheme in ("redis", "rediss"):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        query["prefix"] = f"{query.get('prefix', 'kda:')}t.{tenant}:"
        return urlunsplit(parts._replace(query=urlencode(query)))
    return url  # memory: every open is a new, separate store


def new_session_id() -> str:
    """128 random bits, URL- and path-safe."""
    import secrets

    return "s_" + secrets.token_hex(16)


class TenantEngine:
    """The session API of ``Engine`` (create, resume, fork, list, delete) for one tenant."""

    def __init__(self, engine: Engine, tenant: str | None, io: SnapshotIO) -> None:
        self.engine = engine
        self.tenant = tenant
        self.io = io

    @property
    def sessions(self) -> dict[str, SessionState]:
        """This tenant's sessions held by the engine, by id."""
        return {sid: s for (t, sid), s in self.engine._sessions.items() if t == self.tenant}

    def _get(self, sid: str) -> SessionState | None:
        return self.engine._sessions.get((self.tenant, sid))

    def holds(self, session_id: str) -> bool:
        """Whether this engine holds the session in memory (resident or moved out), not just in the store."""
        return self._get(session_id) is not None

    def _put(self, s: SessionState) -> None:
        s.tenant = self.tenant
        self.engine._sessions[(self.tenant, s.id)] = s

    def _check_new_id(self, session_id: str | None) -> str:
        sid = session_id or new_session_id()
        if not re.match(SESSION_ID_PATTERN, sid):
            raise ValueError(f"session_id must match {SESSION_ID_PATTERN}, got {sid!r}")
        if self._get(sid) is not None:
            raise ValueError(f"session {sid!r} already exists")
        return sid

    def _handle(self, s: SessionState) -> Session:
        from ..sessions.session import Session

        return Session(self.engine, s)

    # -- create ----------------------------------------------------------------------------------------------

    async def create_session(
        self, system: str | None = None, tools: list[dict[str, Any]] | None = None, *, session_id: str | None = None
    ) -> Session:
        messages = [{"role": "system", "content": system}] if system else []
        s = await self._from_messages(messages, tools, session_id)
        return self._handle(s)

    async def create_session_from_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *, session_id: str | None = None
    ) -> Session:
        return self._handle(await self._from_messages(messages, tools, session_id))

    async def _from_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, session_id: str | None
    ) -> SessionState:
        from ..tokenizer import encode_chat

        eng = self.engine
        sid = self._check_new_id(session_id)
        check_tools(tools)
        tokens = encode_chat(eng.tokenizer, messages, tools, add_generation_prompt=False, template=eng.template) if (messages or tools) else []
        s = await self._start_from_prefix(sid, tokens)
        s.system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
        s.tools = tools
        s.messages = [dict(m) for m in messages]
        s.next_message_index = len(messages)
        s.turn_open = False
        return s

    async def _start_from_prefix(self, sid: str, tokens: list[int]) -> SessionState:
        """A fresh session holding ``tokens``; starts from the longest checkpointed prefix of them among all of
        this tenant's sessions (held or stored), never another tenant's."""
        hit = self.io.index.longest(tokens)
        counters = self.engine.counters
        counters["prefix_cache_lookups"] += 1
        s: SessionState | None = None
        if hit is not None:
            try:
                s = await self._fork_state(hit.session_id, hit.checkpoint, sid, hold_parent=False)
            except (SessionNotFound, CheckpointNotFound):
                s = None
            else:
                counters["prefix_cache_hits"] += 1
                counters["prefix_cache_hit_tokens"] += s.num_cached
        if s is None:
            s = SessionState(id=sid, tenant=self.tenant)
            await self.engine._make_resident(s)
        s.tokens.extend(tokens[len(s.tokens) :])
        self._put(s)
        return s

    # -- resume, fork ----------------------------------------------------------------------------------------

    async def resume(self, session_id: str) -> Session:
        s = self._get(session_id)
        if s is not None:
            return self._handle(s)
        eng = self.engine
        t0 = time.perf_counter()
        s = await self.io.load_session(session_id)
        s.tenant = self.tenant
        await eng._make_resident(s)
        self._put(s)
        eng.counters["resumes"] += 1
        eng.resume_seconds.append(time.perf_counter() - t0)
        return self._handle(s)

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> Session:
        sid = self._check_new_id(new_id)
        s = await self._fork_state(session_id, checkpoint, sid)
        self._put(s)
        self.engine.counters["forks"] += 1
        return self._handle(s)

    async def _fork_state(
        self, parent_id: str, checkpoint: str | None, sid: str, *, hold_parent: bool = True
    ) -> SessionState:
        """A new session from ``checkpoint`` of ``parent_id``. A parent this engine does not hold is resumed
        (and stays held), unless ``hold_parent`` is False (prefix reuse) and the checkpoint is a stored one: then
        only its bookkeeping is loaded, for this fork, and nothing of it stays (no slot, no lease, not held)."""
        parent = self._get(parent_id)
        transient = parent is None and not hold_parent and checkpoint not in (None, "head")
        if parent is None:
            parent = await self._load_unheld(parent_id) if transient else (await self.resume(parent_id)).state
        async with parent.lock:
            if checkpoint is None or checkpoint == "head":
                await self.engine._make_resident(parent)  # an evicted parent's head is in the store only
                cp = self.engine._head_checkpoint(parent)
            elif checkpoint in parent.checkpoints:
                cp = parent.checkpoints[checkpoint]
            else:
                raise CheckpointNotFound(f"session {parent_id!r} has no checkpoint {checkpoint!r}")
            child = SessionState(
                id=sid,
                tenant=self.tenant,
                tokens=parent.tokens[: cp.position],
                num_cached=cp.state_pos,
                system=parent.system,
                tools=parent.tools,
                messages=[dict(m) for m in parent.messages[: cp.num_messages]],
                turn_open=cp.turn_open,
                parent=parent_id,
                next_message_index=cp.num_messages,
            )
            try:
                await self.io.materialize(cp)
                await self.engine._seat_from_checkpoint(child, cp)
            finally:
                if cp.name == "__head__" or transient:  # the child holds what it shares; nothing else does
                    self.engine._release_checkpoint(cp)
        return child

    async def _load_unheld(self, session_id: str) -> SessionState:
        """The bookkeeping of a stored session, without a slot, without holding it and without keeping a lease
        that this load took (a fork from it would otherwise keep it in memory for the engine's life)."""
        had_lease = session_id in self.io.snapshots.leased
        s = await self.io.load_session(session_id)
        if not had_lease and session_id in self.io.snapshots.leased:
            await self.io.snapshots.release_lease(session_id)
        s.tenant = self.tenant
        return s

    # -- list, delete ----------------------------------------------------------------------------------------

    async def list_sessions(self) -> list[SessionInfo]:
        stored = set(await self.io.list_stored())
        held = self.sessions
        out = []
        for sid in sorted(stored | set(held)):
            s = held.get(sid)
            if s is not None:
                out.append(SessionInfo(
                    session_id=sid, num_tokens=s.num_tokens, checkpoints=sorted(s.checkpoints), active=s.resident,
                    saved=sid in stored, parent=s.parent,
                ))
                continue
            try:
                m = await self.io.snapshots.load_manifest(sid)
            except Exception:  # listed but unreadable: skip it, do not fail the listing
                continue
            out.append(SessionInfo(
                session_id=sid, num_tokens=m.num_tokens, checkpoints=[c.name for c in m.checkpoints],
                active=False, saved=True, parent=m.parent,
            ))
        return out

    async def delete_session(self, session_id: str) -> None:
        s = self._get(session_id)
        found = s is not None
        if s is not None:
            async with s.lock:
                self.engine._release(s, keep_checkpoint_states=False)
                del self.engine._sessions[(self.tenant, session_id)]
        self.io.index.remove_session(session_id)
        if session_id in await self.io.list_stored():
            await self.io.snapshots.delete_session(session_id)
            found = True
        if not found:
            raise SessionNotFound(f"no session {session_id!r}")

    async def forget(self, session_id: str, drop_unsaved: bool = False) -> bool:
        """Drop a held session from this engine's memory, leaving the store as it is: its slot, KV pages and
        checkpoint states are freed and its write lease given back. A saved session can be resumed again from
        the store; an unsaved one is gone. With ``drop_unsaved``, a copy the engine wrote only to evict the
        session (nobody asked for a save) is deleted from the store as well. False if the engine does not hold
        it or it is answering a call."""
        s = self._get(session_id)
        if s is None or s.lock.locked():
            return False
        async with s.lock:
            self.engine._release(s, keep_checkpoint_states=False)
            self.engine._sessions.pop((self.tenant, session_id), None)
        if drop_unsaved and s.stored_by_eviction_only:
            self.io.index.remove_session(session_id)
            await self.io.snapshots.delete_session(session_id)
            log.debug("deleted %s from the store: it was there only because it had been evicted", session_id)
        if session_id in self.io.snapshots.leased:
            await self.io.snapshots.release_lease(session_id)
        return True

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
