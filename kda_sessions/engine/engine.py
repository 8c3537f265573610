"""The public engine: sessions in, replies out. Owns the model, the pools, the store and the step thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch

from ..errors import SessionBusy, SnapshotConflict
from ..model import HybridModel, load_model
from ..sessions.prefix_index import PrefixIndex
from ..sessions.state import Checkpoint, SessionState
from ..storage import SnapshotStore
from ..storage.manifest import ModelFingerprint
from ..tokenizer import (
    ByteTokenizer,
    Tokenizer,
    TokenizerNotFound,
    builtin_template,
    load_chat_template,
    load_tokenizer,
)
from ..tokenizer.chat import ChatTemplate
from .config import EngineConfig
from .constraint import ToolChoiceConstraint, parse_tool_choice
from .json_prefix import check_top_level, decoding_schema
from .json_reply import JsonReplyConstraint, response_schema
from .leases import LeaseKeeper
from .pool import OutOfPages, OutOfSlots, PageAllocator, SlotAllocator
from .runner import Runner
from .sampler import SamplingParams
from .scheduler import Scheduler, Work, pages_needed
from .snapshots import SnapshotIO
from .tenancy import TenantEngine, tenant_store_url
from .types import SessionInfo

log = logging.getLogger(__name__)


class Engine:
    """Open with ``await Engine.open(...)`` (also an async context manager). See DESIGN.md for the contract."""

    def __init__(
        self,
        model: HybridModel,
        model_id: str,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        snapshots: SnapshotStore,
        config: EngineConfig,
        store_url: str = "memory:",
    ) -> None:
        self.model = model
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.template = template
        self.config = config
        self.pools = model.allocate_pools(config.max_active_sessions, config.num_pages, config.page_size)
        self.slots = SlotAllocator(config.max_active_sessions)
        self.pages = PageAllocator(config.num_pages)
        self.mutex = threading.RLock()
        self.scheduler = Scheduler(config.prefill_chunk_tokens, config.max_queued_requests)
        self._sessions: dict[tuple[str | None, str], SessionState] = {}
        self.store_url = store_url
        self.fingerprint = ModelFingerprint(
            model_id=model_id,
            config_hash=model.config.fingerprint,
            dtype=str(model.dtype).removeprefix("torch."),
            page_size=config.page_size,
        )
        self.spaces: dict[str | None, TenantEngine] = {None: TenantEngine(self, None, SnapshotIO(self, snapshots))}
        self._spaces_lock = anyio.Lock()
        self._work_ended = anyio.Event()
        """Set (and replaced) whenever works end; what a request waiting for pages waits on."""
        self._token = anyio.lowlevel.current_token()
        self.runner = Runner(
            model, self.pools, self.pages, self.scheduler, tokenizer, self.mutex, self._deliver_from_thread,
            cuda_graphs=config.cuda_graphs,
        )
        self.counters = {
            "prefill_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "resumes": 0, "forks": 0, "saves": 0,
            # new sessions looked up in the prefix index, those started from a stored prefix, and its tokens
            "prefix_cache_lookups": 0, "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0,
        }
        self.resume_seconds: list[float] = []
        self.closed = False
        self.runner.start()
        self.leases = LeaseKeeper(self, self._token)
        self.leases.start()

    # -- lifecycle -------------------------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        model: str | Path = "tiny-random",
        store: str = "disk:",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> Engine:
        """Load ``model`` (a built-in name or a Kimi-Linear checkpoint directory) and open ``store``
        (``disk:PATH``, ``redis://host:port/db``, ``memory:``). ``overrides`` are EngineConfig fields."""
        config = (config or EngineConfig()).model_copy(update=overrides)
        config = EngineConfig.model_validate(config.model_dump())
        m = await anyio.to_thread.run_sync(lambda: load_model(model, device=device, dtype=dtype))
        try:
            tokenizer = load_tokenizer(str(model))
        except TokenizerNotFound:
            # a checkpoint saved by save_model for the byte-level built-in vocabulary carries no tokenizer file
            if m.config.vocab_size != ByteTokenizer().vocab_size:
                raise
            log.warning("no tokenizer files in %s: using the built-in byte tokenizer (vocabulary %d)", model, m.config.vocab_size)
            tokenizer = ByteTokenizer()
        template = builtin_template() if str(model) in ("tiny-random", "tiny") else load_chat_template(model, tokenizer)
        snapshots = await open_snapshots(store, config)
        engine = cls(m, Path(str(model)).name, tokenizer, template, snapshots, config, store)
        try:
            indexed = await engine.io.index_stored()
        except BaseException:
            await engine.close()
            raise
        log.info("prefix index: %d stored checkpoints", indexed)
        return engine

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.leases.stop()
        await anyio.to_thread.run_sync(self.runner.stop)
        for view in self.spaces.values():
            await view.io.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tenants -------------------------------------------------------------------------------------------

    async def for_tenant(self, tenant: str | None) -> TenantEngine:
        """The session API scoped to ``tenant`` (its own store namespace, prefix index and ids)."""
        if tenant not in self.spaces:
            async with self._spaces_lock:
                if tenant not in self.spaces:
                    assert tenant is not None
                    snapshots = await open_snapshots(tenant_store_url(self.store_url, tenant), self.config)
                    view = TenantEngine(self, tenant, SnapshotIO(self, snapshots))
                    await view.io.index_stored()
                    self.spaces[tenant] = view
        return self.spaces[tenant]

    def space_of(self, s: SessionState) -> SnapshotIO:
        return self.spaces[s.tenant].io

    @property
    def default(self) -> TenantEngine:
        return self.spaces[None]

    @property
    def io(self) -> SnapshotIO:
        return self.default.io

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.default.io.index

    @property
    def sessions(self) -> dict[str, SessionState]:
        """The default tenant's sessions held by this engine, by id."""
        return self.default.sessions

    # -- sessions (default tenant; see TenantEngine) ---------------------------------------------------------

    async def create_session(
        self,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> Session:
        """A new session whose context starts with the system prompt and tool declarations (prefilled lazily
        with the first call, or reused from a stored checkpoint with the same prefix)."""
        return await self.default.create_session(system, tools, session_id=session_id)

    async def create_session_from_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> Session:
        """A new session holding a whole conversation (ending with a closed turn), started from the longest
        checkpointed prefix of its tokens: a client that resends its full history prefills only what is new."""
        return await self.default.create_session_from_messages(messages, tools, session_id=session_id)

    async def resume(self, session_id: str) -> Session:
        """The session from this engine, or else from the store (no prefill: its state is loaded)."""
        return await self.default.resume(session_id)

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> Session:
        """A new session continuing from ``checkpoint`` (default: the parent's current position) of
        ``session_id``. Full KV pages are shared; only the partial last page is copied."""
        return await self.default.fork(session_id, checkpoint, new_id=new_id)

    async def list_sessions(self) -> list[SessionInfo]:
        return await self.default.list_sessions()

    async def delete_session(self, session_id: str) -> None:
        """Forget the session here and in the store; blobs nothing else references are reclaimed."""
        await self.default.delete_session(session_id)

    async def _seat_from_checkpoint(self, child: SessionState, cp: Checkpoint) -> None:
        """Give ``child`` a slot holding the checkpoint's state, share its full pages and copy the partial one."""
        await self._make_resident(child)
        with self.mutex:
            assert cp.kda is not None and cp.conv is not None and child.slot is not None
            for i, (state, conv) in enumerate(zip(self.pools.kda, self.pools.conv)):
                state[child.slot] = cp.kda[i].to(state.device)
                conv[child.slot] = cp.conv[i].to(conv.device)
            P = self.config.page_size
            full, rows = divmod(cp.state_pos, P)
            child.pages = list(cp.pages[:full])
            self.pages.incref(child.pages)
            if rows:  # copy-on-write of the partial last page
                (page,) = self._alloc_pages(1)
                for kv in self.pools.kv:
                    kv[page, :rows] = kv[cp.pages[full], :rows]
                child.pages.append(page)

    def _head_checkpoint(self, s: SessionState) -> Checkpoint:
        """A transient checkpoint of the current position (its pages are referenced; release after use)."""
        assert s.slot is not None
        with self.mutex:
            kda = torch.stack([st[s.slot] for st in self.pools.kda]).cpu()
            conv = torch.stack([c[s.slot] for c in self.pools.conv]).cpu()
            pages = s.pages[: pages_needed(s.num_cached, self.config.page_size)]
            self.pages.incref(pages)
        return Checkpoint(
            name="__head__", position=s.num_tokens, state_pos=s.num_cached, kda=kda, conv=conv, pages=pages,
            num_messages=len(s.messages), turn_open=s.turn_open,
        )

    def trim_checkpoints(self, s: SessionState) -> None:
        """Bound the host memory a long conversation holds in checkpoints: keep the newest
        ``max_checkpoints_in_memory`` automatic (msg-N) ones in memory; an older one that was saved keeps only its
        stored blobs (a fork loads them back), an unsaved one is dropped. Named checkpoints are always kept."""
        auto = [c for c in s.checkpoints.values() if c.name.startswith("msg-") and (c.kda is not None or c.pages)]
        for c in sorted(auto, key=lambda c: c.position)[: max(0, len(auto) - self.config.max_checkpoints_in_memory)]:
            self._release_checkpoint(c)
            c.kda = c.conv = None
            if c.state_blob is None or c.page_blobs is None:
                del s.checkpoints[c.name]

    def _release_checkpoint(self, cp: Checkpoint) -> None:
        with self.mutex:
            if cp.pages:
                self.pages.decref(cp.pages)
            cp.pages = []

    def stats(self) -> dict[str, Any]:
        c = self.counters
        ctx = c["prefill_tokens"] + c["cached_tokens"]
        return {
            "sessions_in_memory": len(self._sessions),
            "sessions_active": sum(1 for s in self._sessions.values() if s.resident),
            "slots_free": self.slots.num_free,
            "pages_free": self.pages.num_free,
            "pages_reserved": self.pages.reserved,
            "pages_total": self.pages.num_pages,
            "page_size": self.config.page_size,
            "queue_depth": self.scheduler.num_queued(),
            "steps": self.runner.steps,
            "tokens_prefilled": self.runner.tokens_prefilled,
            "tokens_decoded": self.runner.tokens_decoded,
            "cache_hit_rate": c["cached_tokens"] / ctx if ctx else 0.0,
            "resume_seconds_last": self.resume_seconds[-1] if self.resume_seconds else None,
            "prefix_index_entries": sum(len(v.io.index) for v in self.spaces.values()),
            "tenants": len(self.spaces),
            **c,
        }

    # -- residency -------------------------------------------------------------------------------------------

    def _alloc_pages(self, n: int) -> list[int]:
        with self.mutex:
            return self.pages.alloc(n)

    async def _make_resident(self, s: SessionState) -> None:
        """Give ``s`` a state slot (evicting idle sessions to the store if none is free) and, for a session that
        was saved and moved out, load its head state and pages back. On failure nothing stays allocated."""
        if s.resident:
            return
        slot = await self._alloc_slot(exclude=s)
        s.slot = slot
        with self.mutex:
            for st, conv in zip(self.pools.kda, self.pools.conv):
                st[slot].zero_()
                conv[slot].zero_()
        if s.head_blobs is not None:
            try:
                await self.space_of(s).restore_head(s)
            except BaseException:
                self._release(s, keep_checkpoint_states=True)
                raise

    async def _alloc_slot(self, exclude: SessionState) -> int:
        while True:
            with self.mutex:
                try:
                    return self.slots.alloc()
                except OutOfSlots:
                    pass
            if not await self._evict_one(exclude):
                raise OutOfSlots(f"all {self.slots.num_slots} state slots hold sessions that are busy")

    async def ensure_pages(self, s: SessionState, total_tokens: int) -> None:
        """Make sure the pool can give ``s`` pages for ``total_tokens`` tokens: evict idle sessions, and while
        running requests hold pages, wait (up to ``config.page_wait_s``) for them to end and their sessions to
        become idle, so that a request queues instead of failing when the pool is only busy for now."""
        need = pages_needed(total_tokens, self.config.page_size) - len(s.pages)
        deadline = anyio.current_time() + self.config.page_wait_s
        while need > self.pages.num_free:
            if await self._evict_one(s):
                continue
            busy = self.scheduler.has_work or any(x.lock.locked() for x in self._sessions.values() if x is not s)
            left = deadline - anyio.current_time()
            if not busy or left <= 0:
                raise OutOfPages(f"need {need} KV pages, {self.pages.num_free} free and every session is busy")
            with anyio.move_on_after(min(left, 0.25)):  # a work ending, or a caller releasing its session
                await self._work_ended.wait()

    async def _evict_one(self, exclude: SessionState) -> bool:
        """Save the least recently used idle resident session to the store and free its slot and pages. A session
        this engine cannot save (another engine holds its lease, or saved it since) is skipped for the next one."""
        idle = [s for s in self._sessions.values() if s.resident and s is not exclude and not s.lock.locked()]
        for victim in sorted(idle, key=lambda s: s.last_used):
            if victim.lock.locked():
                continue
            async with victim.lock:
                if not victim.resident:
                    return True
                never_saved = victim.generation == 0
                try:
                    await self.space_of(victim).save(victim)
                except (SessionBusy, SnapshotConflict) as e:
                    log.warning("cannot evict session %s: %s: %s", victim.id, type(e).__name__, e)
                    continue
                victim.stored_by_eviction_only = victim.stored_by_eviction_only or never_saved
                self._release(victim, keep_checkpoint_states=True)
            log.info("evicted idle session %s to the store", victim.id)
            return True
        return False

    def _release(self, s: SessionState, keep_checkpoint_states: bool) -> None:
        with self.mutex:
            if s.slot is not None:
                self.slots.free(s.slot)
                s.slot = None
            if s.pages:
                self.pages.decref(s.pages)
                s.pages = []
            for cp in s.checkpoints.values():
                if cp.pages:
                    self.pages.decref(cp.pages)
                    cp.pages = []
                if not keep_checkpoint_states:
                    cp.kda = cp.conv = None

    # -- running work ----------------------------------------------------------------------------------------

    async def start(
        self,
        s: SessionState,
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        checkpoints: list[Checkpoint] | None = None,
        on_token: Callable[[int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> Work:
        """Queue the session's pending tokens for prefill and (unless prefill_only) generation.
        Caller holds ``s.lock`` until the work has finished (see ``wait``). ``response_format`` (OpenAI's shape)
        constrains the reply to JSON; it cannot be combined with a tool_choice that forces a call."""
        capacity = self.config.num_pages * self.config.page_size
        if s.num_tokens + (0 if prefill_only else params.max_tokens) > capacity:
            raise ValueError(
                f"max_tokens={params.max_tokens} after a context of {s.num_tokens} tokens exceeds this engine's KV "
                f"capacity of {capacity} tokens"
            )
        # everything a request can get wrong is refused here, before the session or the pools change
        choice = parse_tool_choice(tool_choice, s.tools)
        schema = response_schema(response_format)
        if schema is not None and choice not in (None, "none"):
            raise ValueError("response_format cannot be combined with a tool_choice that forces a tool call")
        constraint: ToolChoiceConstraint | JsonReplyConstraint | None = None
        if schema is not None:
            check_top_level(schema, "response_format.json_schema.schema")
            constraint = JsonReplyConstraint(self.tokenizer, decoding_schema(schema))
        elif choice is not None:
            constraint = ToolChoiceConstraint(self.tokenizer, s.tools, choice)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        if s.num_tokens <= s.num_cached and not prefill_only:
            raise ValueError(f"session {s.id!r} has no tokens to continue from; append some first")
        await self._make_resident(s)
        total = s.num_tokens + (0 if prefill_only else params.max_tokens)
        await self.ensure_pages(s, total)
        prompt = s.tokens[s.num_cached :]
        if prefill_only:
            prompt = prompt[:-1]  # keep one token pending so the next generate has logits to sample from
        work = Work(session=s, prompt=prompt, params=params, prefill_only=prefill_only, on_token=on_token,
                    on_finish=on_finish, generator=generator, constraint=constraint)
        work.checkpoints = [c for c in s.checkpoints.values() if c.state_pos < c.target] + list(checkpoints or [])
        if not prompt:
            work.finish_reason = "stop"
            work.finished.set()
            if on_finish is not None:
                on_finish()
            return work
        with self.mutex:
            # set aside every page this request may need (ensure_pages just made them free, with no await since)
            work.reserved_pages = max(0, pages_needed(total, self.config.page_size) - len(s.pages))
            self.pages.reserve(work.reserved_pages)
            try:
                self.scheduler.submit(work)
            except BaseException:
                self._unreserve(work)
                raise
        self.runner.notify()
        return work

    def _unreserve(self, work: Work) -> None:
        with self.mutex:
            self.pages.unreserve(work.reserved_pages)
            work.reserved_pages = 0

    async def wait(self, work: Work) -> Work:
        """Wait for ``work``; if the waiting task is cancelled, the work is cancelled and its batch slot freed."""
        try:
            await work.finished.wait()
        except BaseException:
            await self.cancel(work)
            raise
        work.session.touch()
        if work.error is not None:
            raise work.error
        return work

    async def cancel(self, work: Work) -> None:
        work.cancelled = True
        self.runner.notify()
        with anyio.CancelScope(shield=True):
            await work.finished.wait()

    def _deliver_from_thread(self, finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        # On asyncio, hand the results over without waiting for the loop, so the next step starts at once;
        # other backends get a blocking hand-over.
        loop = getattr(self._token, "native_token", None)
        try:
            if isinstance(loop, asyncio.AbstractEventLoop):
                loop.call_soon_threadsafe(self._deliver, finished, sampled)
            else:
                anyio.from_thread.run_sync(self._deliver, finished, sampled, token=self._token)
        except RuntimeError:  # the event loop is gone (engine not closed before its loop ended)
            log.warning("engine results dropped: the event loop that opened the engine has stopped")

    def _deliver(self, finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        for w, tok in sampled:
            if w.on_token is not None and not w.cancelled:
                w.on_token(tok)  # type: ignore[operator]
        for w in finished:
            self._unreserve(w)
            w.finished.set()
            if w.on_finish is not None:
                w.on_finish()
        if finished:
            self._work_ended.set()
            self._work_ended = anyio.Event()


async def open_snapshots(url: str, config: EngineConfig) -> SnapshotStore:
    """The snapshot store at ``url`` with the engine's RAM tier, GC grace and lease lifetime."""
    snapshots = await SnapshotStore.open(url, ram_bytes=config.ram_tier_bytes, gc_grace_s=config.gc_grace_s)
    if config.lease_ttl_s is not None:
        snapshots.lease_ttl_s = config.lease_ttl_s
    return snapshots


from ..sessions.session import Session  # noqa: E402  (Session needs Engine's module loaded)
