"""The end of a step: sampled tokens join their sequences, requests finish (end of sequence, length, stop
strings), the state a finished request leaves is checkpointed, and finished requests leave the running set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..tokenizer import Tokenizer
from .checkpoints import capture
from .pool import Pools
from .scheduler import Scheduler, StepPlan, Work


@dataclass
class Sampled:
    work: Work
    token: int
    logprob: float
    top: list[tuple[int, float]]
    """(token, logprob) of the most likely tokens, when the request asked for top_logprobs."""


def postprocess(
    plan: StepPlan, sampled: list[Sampled], finished: list[Work], pools: Pools, scheduler: Scheduler,
    tokenizer: Tokenizer, before_capture: Callable[[list[Work]], None] | None = None,
) -> list[tuple[Work, int]]:
    """Apply the step's samples, finish what is done (``finished`` grows) and checkpoint where finished requests
    leave their sequences; returns (work, token) of every sampled token, for streaming. ``before_capture(finished)``
    runs once the finished requests are known, before their end checkpoints are captured (a step queued ahead is
    undone for them there: ``Runner._finish_step``)."""
    for smp in sampled:
        w = smp.work
        w.output.append(smp.token)
        w.session.tokens.append(smp.token)  # pending: fed by the next decode step or the next call
        if w.params.logprobs:
            w.logprobs.append(smp.logprob)
        if w.params.top_logprobs:
            w.top_logprobs.append(smp.top)
        if smp.token in tokenizer.eos_ids and not w.params.ignore_eos:
            w.finish_reason = "stop"
        elif len(w.output) >= w.params.max_tokens:
            w.finish_reason = "length"
        elif w.params.stop and hit_stop(w, tokenizer):
            w.finish_reason = "stop"
        if w.finish_reason is not None and w not in finished:
            finished.append(w)
    finished.extend(w for w in plan.dropped if w not in finished)
    with pools.mutex:
        if before_capture is not None:
            before_capture(finished)
        for w in finished:
            s, c = w.session, w.end_checkpoint
            if w.error is None and c is not None and s.slot is not None:
                c.position = s.num_tokens
                capture(s, c, s.num_cached, pools.read_slot_async(s.slot), pools)
        scheduler.running = [w for w in scheduler.running if w not in finished]
    return [(smp.work, smp.token) for smp in sampled]


def hit_stop(w: Work, tokenizer: Tokenizer) -> bool:
    stops = w.params.stop or []
    longest = max(len(s) for s in stops)
    # decode only a tail long enough to hold any stop string (byte tokens: 4 bytes per char at most)
    tail = tokenizer.decode(w.output[-(4 * longest + 8) :], skip_special=True)
    return any(s in tail for s in stops)
