"""Preemption under page pressure: a generating request that needs a KV page when none is free takes one from
the youngest requests of the decode batch, which are parked: their sessions' KV rows are copied to host memory
and their pages freed (the KDA state stays in its slot). A parked request resumes, oldest first, as soon as
pages for its rows and its next token are free again: its rows are copied back, nothing is recomputed, and its
tokens are bit for bit those of a run without pressure.

Admission therefore reserves only the pages of a request's prompt and first token (not its whole
``max_tokens``): requests that together overrun the pool all run, and the pool serves as many as fit. Pages
held by idle sessions are freed by the session layer, which evicts them when ``pressure`` is set. When parked
requests have waited ``timeout_s`` with nothing else running (no request will free pages), the oldest fails with
OutOfPages; its session then starts over (its tokens pending, prefilled again by the next call), as does the
session of a parked request that is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import OutOfPages
from .pool import Pools, pages_needed
from .rollback import start_over
from .scheduler import Scheduler, Work

log = logging.getLogger(__name__)


class Preemption:
    """Called by the step thread with ``pools.mutex`` held."""

    def __init__(self, pools: Pools, scheduler: Scheduler, timeout_s: float) -> None:
        self.pools = pools
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.pressure = threading.Event()
        """Set while parked works wait for pages that only evicting idle sessions can free."""
        self.pages_wanted = 0
        """Free pages the oldest parked work needs to resume."""
        self.preemptions = 0
        self.resumes = 0
        self.stalled_since: float | None = None
        """Since when parked works have waited with nothing else running."""

    def park(self, w: Work) -> None:
        """Move ``w``'s KV rows to the host, free its pages and reservation, and take it out of the batch."""
        s = w.session
        w.parked = self.pools.read_kv(s.pages, s.num_cached)
        self.pools.pages.decref(s.pages)
        s.pages = []
        self.pools.pages.unreserve(w.reserved_pages)
        w.reserved_pages = 0
        self.scheduler.park(w)
        self.preemptions += 1
        log.info("session %s: parked (%d KV rows to the host) for pages", s.id, s.num_cached)

    def make_room(self, w: Work, need: int, batch: list[Work]) -> bool:
        """Park works of ``batch`` younger than ``w``, youngest first, until ``need`` pages are free."""
        victims = [x for x in batch if x is not w and x.arrival > w.arrival and x.parked is None
                   and x.error is None and x.finish_reason is None]
        for x in sorted(victims, key=lambda x: -x.arrival):
            if self.pools.pages.num_free >= need:
                break
            self.park(x)
        return self.pools.pages.num_free >= need

    def resume_ready(self) -> list[Work]:
        """Resume parked works, oldest first, while pages are free for them; returns those that waited too long
        (failed, to be delivered). Sets ``pressure`` if the oldest still waits."""
        timed_out: list[Work] = []
        self.pages_wanted = 0
        now = time.monotonic()
        if self.scheduler.runnable or not self.scheduler.parked:
            self.stalled_since = None
        elif self.stalled_since is None:
            self.stalled_since = now
        for w in list(self.scheduler.parked):
            if w.cancelled:
                continue  # the next plan drops it (see discard)
            s = w.session
            need = pages_needed(s.num_cached + 1, self.pools.page_size)
            if need <= self.pools.pages.num_free:
                assert w.parked is not None
                s.pages = self.pools.pages.alloc(need)
                self.pools.write_kv(s.pages, w.parked)
                w.parked = None
                self.scheduler.unpark(w)
                self.resumes += 1
                continue
            if self.stalled_since is not None and now - self.stalled_since > self.timeout_s:
                self.stalled_since = now  # the next one gets its own wait
                self.scheduler.parked.remove(w)
                self.discard(w)
                w.error = OutOfPages(f"no KV pages came free for {self.timeout_s:g} s while this request was parked")
                timed_out.append(w)
                continue
            self.pages_wanted = need
            break
        if self.pages_wanted:
            self.pressure.set()
        return timed_out

    def discard(self, w: Work) -> None:
        """A parked work that ends without resuming: its rows are dropped and its session starts over."""
        if w.parked is not None:
            w.parked = None
            start_over(w.session, self.pools)
