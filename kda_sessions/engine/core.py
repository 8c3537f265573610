"""The step machinery behind one event loop: the model, its pools, the scheduler and the step thread.

``EngineCore`` knows sequences and works, not sessions: the session manager (``kda_sessions.sessions``)
decides what runs and where its state lives, and submits works here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from ..model import HybridModel
from ..tokenizer import Tokenizer
from .config import EngineConfig
from .cpu_threads import without_openmp_team
from .pool import Pools, pages_needed
from .runner import Runner
from .scheduler import Scheduler, Work

log = logging.getLogger(__name__)

IDLE_PREFILL_TOKENS_GPU = 8192
"""Prompt tokens of a step with nothing generating on a GPU, unless EngineConfig names its own."""


class EngineCore:
    """Must be created on the event loop that will use it (results are handed back to that loop)."""

    def __init__(self, model: HybridModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        with without_openmp_team(model.device, config.cpu_decode_threads == "auto"):  # the step thread's team alone
            tensors = model.allocate_pools(config.max_active_sessions, config.num_pages, config.page_size)
        self.pools = Pools(tensors, config.max_active_sessions, config.num_pages)
        idle = config.prefill_chunk_tokens_idle
        if idle is None:
            idle = IDLE_PREFILL_TOKENS_GPU if model.device.type == "cuda" else config.prefill_chunk_tokens
        self.scheduler = Scheduler(config.prefill_chunk_tokens, config.max_queued_requests, idle)
        self.loop_token = anyio.lowlevel.current_token()
        """The event loop this core delivers results to (and where other threads hand work back)."""
        self.work_ended = anyio.Event()
        """Set (and replaced) whenever works end; what a request waiting for pages waits on."""
        self.runner = Runner(model, self.pools, self.scheduler, tokenizer, self._deliver_from_thread,
                             cuda_graphs=config.cuda_graphs, park_timeout_s=config.page_wait_s,
                             cpu_threads=config.cpu_threads if model.device.type == "cpu" else None,
                             cpu_decode_threads=config.cpu_decode_threads,
                             cpu_compile=config.cpu_compile, cpu_compile_dtype=config.cpu_compile_dtype,
                             cpu_half_weights=config.cpu_half_weights, decode_ahead=config.decode_ahead)
        self.preemption = self.runner.preemption
        self.runner.start()

    def close(self) -> None:
        """Stop the step thread and the pools' host copies (blocking: call it from a worker thread)."""
        self.runner.stop()
        self.pools.close()

    @property
    def device(self) -> torch.device:
        """The model's device (where a request's seeded generator lives)."""
        return self.model.device

    @property
    def busy(self) -> bool:
        """Whether any work is queued or running."""
        return self.scheduler.has_work

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.config.page_size)

    # -- works -----------------------------------------------------------------------------------------------

    def submit(self, work: Work, reserve: int) -> None:
        """Queue ``work``, setting aside ``reserve`` free pages for it (given back when it ends)."""
        with self.pools.mutex:
            self.pools.pages.reserve(reserve)
            work.reserved_pages = reserve
            try:
                self.scheduler.submit(work)
            except BaseException:
                self._unreserve(work)
                raise
        self.runner.notify()

    def _unreserve(self, work: Work) -> None:
        with self.pools.mutex:
            self.pools.pages.unreserve(work.reserved_pages)
            work.reserved_pages = 0

    async def wait(self, work: Work) -> Work:
        """Wait for ``work``; if the waiting task is cancelled, the work is cancelled and its batch slot freed.
        Raises the work's error, if it failed."""
        try:
            await work.finished.wait()
        except BaseException:
            await self.cancel(work)
            raise
        if work.error is not None:
            raise work.error
        return work

    async def cancel(self, work: Work) -> None:
        work.cancelled = True
        self.runner.notify()
        with anyio.CancelScope(shield=True):
            await work.finished.wait()

    def stats(self) -> dict[str, Any]:
        pages = self.pools.pages
        return {
            "slots_free": self.pools.slots.num_free,
            "pages_free": pages.num_free,
            "pages_reserved": pages.reserved,
            "pages_total": pages.num_pages,
            "page_size": self.config.page_size,
            "checkpoint_states_in_memory": len(self.pools.host),
            "queue_depth": self.scheduler.num_queued(),
            "steps": self.runner.steps,
            "tokens_prefilled": self.runner.tokens_prefilled,
            "tokens_decoded": self.runner.tokens_decoded,
            "steps_queued_ahead": self.runner.steps_ahead,
            "preemptions": self.preemption.preemptions,
        }

    # -- results back on the event loop ----------------------------------------------------------------------

    def _deliver_from_thread(self, finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        # A step whose tokens nobody streams and that ended no work has nothing for the loop: waking it for every
        # decoded token would cost the step thread the GIL hand-over each time (the tokens are read at the end).
        if not finished and all(w.on_token is None for w, _ in sampled):
            return
        # On asyncio, hand the results over without waiting for the loop, so the next step starts at once;
        # other backends get a blocking hand-over.
        loop = getattr(self.loop_token, "native_token", None)
        try:
            if isinstance(loop, asyncio.AbstractEventLoop):
                loop.call_soon_threadsafe(self._deliver, finished, sampled)
            else:
                anyio.from_thread.run_sync(self._deliver, finished, sampled, token=self.loop_token)
        except RuntimeError:  # the event loop is gone (engine not closed before its loop ended)
            log.warning("engine results dropped: the event loop that opened the engine has stopped")

    def _deliver(self, finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        for w, tok in sampled:
            if w.on_token is not None and not w.cancelled:
                w.on_token(tok)
        for w in finished:
            self._unreserve(w)
            w.finished.set()
            if w.on_finish is not None:
                w.on_finish()
        if finished:
            self.work_ended.set()
            self.work_ended = anyio.Event()
