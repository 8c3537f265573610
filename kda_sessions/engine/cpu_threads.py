"""The torch thread count of CPU steps, chosen by timing them (``EngineConfig.cpu_decode_threads="auto"``).

A decode step of a small model is a few hundred ops of microseconds each. On a quiet machine, with the step thread
the process's only OpenMP team, two threads run ``tiny``'s step up to ~1.4x faster than one; with another busy
process on a 2-core machine, or once another thread of the process has run torch on several threads (OpenMP then
holds more threads than cores and they sleep between ops), the same two threads take 10-40x longer
(docs/benchmarks.md, "`tiny` on the CPU"). Neither count wins everywhere, so the step thread times the steps it runs
anyway: it starts on 1, tries the other count for a few steps now and then (sooner when the steps it runs slow
down), and keeps whichever is faster (fewer threads on a tie; steps on fewer threads right after steps on more,
while OpenMP's idle threads still spin, are not timed: ``SPIN_DOWN_S``; a switch stands only if the new count's
settled steps confirm the try: ``_Lane.confirm``). Decode steps choose per batch size; prefill steps (any step that
feeds a prompt) per size class of the tokens they feed (a power of two), by their time per token, in fewer steps
(they are long: less noise, and few), and never try the other count while the latest decode steps found it far
slower (beside a busy process two threads prefill 2-7x slower too: OpenMP's waiting threads spin, and the scheduler
runs them after the other process). Prefill and decode differ: on a quiet 2-core AMD EPYC VM, 2 threads decoded
``tiny`` no faster than 1 and prefilled 4K 1.6x faster. Logits can differ in the last bits between counts (the BLAS
picks other kernels), so outputs are bit-reproducible only with a fixed count.
"""

from __future__ import annotations

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
"""A tried larger count is kept when its median step is below this share of the chosen count's."""
DOWN_SWITCH_RATIO = 1.0
"""A tried smaller count is kept when its median step is at most this share of the chosen count's (unless it is
slower): fewer threads leave the other cores to the machine, so a tie goes to them; more must be clearly faster."""
SPIN_DOWN_S = 0.025
"""After a step on more threads, OpenMP's idle threads spin on the cores for a while before they sleep (libgomp's
default wait policy), and steps on fewer threads meanwhile can run slower: on a 2-core AMD EPYC VM, with the BLAS's
float32 matmuls, ``tiny``'s 1-thread decode steps took 3.3-3.6 ms for ~10-14 ms after 2-thread steps and 2.7-2.9
after, so tries of 1 thread lost to 2 threads 20% slower in steady state (``bench/cpu_step.py``'s ``spin_down``
measures it; with the float16 packs' 2 ms steps it was within the VM's noise). Decode steps on fewer threads are not
timed until this much step time has passed since the last step on more."""
DRIFT_RATIO = 1.5
"""The chosen count's recent median above this multiple of its figure (the machine got busier): try the other now."""
PREFILL_SETTLE_STEPS = 3
PREFILL_PROBE_STEPS = 2
"""A prefill lane's ``SETTLE_STEPS`` and ``PROBE_STEPS``: a step of hundreds of tokens times steadily, and a prompt
makes few of them. No step of a prefill lane goes untimed (waking threads costs microseconds against its
milliseconds)."""
PREFILL_MAX_CLASS = 12
"""Prefill steps of 2**(PREFILL_MAX_CLASS - 1) tokens or more share one lane (2,048 and up: a CPU's whole chunks)."""


@dataclass
class _Lane:
    """The choice for decode batches of one row count, or for prefill steps of one size class."""

    current: int
    settle: int = SETTLE_STEPS
    probe: int = PROBE_STEPS
    untimed: int = 1
    """Steps run untimed on a count after a change (its first: it may pay for waking threads)."""
    gated: bool = False
    """No try while the latest decode steps found the other count far slower (``StepThreads._far_slower``)."""
    figure: dict[int, float] = field(default_factory=dict)
    """Median step seconds (per token, for prefill) last measured on each count: ``current``'s after settling and
    when a try starts."""
    recent: deque[float] = field(default_factory=deque)
    trying: int | None = None
    tried: list[float] = field(default_factory=list)
    skip: int = 1
    """Steps still to run untimed on the count in use."""
    since: int = 0
    """Timed steps on ``current`` since the last try."""
    probe_after: int = SETTLE_STEPS
    """Timed steps on ``current`` before the next try: the first right after settling."""
    confirm: int | None = None
    """The count a won try replaced, until ``current`` has settled: a switch stands only if the settled steps are
    still faster by the margin the try had to show (a try is a few steps; on a noisy machine it can win by luck)."""

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.settle)
        self.skip, self.probe_after = self.untimed, self.settle


class StepThreads:
    """Chooses between ``counts`` (1 and the step thread's count) by timing the steps, all on the step thread:
    ``pick(rows)`` before a decode step of ``rows`` sequences and ``record(rows, seconds)`` after it;
    ``prefill(tokens)`` before any other step, feeding ``tokens`` in all, and ``record_prefill(tokens, seconds)``
    after it."""

    def __init__(self, counts: tuple[int, int]) -> None:
        self.counts = counts
        self.lanes: dict[int | tuple[str, int], _Lane] = {}
        """Decode lanes by row count, prefill lanes by ``("prefill", size class)``."""
        self.last: _Lane | None = None
        """The lane of the latest decode step."""
        self.spin_left = 0.0
        """Step seconds still to pass before a decode step on fewer threads is timed (``SPIN_DOWN_S``)."""

    def prefill(self, tokens: int) -> int:
        """The count of a step that feeds ``tokens`` tokens (prompt chunks, with any decode rows beside them)."""
        lane = self._prefill_lane(tokens)
        return lane.current if lane.trying is None else lane.trying

    def record_prefill(self, tokens: int, seconds: float) -> None:
        lane = self._prefill_lane(tokens)
        self._spinning(lane, seconds)  # a prefill step's milliseconds of spin-down are noise in its time: timed
        self._record(lane, seconds / max(1, tokens))

    def _spinning(self, lane: _Lane, seconds: float) -> bool:
        """Whether a step of ``seconds`` in ``lane`` ran on fewer threads while the idle threads of a step on more
        may still have spun (``SPIN_DOWN_S``); a step on more threads opens that window again."""
        count = lane.current if lane.trying is None else lane.trying
        if count == max(self.counts):
            self.spin_left = SPIN_DOWN_S
            return False
        inside = self.spin_left > 0
        self.spin_left = max(0.0, self.spin_left - seconds)
        return inside

    def _prefill_lane(self, tokens: int) -> _Lane:
        key = ("prefill", min(max(1, tokens).bit_length(), PREFILL_MAX_CLASS))
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = _Lane(current=self.counts[0], settle=PREFILL_SETTLE_STEPS,
                                           probe=PREFILL_PROBE_STEPS, untimed=0, gated=True)
        return lane

    def _far_slower(self, count: int) -> bool:
        """The latest decode steps found ``count`` far slower than the other (a busy machine, for several threads)."""
        lane = self.last
        other = self.counts[0] if count == self.counts[1] else self.counts[1]
        if lane is None or count not in lane.figure or other not in lane.figure:
            return False
        return lane.figure[count] > ABORT_RATIO * lane.figure[other]

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
        if not self._spinning(lane, seconds):
            self._record(lane, seconds)

    def _record(self, lane: _Lane, seconds: float) -> None:
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
        if len(lane.recent) < lane.settle:
            return
        now = median(lane.recent)
        known = lane.figure.get(lane.current)
        if known is None or lane.since == lane.settle:
            lane.figure[lane.current] = now
            known = now
            if lane.confirm is not None:
                before, lane.confirm = lane.confirm, None
                if not self._faster(lane.current, before, now, lane.figure[before]):  # the win was luck: back
                    lane.current = before
                    lane.probe_after = min(max(FIRST_PROBE_AFTER, 2 * lane.probe_after), MAX_PROBE_AFTER)
                    lane.skip, lane.since = lane.untimed, 0
                    lane.recent.clear()
                    return
        drifted = now > DRIFT_RATIO * known
        if drifted or lane.since >= lane.probe_after:
            other = self.counts[1] if lane.current == self.counts[0] else self.counts[0]
            if lane.gated and self._far_slower(other):  # decode steps have just paid for that count
                lane.since = 0
                return
            lane.figure[lane.current] = now  # the try is judged against the chosen count's latest steps
            lane.trying = other
            lane.tried, lane.skip = [], lane.untimed
            if drifted:
                lane.probe_after = FIRST_PROBE_AFTER

    def _record_try(self, lane: _Lane, seconds: float) -> None:
        assert lane.trying is not None
        lane.tried.append(seconds)
        base = lane.figure[lane.current]
        lost = len(lane.tried) == 1 and seconds > ABORT_RATIO * base
        if lost and seconds > FIRST_STEP_ABORT_RATIO * base:
            lane.probe_after = max(2 * lane.probe_after, 4 * FIRST_PROBE_AFTER)  # far slower: try less often
        if not lost and len(lane.tried) < lane.probe:
            return
        got = median(lane.tried)
        self._end_try(lane, got, won=not lost and self._faster(lane.trying, lane.current, got, base))

    @staticmethod
    def _faster(count: int, other: int, seconds: float, other_seconds: float) -> bool:
        """Whether ``count``'s median step ``seconds`` beats ``other``'s by the margin a switch to it needs."""
        if count < other:
            return seconds <= DOWN_SWITCH_RATIO * other_seconds
        return seconds < SWITCH_RATIO * other_seconds

    def _end_try(self, lane: _Lane, got: float, won: bool) -> None:
        assert lane.trying is not None
        lane.figure[lane.trying] = got
        if won:
            lane.confirm, lane.current, lane.probe_after = lane.current, lane.trying, FIRST_PROBE_AFTER
        else:
            lane.probe_after = min(max(FIRST_PROBE_AFTER, 2 * lane.probe_after), MAX_PROBE_AFTER)
        lane.trying, lane.tried, lane.skip, lane.since = None, [], lane.untimed, 0
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
