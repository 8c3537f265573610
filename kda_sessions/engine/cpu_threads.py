"""The torch thread count of CPU steps, chosen by timing them (``EngineConfig.cpu_decode_threads="auto"``).

A decode step of a small model is a few hundred ops of microseconds each. On a quiet machine, with the step thread
the process's only OpenMP team, two threads run ``tiny``'s step ~1.4x faster than one; with another busy process on
a 2-core machine, or once another thread of the process has run torch on several threads (OpenMP then holds more
threads than cores and they sleep between ops), the same two threads take 10-40x longer (docs/benchmarks.md,
"`tiny` on the CPU"). Neither count wins everywhere, so the step thread times the decode steps it runs anyway: it
starts on 1, tries the other count for a few steps now and then (sooner when the steps it runs slow down), and keeps
whichever is faster. Prefill steps follow the latest decode choice (1 until decode has one):
beside a busy process two threads prefill 2-7x slower than one too (OpenMP's waiting threads spin, and the
scheduler runs them after the other process), and prefill steps are too few and too varied in size to time apart.
Logits can differ in the last bits between counts (the BLAS picks other kernels), so outputs are bit-reproducible
only with a fixed count.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median

import torch

SETTLE_STEPS = 6
"""Steps timed on a count before its figure is trusted (the first step after a change is not timed)."""
PROBE_STEPS = 3
"""Steps timed on the other count when it is tried (after one untimed step)."""
FIRST_PROBE_AFTER = 32
"""Steps on the chosen count before the other one is tried again; doubled each time the try loses."""
MAX_PROBE_AFTER = 8192
ABORT_RATIO = 1.5
"""A tried count whose first timed step is this much slower than the chosen one's figure is given up at once:
on a loaded machine two threads can take 40x longer, and every step of a try is a token's delay."""
FIRST_STEP_ABORT_RATIO = 4.0
"""The same for the untimed first step of a try (it may pay for waking threads, so it gets more room)."""
SWITCH_RATIO = 0.92
"""The tried count is kept when its median step is below this share of the chosen count's."""
DRIFT_RATIO = 1.5
"""The chosen count's recent median above this multiple of its figure (the machine got busier): try the other now."""


@dataclass
class _Lane:
    """The choice for decode batches of one row count."""

    current: int
    figure: dict[int, float] = field(default_factory=dict)
    """Median step seconds last measured on each count: ``current``'s after settling and when a try starts."""
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=SETTLE_STEPS))
    trying: int | None = None
    tried: list[float] = field(default_factory=list)
    skip: int = 1
    """Steps still to run untimed on the count in use (its first after a change)."""
    since: int = 0
    """Timed steps on ``current`` since the last try."""
    probe_after: int = SETTLE_STEPS
    """Timed steps on ``current`` before the next try: the first right after settling."""


class StepThreads:
    """Chooses between ``counts`` (1 and the step thread's count) for each decode batch size by timing the steps:
    ``pick(rows)`` before a decode step, ``record(rows, seconds)`` after it, ``prefill()`` before any other step;
    all on the step thread."""

    def __init__(self, counts: tuple[int, int]) -> None:
        self.counts = counts
        self.lanes: dict[int, _Lane] = {}
        self.last: _Lane | None = None
        """The lane of the latest decode step."""

    def prefill(self) -> int:
        """The count of a step that prefills: the latest decode step's choice once it has timed one, 1 before (on a
        busy machine the engine's first prefill took 4x as long on 2 threads; on a quiet one 1.6x as long on 1)."""
        lane = self.last
        return self.counts[0] if lane is None or not lane.figure else lane.current

    def _lane(self, rows: int) -> _Lane:
        lane = self.lanes.get(rows)
        if lane is None:
            lane = self.lanes[rows] = _Lane(current=self.counts[0])
        return lane

    def pick(self, rows: int) -> int:
        lane = self.last = self._lane(rows)
        return lane.current if lane.trying is None else lane.trying

    def record(self, rows: int, seconds: float) -> None:
        lane = self._lane(rows)
        if lane.skip:
            lane.skip -= 1
            if lane.trying is not None and seconds > FIRST_STEP_ABORT_RATIO * lane.figure[lane.current]:
                lane.probe_after = max(2 * lane.probe_after, 4 * FIRST_PROBE_AFTER)  # far slower: try less often
                self._end_try(lane, seconds, won=False)
            return
        if lane.trying is not None:
            self._record_try(lane, seconds)
            return
        lane.recent.append(seconds)
        lane.since += 1
        if len(lane.recent) < SETTLE_STEPS:
            return
        now = median(lane.recent)
        known = lane.figure.get(lane.current)
        if known is None or lane.since == SETTLE_STEPS:
            lane.figure[lane.current] = now
            known = now
        drifted = now > DRIFT_RATIO * known
        if drifted or lane.since >= lane.probe_after:
            lane.figure[lane.current] = now  # the try is judged against the chosen count's latest steps
            lane.trying = self.counts[1] if lane.current == self.counts[0] else self.counts[0]
            lane.tried, lane.skip = [], 1
            if drifted:
                lane.probe_after = FIRST_PROBE_AFTER

    def _record_try(self, lane: _Lane, seconds: float) -> None:
        assert lane.trying is not None
        lane.tried.append(seconds)
        base = lane.figure[lane.current]
        lost = len(lane.tried) == 1 and seconds > ABORT_RATIO * base
        if not lost and len(lane.tried) < PROBE_STEPS:
            return
        got = median(lane.tried)
        self._end_try(lane, got, won=not lost and got < SWITCH_RATIO * base)

    def _end_try(self, lane: _Lane, got: float, won: bool) -> None:
        assert lane.trying is not None
        lane.figure[lane.trying] = got
        if won:
            lane.current, lane.probe_after = lane.trying, FIRST_PROBE_AFTER
        else:
            lane.probe_after = min(max(FIRST_PROBE_AFTER, 2 * lane.probe_after), MAX_PROBE_AFTER)
        lane.trying, lane.tried, lane.skip, lane.since = None, [], 1, 0
        lane.recent.clear()



@contextmanager
def without_openmp_team(device: torch.device | str, auto: bool) -> Iterator[None]:
    """Run torch on the calling thread on one thread when ``device`` is a CPU and the engine's thread counts are
    ``auto``: so it starts no OpenMP team of its own, which would leave the step thread's team more threads than
    cores for as long as the caller lives (loading the model and allocating the pools at ``Engine.open``). A lone
    team is faster on a quiet machine and slower beside a busy one, where "auto" turns to 1 thread; with a fixed
    count the caller's team stays, and the step thread's threads sleep between ops as before."""
    if torch.device(device).type != "cpu" or not auto:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
