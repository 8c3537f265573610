"""Continuous batching: which sequences run in the next step.

Each step runs one decode batch (every request that is generating) and one packed prefill batch (chunks of
several waiting prompts in one varlen model call). A request moves from prefill to decode when its last prompt
chunk has run, and leaves when it finishes or is cancelled.

The step's token budget (``prefill_chunk_tokens``) bounds how long a generating request waits between tokens:
decode rows come first and count one token each, the prefill chunks share what is left (at least
``MIN_SHARE``). When nothing decodes, no one waits on the step, so the prefill gets the larger idle budget
(``prefill_chunk_tokens_idle``): fewer, larger model calls, which a GPU runs at a higher rate. A request that
arrives meanwhile waits at most one such step for its first chunk.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import torch
from torch import Tensor

from ..errors import EngineBusy
from ..types import SamplingParams
from .sequence import Checkpoint, Sequence

__all__ = ["Constraint", "EngineBusy", "Scheduler", "StepPlan", "Work"]

MIN_SHARE = 64
"""Smallest prefill chunk a prompt is given in a step (smaller ones waste the step on overhead)."""


class Constraint(Protocol):
    """Constrained decoding of one request (tool_choice, response_format): picks each token on the host."""

    def pick(self, logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
             remaining: int) -> tuple[int, float]:
        """The next token given logits [vocab] and ``remaining`` tokens of budget; (token, its logprob)."""
        ...

    def advance(self, token: int) -> None: ...


_ARRIVALS = itertools.count()


@dataclass(eq=False)  # compared by identity: a field-wise == would compare whole sessions
class Work:
    """One call on one session: prefill ``prompt`` (pending + new tokens), then generate (unless prefill_only)."""

    session: Sequence
    prompt: list[int]
    params: SamplingParams
    prefill_only: bool = False
    checkpoints: list[Checkpoint] = field(default_factory=list)
    """Checkpoints whose state should be captured when the prefill passes their position."""
    end_checkpoint: Checkpoint | None = None
    """Captured (state and pages) at the session's position when the work ends without an error: the state a
    next turn, a fork or a rollback starts from. Its position and state_pos are set then."""
    done_prefill: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    finished: anyio.Event = field(default_factory=anyio.Event)
    generator: torch.Generator | None = None
    constraint: Constraint | None = None
    """Constrained decoding (tool_choice, response_format), or None."""
    on_token: Callable[[int], None] | None = None
    """Run on the event loop after each sampled token (streaming)."""
    on_finish: Callable[[], None] | None = None
    """Run on the event loop once the work has finished, failed or been cancelled."""
    prompt_len: int = -1
    """Length of the prompt as submitted (``prompt`` grows if a failed step makes the session replay)."""
    replayed: int = 0
    """Tokens run through the model again after a failed step rolled the session back (see Runner)."""
    reserved_pages: int = 0
    """KV pages set aside at admission and not used yet; given back when the work ends."""
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))
    """Admission order: under page pressure the youngest works are parked first."""
    parked: list[Tensor] | None = None
    """While parked (preempted for pages): the session's KV rows [num_cached, C] per MLA layer, on the host."""

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt)

    @property
    def in_prefill(self) -> bool:
        return self.done_prefill < len(self.prompt)


def pending_token_only(w: Work) -> bool:
    """Whether what is left of ``w``'s prompt is its session's pending token alone (``generate`` after ``append``
    or after another ``generate``, a fork's first call), with no checkpoint to capture at it or after it. Such a
    token runs as a decode row: a decode step (one graph replay on a GPU, beside the other generating rows) gives
    the same state, cache row and logits as a one-token prefill, which runs eagerly: ``generate(1)`` after another
    took 10.45 ms that way and 2.84 ms as a decode row (H100, the 48B shape's first 16 layers, 1 x 128K;
    docs/benchmarks.md, "Agents' turns")."""
    if w.prefill_only or len(w.prompt) - w.done_prefill != 1:
        return False
    lo = w.session.num_cached
    return not any(lo <= c.target <= lo + 1 and c.state_pos < c.target for c in w.checkpoints)


@dataclass
class StepPlan:
    prefill: list[tuple[Work, int]]  # (work, number of prompt tokens this step)
    decode: list[Work]
    dropped: list[Work]
    """Cancelled work leaving the batch this step."""


class Scheduler:
    def __init__(self, prefill_budget: int, max_queued: int, idle_prefill_budget: int | None = None) -> None:
        self.prefill_budget = prefill_budget
        """Tokens a step runs while requests are generating (decode rows included)."""
        self.idle_prefill_budget = max(idle_prefill_budget or prefill_budget, prefill_budget)
        """Prefill tokens a step runs when no request is generating."""
        self.max_queued = max_queued
        self.waiting: deque[Work] = deque()
        self.running: list[Work] = []
        self.parked: list[Work] = []
        """Works preempted under page pressure, oldest first: their KV rows wait on the host for free pages."""
        self._rotate = 0

    def submit(self, work: Work) -> None:
        if len(self.waiting) >= self.max_queued:
            raise EngineBusy(f"{len(self.waiting)} requests are queued (limit {self.max_queued}); retry later")
        self.waiting.append(work)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    @property
    def runnable(self) -> bool:
        """Whether a step has anything to run (parked works wait for pages)."""
        return bool(self.waiting or self.running)

    def park(self, w: Work) -> None:
        self.running.remove(w)
        self.parked.append(w)
        self.parked.sort(key=lambda x: x.arrival)

    def unpark(self, w: Work) -> None:
        self.parked.remove(w)
        self.running.append(w)

    def plan(self) -> StepPlan:
        dropped = [w for w in self.running + self.parked if w.cancelled]
        self.running = [w for w in self.running if not w.cancelled and w.finish_reason is None]
        self.parked = [w for w in self.parked if not w.cancelled]
        while self.waiting:
            w = self.waiting.popleft()
            (dropped if w.cancelled else self.running).append(w)
        for w in dropped:
            w.finish_reason = w.finish_reason or "cancelled"
        for w in self.running:
            if pending_token_only(w):
                w.done_prefill = len(w.prompt)  # its one token runs as a decode row: see pending_token_only
        decode = [w for w in self.running if not w.in_prefill and not w.prefill_only and w.finish_reason is None]
        prefill = self._share_budget([w for w in self.running if w.in_prefill], self.budget(len(decode)))
        return StepPlan(prefill, decode, dropped)

    def budget(self, num_decode: int) -> int:
        """Prefill tokens of a step that also decodes ``num_decode`` rows: the idle budget when there are none,
        else what the rows leave of the step's budget, never below MIN_SHARE (nor the budget itself, if smaller)
        so that prompts still advance under a full decode batch."""
        if num_decode == 0:
            return self.idle_prefill_budget
        return max(self.prefill_budget - num_decode, min(MIN_SHARE, self.prefill_budget))

    def _share_budget(self, waiting: list[Work], budget: int) -> list[tuple[Work, int]]:
        """Split the step's prefill budget fairly: every prompt gets an equal share (at least MIN_SHARE tokens),
        what a short prompt leaves goes to the others, and the starting point rotates each step, so one huge
        tool output cannot hold back the prompts queued behind it."""
        if not waiting:
            return []
        self._rotate = (self._rotate + 1) % len(waiting)
        order = waiting[self._rotate :] + waiting[: self._rotate]
        grant = {id(w): 0 for w in order}
        active = list(order)
        while budget > 0 and active:
            share = max(budget // len(active), MIN_SHARE)
            for w in list(active):
                n = min(len(w.prompt) - w.done_prefill - grant[id(w)], share, budget)
                grant[id(w)] += n
                budget -= n
                if w.done_prefill + grant[id(w)] >= len(w.prompt):
                    active.remove(w)
                if budget <= 0:
                    break
        return [(w, grant[id(w)]) for w in order if grant[id(w)] > 0]

    def num_queued(self) -> int:
        return len(self.waiting) + len(self.parked) + sum(1 for w in self.running if w.in_prefill)
