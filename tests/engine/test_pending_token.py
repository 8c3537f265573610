"""A call whose prompt is its session's pending token alone (``generate`` after ``append`` or after another
``generate``) runs that token as a decode row (``scheduler.pending_token_only``), not as a one-token prefill:
the same tokens, logprobs and states, and no prefill model call."""

from __future__ import annotations

import pytest
import torch

import kda_sessions as ks
from kda_sessions.engine import runner as runner_module
from kda_sessions.engine import scheduler as scheduler_module
from kda_sessions.engine.scheduler import Work, pending_token_only
from kda_sessions.engine.sequence import Checkpoint, Sequence
from kda_sessions.types import SamplingParams

from .test_decode_ahead import prompt, together


async def run_turns(device: str, convert: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Three sessions: ``append`` then two ``generate`` calls each (the second continues the first), all at once;
    with ``convert`` off every pending token runs as a one-token prefill, as before."""
    monkeypatch.setattr(scheduler_module, "pending_token_only",
                        pending_token_only if convert else (lambda w: False))
    prefills: list[list[int]] = []
    real = runner_module.Runner._prefill

    def counted(self, chunks, out):  # type: ignore[no-untyped-def]
        if chunks:
            prefills.append([n for _, n in chunks])
        return real(self, chunks, out)

    monkeypatch.setattr(runner_module.Runner, "_prefill", counted)
    async with await ks.Engine.open(store="memory:", device=device, page_size=16) as eng:
        ss = [await eng.create_session() for _ in range(3)]
        for i, s in enumerate(ss):
            await s.append(prompt(i))
        appended = list(prefills)
        first = await together(ss, max_tokens=[5, 9, 7], ignore_eos=[True] * 3, logprobs=[True] * 3,
                               temperature=[0.0, 0.8, 0.0], seed=[None, 4, None])
        then = await together(ss, max_tokens=[6] * 3, ignore_eos=[True] * 3, logprobs=[True] * 3)
        seqs = [eng.sessions[s.id] for s in ss]
        states = [eng.runner.pools.read_slot(q.slot) for q in seqs]
        return {
            "tokens": [r.token_ids for r in first] + [r.token_ids for r in then],
            "logprobs": [r.logprobs for r in first] + [r.logprobs for r in then],
            "positions": [(q.num_cached, len(q.tokens)) for q in seqs], "states": states,
            "prefills_after_append": prefills[len(appended):],
            "usage": [r.usage.prompt_tokens for r in first],
        }


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_the_pending_token_runs_as_a_decode_row(device: str, monkeypatch: pytest.MonkeyPatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    before = await run_turns(device, False, monkeypatch)
    now = await run_turns(device, True, monkeypatch)
    assert before["prefills_after_append"] and all(n == [1] * len(n) for n in before["prefills_after_append"])
    assert now["prefills_after_append"] == []  # no one-token prefill: each ran in a decode step
    assert now["tokens"] == before["tokens"]
    for a, b in zip(now["logprobs"], before["logprobs"]):
        # on a GPU the one-token prefill of "before" runs padded through the prefill graphs (MLA absorbed, other
        # roundings), not the decode kernels: bf16-level differences
        assert a == pytest.approx(b, abs=1e-3 if device == "cuda" else 1e-5)
    assert now["positions"] == before["positions"] and all(c == n - 1 for c, n in now["positions"])
    tol = dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-5)
    for (k1, c1), (k0, c0) in zip(now["states"], before["states"]):
        torch.testing.assert_close(k1, k0, **tol)
        torch.testing.assert_close(c1, c0, **tol)
    assert now["usage"] == before["usage"]


def test_pending_token_only_leaves_prompts_prefills_and_checkpoints_to_the_prefill():
    s = Sequence(id="s", tokens=[1, 2, 3, 4], num_cached=3)
    one = Work(session=s, prompt=[4], params=SamplingParams())
    assert pending_token_only(one)
    assert not pending_token_only(Work(session=s, prompt=[4], params=SamplingParams(), prefill_only=True))
    s2 = Sequence(id="t", tokens=[1, 2, 3, 4], num_cached=2)
    assert not pending_token_only(Work(session=s2, prompt=[3, 4], params=SamplingParams()))
    # a checkpoint to capture at the token's end (position 5: the state after token 4) or before it
    for position in (5, 4):
        w = Work(session=s, prompt=[4], params=SamplingParams(),
                 checkpoints=[Checkpoint(name="c", position=position, state_pos=-1)])
        assert not pending_token_only(w)
    done = Work(session=s, prompt=[4], params=SamplingParams(),
                checkpoints=[Checkpoint(name="c", position=4, state_pos=3)])  # already exact
    assert pending_token_only(done)
