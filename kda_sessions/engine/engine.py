"""The public engine: sessions in, replies out. Owns the model, the pools, the store and the step thread."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import torch

from ..errors import CheckpointNotFound, SessionNotFound
from ..model import HybridModel, load_model
from ..sessions.prefix_index import PrefixIndex
from ..sessions.state import Checkpoint, SessionState
from ..storage import SnapshotStore
from ..storage.manifest import SESSION_ID_PATTERN, ModelFingerprint
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
from .pool import OutOfPages, OutOfSlots, PageAllocator, SlotAllocator
from .runner import Runner
from .sampler import SamplingParams
from .scheduler import Scheduler, Work, pages_needed
from .snapshots import SnapshotIO
from .types import SessionInfo

log = logging.getLogger(__name__)


def new_session_id() -> str:
    """128 random bits, URL- and path-safe."""
    return "s_" + secrets.token_hex(16)


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
        self.sessions: dict[str, SessionState] = {}
        self.prefix_index = PrefixIndex()
        self.fingerprint = ModelFingerprint(
            model_id=model_id,
            config_hash=model.config.fingerprint,
            dtype=str(model.dtype).removeprefix("torch."),
            page_size=config.page_size,
        )
        self.io = SnapshotIO(self, snapshots)
        self._token = anyio.lowlevel.current_token()
        self.runner = Runner(model, self.pools, self.pages, self.scheduler, tokenizer, self.mutex, self._deliver_from_thread)
        self.counters = {"prefill_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "resumes": 0, "forks": 0, "saves": 0}
        self.resume_seconds: list[float] = []
        self.closed = False
        self.runner.start()

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
        snapshots = await SnapshotStore.open(store, ram_bytes=config.ram_tier_bytes, gc_grace_s=config.gc_grace_s)
        engine = cls(m, Path(str(model)).name, tokenizer, template, snapshots, config)
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
        await anyio.to_thread.run_sync(self.runner.stop)
        await self.io.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- sessions --------------------------------------------------------------------------------------------

    async def create_session(
        self,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> Session:
        """A new session whose context starts with the system prompt and tool declarations (prefilled lazily
        with the first call, or reused from a stored checkpoint with the same prefix)."""
        from ..tokenizer import encode_chat

        sid = self._check_new_id(session_id)
        messages = [{"role": "system", "content": system}] if system else []
        tokens = encode_chat(self.tokenizer, messages, tools, add_generation_prompt=False, template=self.template) if (messages or tools) else []
        s = await self._start_from_prefix(sid, tokens)
        s.system, s.tools = system, tools
        s.messages = list(messages)
        return Session(self, s)

    async def create_session_from_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> Session:
        """A new session holding a whole conversation (ending with a closed turn), started from the longest
        checkpointed prefix of its tokens: a client that resends its full history prefills only what is new."""
        from ..tokenizer import encode_chat

        sid = self._check_new_id(session_id)
        tokens = encode_chat(self.tokenizer, messages, tools, add_generation_prompt=False, template=self.template) if (messages or tools) else []
        s = await self._start_from_prefix(sid, tokens)
        s.system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
        s.tools = tools
        s.messages = [dict(m) for m in messages]
        s.turn_open = False
        return Session(self, s)

    def _check_new_id(self, session_id: str | None) -> str:
        import re

        sid = session_id or new_session_id()
        if not re.match(SESSION_ID_PATTERN, sid):
            raise ValueError(f"session_id must match {SESSION_ID_PATTERN}, got {sid!r}")
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} already exists")
        return sid

    async def _start_from_prefix(self, sid: str, tokens: list[int]) -> SessionState:
        """A fresh session holding ``tokens``; starts from the longest indexed checkpoint prefix if any."""
        hit = self.prefix_index.longest(tokens)
        s: SessionState | None = None
        if hit is not None:
            try:
                s = await self._fork_state(hit.session_id, hit.checkpoint, sid)
            except (SessionNotFound, CheckpointNotFound):
                s = None
        if s is None:
            s = SessionState(id=sid)
            await self._make_resident(s)
        s.tokens.extend(tokens[len(s.tokens) :])
        self.sessions[sid] = s
        return s

    async def resume(self, session_id: str) -> Session:
        """The session from this engine, or else from the store (no prefill: its state is loaded)."""
        if session_id in self.sessions:
            return Session(self, self.sessions[session_id])
        t0 = time.perf_counter()
        s = await self.io.load_session(session_id)
        await self._make_resident(s)
        self.sessions[session_id] = s
        self.counters["resumes"] += 1
        self.resume_seconds.append(time.perf_counter() - t0)
        return Session(self, s)

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> Session:
        """A new session continuing from ``checkpoint`` (default: the parent's current position) of
        ``session_id``. Full KV pages are shared; only the partial last page is copied."""
        sid = self._check_new_id(new_id)
        s = await self._fork_state(session_id, checkpoint, sid)
        self.sessions[sid] = s
        self.counters["forks"] += 1
        return Session(self, s)

    async def _fork_state(self, parent_id: str, checkpoint: str | None, sid: str) -> SessionState:
        parent = self.sessions.get(parent_id)
        if parent is None:
            parent = (await self.resume(parent_id)).state
        async with parent.lock:
            if checkpoint is None or checkpoint == "head":
                cp = self._head_checkpoint(parent)
            elif checkpoint in parent.checkpoints:
                cp = parent.checkpoints[checkpoint]
            else:
                raise CheckpointNotFound(f"session {parent_id!r} has no checkpoint {checkpoint!r}")
            child = SessionState(
                id=sid,
                tokens=parent.tokens[: cp.position],
                num_cached=cp.state_pos,
                system=parent.system,
                tools=parent.tools,
                messages=[dict(m) for m in parent.messages[: cp.num_messages]],
                turn_open=cp.turn_open,
                parent=parent_id,
                next_message_index=cp.num_messages,
            )
            await self.io.materialize(cp)
            await self._make_resident(child)
            with self.mutex:
                for i, (state, conv) in enumerate(zip(self.pools.kda, self.pools.conv)):
                    assert cp.kda is not None and cp.conv is not None
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
            if cp.name == "__head__":
                self._release_checkpoint(cp)
        return child

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

    async def list_sessions(self) -> list[SessionInfo]:
        stored = set(await self.io.list_stored())
        out = []
        for sid in sorted(stored | set(self.sessions)):
            s = self.sessions.get(sid)
            if s is not None:
                out.append(SessionInfo(
                    session_id=sid, num_tokens=s.num_tokens, checkpoints=sorted(s.checkpoints), active=s.resident,
                    saved=sid in stored, parent=s.parent,
                ))
            else:
                try:
                    m = await self.io.snapshots.load_manifest(sid)
                except Exception:  # listed but unreadable: report it, do not fail the listing
                    log.warning("session %s is listed but its manifest does not load", sid)
                    continue
                out.append(SessionInfo(
                    session_id=sid, num_tokens=m.num_tokens, checkpoints=[c.name for c in m.checkpoints],
                    active=False, saved=True, parent=m.parent,
                ))
        return out

    async def delete_session(self, session_id: str) -> None:
        """Forget the session here and in the store; blobs nothing else references are reclaimed."""
        s = self.sessions.get(session_id)
        found = s is not None
        if s is not None:
            async with s.lock:
                self._release(s, keep_checkpoint_states=False)
                del self.sessions[session_id]
        self.prefix_index.remove_session(session_id)
        if session_id in await self.io.list_stored():
            await self.io.snapshots.delete_session(session_id)
            found = True
        if not found:
            raise SessionNotFound(f"no session {session_id!r}")

    def stats(self) -> dict[str, Any]:
        c = self.counters
        ctx = c["prefill_tokens"] + c["cached_tokens"]
        return {
            "sessions_in_memory": len(self.sessions),
            "sessions_active": sum(1 for s in self.sessions.values() if s.resident),
            "slots_free": self.slots.num_free,
            "pages_free": self.pages.num_free,
            "pages_total": self.pages.num_pages,
            "page_size": self.config.page_size,
            "queue_depth": self.scheduler.num_queued(),
            "steps": self.runner.steps,
            "tokens_prefilled": self.runner.tokens_prefilled,
            "tokens_decoded": self.runner.tokens_decoded,
            "cache_hit_rate": c["cached_tokens"] / ctx if ctx else 0.0,
            "resume_seconds_last": self.resume_seconds[-1] if self.resume_seconds else None,
            "prefix_index_entries": len(self.prefix_index),
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
                await self.io.restore_head(s)
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
        """Make sure the pool can give ``s`` pages for ``total_tokens`` tokens, evicting idle sessions."""
        need = pages_needed(total_tokens, self.config.page_size) - len(s.pages)
        while need > self.pages.num_free:
            if not await self._evict_one(s):
                raise OutOfPages(f"need {need} KV pages, {self.pages.num_free} free and every session is busy")

    async def _evict_one(self, exclude: SessionState) -> bool:
        """Save the least recently used idle resident session to the store and free its slot and pages."""
        idle = [
            s for s in self.sessions.values()
            if s.resident and s is not exclude and not s.lock.locked()
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        async with victim.lock:
            if not victim.resident:
                return True
            await self.io.save(victim)
            self._release(victim, keep_checkpoint_states=True)
        log.info("evicted idle session %s to the store", victim.id)
        return True

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
    ) -> Work:
        """Queue the session's pending tokens for prefill and (unless prefill_only) generation.
        Caller holds ``s.lock`` until the work has finished (see ``wait``)."""
        await self._make_resident(s)
        await self.ensure_pages(s, s.num_tokens + (0 if prefill_only else params.max_tokens))
        prompt = s.tokens[s.num_cached :]
        if prefill_only:
            prompt = prompt[:-1]  # keep one token pending so the next generate has logits to sample from
        work = Work(session=s, prompt=prompt, params=params, prefill_only=prefill_only, on_token=on_token, on_finish=on_finish)
        work.checkpoints = [c for c in s.checkpoints.values() if c.state_pos < c.target] + list(checkpoints or [])
        if params.seed is not None:
            work.generator = torch.Generator().manual_seed(params.seed)
        choice = parse_tool_choice(tool_choice, s.tools)
        if choice is not None:
            work.constraint = ToolChoiceConstraint(self.tokenizer, s.tools, choice)
        if not prompt:
            if not prefill_only:
                raise ValueError(f"session {s.id!r} has no tokens to continue from; append some first")
            work.finish_reason = "stop"
            work.finished.set()
            if on_finish is not None:
                on_finish()
            return work
        with self.mutex:
            self.scheduler.submit(work)
        self.runner.notify()
        return work

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
            w.finished.set()
            if w.on_finish is not None:
                w.on_finish()


from ..sessions.session import Session  # noqa: E402  (Session needs Engine's module loaded)
