"""The public engine: sessions in, replies out. A facade over the session manager (``sessions.manager``), which
owns every session's state, and the step machinery (``engine.core``), which runs the model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import torch

from .engine.config import EngineConfig
from .engine.core import EngineCore
from .engine.cpu_threads import without_openmp_team
from .engine.pool import PageAllocator
from .engine.runner import Runner
from .engine.scheduler import Scheduler
from .model import HybridModel, StatePools, load_model
from .sessions.leases import LeaseKeeper
from .sessions.manager import SessionManager
from .sessions.prefix_index import PrefixIndex
from .sessions.relief import PageRelief
from .sessions.session import Session
from .sessions.state import SessionState
from .sessions.store_io import StoreIO, open_snapshots
from .sessions.tenancy import TenantSessions
from .storage import SnapshotStore
from .storage.manifest import ModelFingerprint
from .tokenizer import (
    ByteTokenizer,
    Tokenizer,
    TokenizerNotFound,
    builtin_template,
    load_chat_template,
    load_tokenizer,
)
from .tokenizer.chat import ChatTemplate
from .types import SessionInfo

__all__ = ["Engine", "open_snapshots"]

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
        self.store_url = store_url
        self.fingerprint = ModelFingerprint(
            model_id=model_id,
            config_hash=model.config.fingerprint,
            dtype=str(model.dtype).removeprefix("torch."),
            page_size=config.page_size,
        )
        self.core = EngineCore(model, tokenizer, config)
        self.manager = SessionManager(self.core, tokenizer, template, self.fingerprint, snapshots, store_url)
        self._tenants: dict[str | None, TenantSessions] = {None: TenantSessions(self.manager, None)}
        self.closed = False
        self.leases = LeaseKeeper(self.manager, self.core.loop_token)
        self.leases.start()
        self.relief = PageRelief(self.core, self.manager.residency)
        self.relief.start()

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
        def load() -> HybridModel:
            with without_openmp_team(device, config.cpu_decode_threads == "auto"):
                return load_model(model, device=device, dtype=dtype)

        m = await anyio.to_thread.run_sync(load)
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
            # the step thread's warm-up (Runner._warm_up) is part of opening, not of the first request
            await anyio.to_thread.run_sync(engine.core.runner.warmed.wait, 60.0)
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
        await self.relief.stop()
        await anyio.to_thread.run_sync(self.core.close)
        await self.manager.close()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tenants ---------------------------------------------------------------------------------------------

    async def for_tenant(self, tenant: str | None) -> TenantSessions:
        """The session API scoped to ``tenant`` (its own store namespace, prefix index and ids)."""
        if tenant not in self._tenants:
            await self.manager.open_tenant(tenant)
            self._tenants.setdefault(tenant, TenantSessions(self.manager, tenant))
        return self._tenants[tenant]

    @property
    def default(self) -> TenantSessions:
        """The default tenant's sessions (what ``Engine``'s own session methods act on)."""
        return self._tenants[None]

    # -- sessions (default tenant; see TenantSessions) -------------------------------------------------------

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

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()

    # -- inspection (tests, benches, the CLI's progress bars) ------------------------------------------------

    @property
    def sessions(self) -> dict[str, SessionState]:
        """The default tenant's sessions held by this engine, by id."""
        return self.default.sessions

    @property
    def io(self) -> StoreIO:
        """The default tenant's store and prefix index."""
        return self.default.io

    @property
    def prefix_index(self) -> PrefixIndex:
        return self.io.index

    @property
    def counters(self) -> dict[str, int]:
        return self.manager.counters

    @property
    def resume_seconds(self) -> list[float]:
        return self.manager.resume_seconds

    @property
    def loop_token(self) -> Any:
        """The event loop this engine runs on (for handing calls to it from other threads)."""
        return self.core.loop_token

    @property
    def runner(self) -> Runner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def pools(self) -> StatePools:
        """The pools' tensors (see ``core.pools`` for their allocators and slot operations)."""
        return self.core.pools.tensors

    @property
    def pages(self) -> PageAllocator:
        return self.core.pools.pages

    @property
    def mutex(self) -> Any:
        return self.core.pools.mutex
