"""The session manager: the one owner of session state.

It holds the (tenant, id) -> ``SessionState`` registry and each tenant's store (``StoreIO``: snapshot I/O and
prefix index), decides residency (``Residency``: slots, pages, eviction), creates, resumes, forks, saves and
forgets sessions; ``Admission`` turns calls into works for the step machinery (``EngineCore``). ``Session`` and
``TenantSessions`` are handles on its public methods; ``Engine`` is the facade over it.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from itertools import islice
from typing import Any

import anyio

from ..engine.core import EngineCore
from ..errors import CheckpointNotFound, SessionNotFound
from ..storage import SaveResult, SnapshotStore
from ..storage.manifest import SESSION_ID_PATTERN, ModelFingerprint
from ..tokenizer import Tokenizer
from ..tokenizer.chat import ChatTemplate
from ..types import SessionInfo
from .admission import Admission
from .prefix_cache import PrefixCache
from .prefix_index import PrefixHit, TokenList
from .residency import Residency
from .state import Checkpoint, SessionState
from .store_io import StoreIO, open_snapshots, tenant_store_url

log = logging.getLogger(__name__)

Key = tuple[str | None, str]


class SessionManager:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        fingerprint: ModelFingerprint,
        snapshots: SnapshotStore,
        store_url: str,
    ) -> None:
        self.core = core
        self.config = core.config
        self.tokenizer = tokenizer
        self.template = template
        self.fingerprint = fingerprint
        self.store_url = store_url
        self._held: dict[Key, SessionState] = {}
        self._stores: dict[str | None, StoreIO] = {None: StoreIO(core, fingerprint, snapshots)}
        self._stores_lock = anyio.Lock()
        self.residency = Residency(core, self._held.values, self._save_for_eviction, self.store_of)
        self.counters = {
            "prefill_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "resumes": 0, "forks": 0, "saves": 0,
            # new sessions looked up in the prefix index, those started from a stored prefix, and its tokens
            "prefix_cache_lookups": 0, "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0,
        }
        self.prefix_cache = PrefixCache(
            core, self.residency, self._held.values, self.get, self.load_unheld, self.store_of, self.counters
        )
        self.admission = Admission(core, self.residency, tokenizer, self.prefix_cache)
        self.resume_seconds: list[float] = []

    async def close(self) -> None:
        for io in self._stores.values():
            await io.close()

    # -- tenants and the registry ----------------------------------------------------------------------------

    def store_of(self, tenant: str | None) -> StoreIO:
        return self._stores[tenant]

    def stores(self) -> dict[str | None, StoreIO]:
        """Every tenant's store opened so far (a copy)."""
        return dict(self._stores)

    async def open_tenant(self, tenant: str | None) -> StoreIO:
        """The tenant's store (its own namespace and prefix index), opened and indexed on first use."""
        if tenant not in self._stores:
            async with self._stores_lock:
                if tenant not in self._stores:
                    assert tenant is not None
                    snapshots = await open_snapshots(tenant_store_url(self.store_url, tenant), self.config)
                    io = StoreIO(self.core, self.fingerprint, snapshots)
                    await io.index_stored()
                    self._stores[tenant] = io
        return self._stores[tenant]

    def get(self, tenant: str | None, session_id: str) -> SessionState | None:
        return self._held.get((tenant, session_id))

    def held(self, tenant: str | None) -> dict[str, SessionState]:
        """The tenant's sessions this engine holds in memory (resident or moved out), by id."""
        return {sid: s for (t, sid), s in self._held.items() if t == tenant}

    def is_held(self, tenant: str | None, session_id: str) -> bool:
        return (tenant, session_id) in self._held

    def num_held(self) -> int:
        return len(self._held)

    def num_resident(self) -> int:
        return sum(1 for s in self._held.values() if s.resident)

    def hold(self, s: SessionState) -> None:
        self._held[(s.tenant, s.id)] = s

    def new_id(self, tenant: str | None, session_id: str | None = None) -> str:
        """``session_id`` checked (a valid id nobody here holds), or a new random one (128 bits)."""
        sid = session_id or "s_" + secrets.token_hex(16)
        if not re.match(SESSION_ID_PATTERN, sid):
            raise ValueError(f"session_id must match {SESSION_ID_PATTERN}, got {sid!r}")
        if self.is_held(tenant, sid):
            raise ValueError(f"session {sid!r} already exists")
        return sid

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def new_state(self, tenant: str | None, sid: str, tokens: list[int]) -> SessionState:
        """A held session holding ``tokens``; it starts from the longest checkpointed prefix of them among all
        of the tenant's sessions (held or stored), never another tenant's."""
        io = self.store_of(tenant)
        self.counters["prefix_cache_lookups"] += 1
        s: SessionState | None = None
        tokens = self._keyed(tenant, tokens)  # the lookup's chain is kept
        for hit in islice(io.index.matches(tokens), 4):  # a stale entry (its session gone): the next longest
            try:
                s = await self.fork_state(tenant, hit.session_id, hit.checkpoint, sid, hold_parent=False)
            except (SessionNotFound, CheckpointNotFound):
                io.index.remove(hit.session_id, hit.checkpoint)
                continue
            self.counters["prefix_cache_hits"] += 1
            self.counters["prefix_cache_hit_tokens"] += s.num_cached
            break
        if s is None:
            s = SessionState(id=sid, tenant=tenant)
            await self.residency.make_resident(s)
        # s holds a prefix of tokens (found by its sha256 chain): take tokens whole, with the keys of every full
        # page the lookup computed, so this session's checkpoints hash nothing again
        s.tokens = tokens
        self.hold(s)
        return s

    def _keyed(self, tenant: str | None, tokens: list[int]) -> TokenList:
        """``tokens`` as a TokenList (taken as is where it is one: ``encode_chat(out=TokenList())``, no copy) with the
        page keys of the longest run of a held session's tokens that begins them (a stateless request resending a
        conversation after the session that served its last turn: ~50 ms of hashing at 1M tokens saved), else
        with none. Each held session of the tenant is tried whole, then up to its newest checkpoint (the end of
        the last message it was sent: a reply that does not re-encode as it was sampled differs after it)."""
        keyed = tokens if isinstance(tokens, TokenList) else TokenList(tokens)
        if keyed.keeps_keys:
            return keyed
        for s in sorted(self.held(tenant).values(), key=lambda s: len(s.tokens), reverse=True):
            if not isinstance(s.tokens, TokenList):
                continue
            newest = max((c.position for c in s.checkpoints.values()), default=0)
            if keyed.take_keys(s.tokens, (len(s.tokens), newest)):
                break
        return keyed

    async def resume_state(self, tenant: str | None, session_id: str) -> SessionState:
        """The held session, or else the one in the tenant's store (its head state loaded, no prefill)."""
        s = self.get(tenant, session_id)
        if s is not None:
            return s
        t0 = time.perf_counter()
        s = await self.store_of(tenant).load_session(session_id)
        s.tenant = tenant
        await self.residency.make_resident(s)
        self.hold(s)
        self.counters["resumes"] += 1
        self.resume_seconds.append(time.perf_counter() - t0)
        return s

    async def fork(self, tenant: str | None, parent_id: str, checkpoint: str | None, sid: str) -> SessionState:
        """A new held session continuing from ``checkpoint`` of ``parent_id`` (see ``fork_state``)."""
        s = await self.fork_state(tenant, parent_id, checkpoint, sid)
        self.hold(s)
        self.counters["forks"] += 1
        return s

    async def fork_state(
        self, tenant: str | None, parent_id: str, checkpoint: str | None, sid: str, *, hold_parent: bool = True
    ) -> SessionState:
        """A new session (not yet held) from ``checkpoint`` of ``parent_id`` (None or "head": its current
        position). A parent this engine does not hold is resumed (and stays held), unless ``hold_parent`` is
        False (prefix reuse) and the checkpoint is a stored one: then only its bookkeeping is loaded, for this
        fork, and nothing of it stays (no slot, no lease, not held)."""
        io = self.store_of(tenant)
        parent = self.get(tenant, parent_id)
        head = checkpoint in (None, "head")
        transient = parent is None and not hold_parent and not head
        if parent is None:
            parent = await self.load_unheld(tenant, parent_id) if transient else await self.resume_state(tenant, parent_id)
        async with parent.lock:
            cp: Checkpoint | None = None
            if not head:
                cp = parent.checkpoints.get(checkpoint or "")
                if cp is None:
                    raise CheckpointNotFound(f"session {parent_id!r} has no checkpoint {checkpoint!r}")
                cp.last_used = time.monotonic()  # the memory policy keeps checkpoints that start others
            position, state_pos = (parent.num_tokens, parent.num_cached) if cp is None else (cp.position, cp.state_pos)
            num_messages = len(parent.messages) if cp is None else cp.num_messages
            kept = parent.tokens
            child = SessionState(
                id=sid, tenant=tenant, tokens=kept.head(position) if isinstance(kept, TokenList) else kept[:position],
                num_cached=state_pos, system=parent.system,
                tools=parent.tools, messages=[dict(m) for m in parent.messages[:num_messages]],
                turn_open=parent.turn_open if cp is None else cp.turn_open, parent=parent_id,
                next_message_index=num_messages,
            )
            try:
                if cp is None:
                    await self.residency.seat_on_head(child, parent)
                    return child
                try:
                    await io.materialize(cp)
                    await self.residency.seat_on_checkpoint(child, cp)
                finally:
                    if transient:  # the child holds what it shares; nothing else does
                        self.residency.release_checkpoint(cp)
            except BaseException:  # failed or cancelled: the child, held by no one, keeps no slot or page
                self.residency.release(child, keep_checkpoint_states=False)
                raise
        return child

    async def load_unheld(self, tenant: str | None, session_id: str) -> SessionState:
        """The bookkeeping of a stored session, without a slot, without holding it and without keeping a lease
        that this load took (a fork from it would otherwise keep it in memory for the engine's life)."""
        snapshots = self.store_of(tenant).snapshots
        had_lease = session_id in snapshots.leased
        s = await self.store_of(tenant).load_session(session_id)
        if not had_lease and session_id in snapshots.leased:
            await snapshots.release_lease(session_id)
        s.tenant = tenant
        return s

    async def list_sessions(self, tenant: str | None) -> list[SessionInfo]:
        io = self.store_of(tenant)
        stored = set(await io.list_stored())
        held = self.held(tenant)
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
                m = await io.snapshots.load_manifest(sid)
            except Exception:  # listed but unreadable: skip it, do not fail the listing
                continue
            out.append(SessionInfo(
                session_id=sid, num_tokens=m.num_tokens, checkpoints=[c.name for c in m.checkpoints],
                active=False, saved=True, parent=m.parent,
            ))
        return out

    async def delete(self, tenant: str | None, session_id: str) -> None:
        """Forget the session here and in the store; SessionNotFound if neither has it."""
        io = self.store_of(tenant)
        s = self.get(tenant, session_id)
        found = s is not None
        if s is not None:
            async with s.lock:
                self.residency.release(s, keep_checkpoint_states=False)
                del self._held[(tenant, session_id)]
        io.index.remove_session(session_id)
        if session_id in await io.list_stored():
            await io.snapshots.delete_session(session_id)
            found = True
        if not found:
            raise SessionNotFound(f"no session {session_id!r}")

    async def forget(self, tenant: str | None, session_id: str, drop_unsaved: bool = False) -> bool:
        """Drop a held session from memory, leaving the store as it is (see TenantSessions.forget)."""
        io = self.store_of(tenant)
        s = self.get(tenant, session_id)
        if s is None or s.lock.locked():
            return False
        async with s.lock:
            self.residency.release(s, keep_checkpoint_states=False)
            self._held.pop((tenant, session_id), None)
            # a checkpoint never saved is gone with its host state: its index entry would make later prefills
            # skip that boundary's checkpoint (the prefix looks held) and cost each lookup a failed load
            for cp in s.checkpoints.values():
                if cp.state_blob is None or cp.page_blobs is None:
                    io.index.remove(session_id, cp.name)
        if drop_unsaved and s.stored_by_eviction_only:
            io.index.remove_session(session_id)
            await io.snapshots.delete_session(session_id)
            log.debug("deleted %s from the store: it was there only because it had been evicted", session_id)
        if session_id in io.snapshots.leased:
            await io.snapshots.release_lease(session_id)
        return True

    # -- saving ----------------------------------------------------------------------------------------------

    async def save(self, s: SessionState) -> SaveResult:
        """Make the session durable (see StoreIO.save). Caller holds ``s.lock``."""
        result = await self.store_of(s.tenant).save(s)
        s.stored_by_eviction_only = False
        self.counters["saves"] += 1
        return result

    async def _save_for_eviction(self, s: SessionState) -> None:
        await self.store_of(s.tenant).save(s)
        self.counters["saves"] += 1

    # -- checkpoints -----------------------------------------------------------------------------------------

    async def checkpoint_here(self, s: SessionState, name: str) -> Checkpoint:
        """Name the session's current position (state captured now, off the event loop) and index it."""
        cp = Checkpoint(name=name, position=s.num_tokens, state_pos=s.num_cached, num_messages=len(s.messages),
                        turn_open=s.turn_open)
        await self.residency.capture_head(s, cp)
        self.index(s, cp)
        return cp

    def index(self, s: SessionState, cp: Checkpoint) -> None:
        """Make ``cp`` a prefix other conversations of the tenant may start from."""
        self.store_of(s.tenant).index.add(s.tokens, PrefixHit(s.id, cp.name, cp.position))

    def stats(self) -> dict[str, Any]:
        c = self.counters
        ctx = c["prefill_tokens"] + c["cached_tokens"]
        return {
            "sessions_in_memory": self.num_held(),
            "sessions_active": self.num_resident(),
            **self.core.stats(),
            "cache_hit_rate": c["cached_tokens"] / ctx if ctx else 0.0,
            "resume_seconds_last": self.resume_seconds[-1] if self.resume_seconds else None,
            "prefix_index_entries": sum(len(io.index) for io in self._stores.values()),
            "segment_cache_pieces": len(self.tokenizer.segment_cache),
            "segment_cache_tokens": self.tokenizer.segment_cache.tokens,
            "segment_cache_hits": self.tokenizer.segment_cache.hits,
            "message_cache_messages": len(self.tokenizer.message_cache),
            "message_cache_tokens": self.tokenizer.message_cache.tokens,
            "message_cache_hits": self.tokenizer.message_cache.hits,
            "tenants": len(self._stores),
            "evictions": self.residency.evictions,
            **c,
        }
