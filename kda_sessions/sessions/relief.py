"""Page relief: when requests parked under page pressure (engine/preemption.py) wait for pages that no running
request will free, idle sessions are evicted to the store until the oldest can resume.

The step thread sets ``Preemption.pressure``; a daemon thread here hands each round to the event loop (the
stores' clients belong to it), so the step never waits on a save.
"""

from __future__ import annotations

import logging
import threading

import anyio
import anyio.from_thread

from ..engine.core import EngineCore
from .residency import Residency

log = logging.getLogger(__name__)

IDLE_ROUND_S = 0.1
"""Pause after a round that could evict nothing (everything held is busy)."""


class PageRelief:
    def __init__(self, core: EngineCore, residency: Residency) -> None:
        self.core = core
        self.residency = residency
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kda-page-relief", daemon=True)
        self.evictions = 0

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        self.core.preemption.pressure.set()  # wake the thread
        if self._thread.is_alive():
            await anyio.to_thread.run_sync(self._thread.join)

    def _run(self) -> None:
        pressure = self.core.preemption.pressure
        while not self._stop.is_set():
            if not pressure.wait(1.0) or self._stop.is_set():
                continue
            pressure.clear()
            try:
                freed = anyio.from_thread.run(self.relieve, token=self.core.loop_token)
            except RuntimeError:  # the event loop is gone
                return
            except Exception:  # a failed save is logged by the eviction; the next round tries again
                log.exception("page relief round failed")
                freed = False
            self.core.runner.notify()
            if not freed:
                self._stop.wait(IDLE_ROUND_S)

    async def relieve(self) -> bool:
        """Evict idle sessions while the oldest parked request lacks pages; whether any was evicted."""
        pre, pages = self.core.preemption, self.core.pools.pages
        freed = False
        while pre.pages_wanted > pages.num_free and await self.residency.evict_one():
            freed = True
            self.evictions += 1
        return freed
