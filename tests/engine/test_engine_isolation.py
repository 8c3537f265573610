"""Failure isolation in the engine step (issue 24.1-24.2): a fault in one request's sampling, constraint or model
row fails that request only, and every co-batched session keeps pools equal to a fresh prefill of its tokens.

Faults are injected at the culprit's last step, so the fault run and the reference run batch exactly the same
rows at every step and the victims' states can be compared bit for bit."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import kda_sessions as ks
import kda_sessions.engine.runner as runner_module
from kda_sessions.constrain.tool_choice import ToolChoiceConstraint

from .isolation_helpers import assert_equals_fresh_prefill, collect, one_step, pool_state, prompt, wait_queued

CULPRIT_SEED = 4242
TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}}]


class Injected(RuntimeError):
    pass


async def co_batched(eng: ks.Engine, culprit: str, n_victims: int = 2) -> tuple[list[ks.Session], ks.Session, dict[str, Any]]:
    """Victims generate 8 greedy tokens; the culprit 3 tokens (sampled, seeded; or under tool_choice), all
    starting in the same step. Returns the sessions and each one's Reply or exception."""
    victims = []
    for i in range(n_victims):
        v = await eng.create_session()
        await v.append(prompt(i))
        victims.append(v)
    c = await eng.create_session(system="sys", tools=TOOLS)
    await c.append(prompt(7))
    out: dict[str, Any] = {}
    go = collect(out)

    async with anyio.create_task_group() as tg:
        with one_step(eng):
            for i, v in enumerate(victims):
                tg.start_soon(go, f"v{i}", lambda v=v: v.generate(max_tokens=8, ignore_eos=True))
            if culprit == "constraint":
                tg.start_soon(go, "c", lambda: c.send("find x", max_tokens=3, tool_choice="required"))
            else:
                tg.start_soon(go, "c", lambda: c.generate(max_tokens=3, temperature=1.0, seed=CULPRIT_SEED, ignore_eos=True))
            await wait_queued(eng, n_victims + 1)
    return victims, c, out


def inject(monkeypatch: pytest.MonkeyPatch, eng: ks.Engine, where: str) -> None:
    """Raise on the culprit's third token: in the sampler, in its constraint, or in the model call of that step."""
    calls = {"n": 0}
    if where == "sampler":
        real = runner_module.sample_batch_top

        def sample_batch_top(logits, params, generators):  # type: ignore[no-untyped-def]
            out = real(logits, params, generators)
            for i, p in enumerate(params):
                if p.seed == CULPRIT_SEED:
                    calls["n"] += 1
                    if calls["n"] == 3:
                        out[i] = Injected("sampler fault")
            return out

        monkeypatch.setattr(runner_module, "sample_batch_top", sample_batch_top)
    elif where == "constraint":
        real_pick = ToolChoiceConstraint.pick

        def pick(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 3:
                raise Injected("constraint fault")
            return real_pick(self, *args, **kwargs)

        monkeypatch.setattr(ToolChoiceConstraint, "pick", pick)
    else:
        real_step = eng.runner.model.step
        broken = {"yes": False}

        def step(batch, pools, *args):  # type: ignore[no-untyped-def]
            culprit = next((s for s in eng.sessions.values() if s.tools), None)
            if culprit is not None and culprit.slot in batch.slots.tolist():
                if batch.is_decode and len(batch.num_new) > 1:
                    calls["n"] += 1
                    broken["yes"] = broken["yes"] or calls["n"] == 2
                if broken["yes"]:  # from its second decode step on, the culprit's row fails, alone too
                    raise Injected("model fault")
            return real_step(batch, pools, *args)

        monkeypatch.setattr(eng.runner.model, "step", step)


@pytest.mark.parametrize("where", ["sampler", "constraint"])
async def test_a_fault_after_the_model_call_fails_only_its_request(where, monkeypatch):
    async with await ks.Engine.open(store="memory:", page_size=16) as ref_eng:
        ref_victims, _, ref = await co_batched(ref_eng, where)
        assert all(isinstance(r, ks.Reply) for r in ref.values()), ref
        want = [pool_state(ref_eng, v) for v in ref_victims]
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        inject(monkeypatch, eng, where)
        victims, c, got = await co_batched(eng, where)
        assert isinstance(got["c"], Injected), got
        for i, v in enumerate(victims):
            assert isinstance(got[f"v{i}"], ks.Reply), got
            assert got[f"v{i}"].token_ids == ref[f"v{i}"].token_ids
            assert pool_state(eng, v).equal(want[i])  # bit for bit
            await assert_equals_fresh_prefill(eng, v)
        # the culprit's own session is consistent too, and it goes on
        await assert_equals_fresh_prefill(eng, c)
        monkeypatch.undo()
        assert (await c.send("again", max_tokens=2)).finish_reason in ("stop", "length")


async def test_a_model_fault_rolls_back_the_batch_and_retries_each_row_alone(monkeypatch):
    async with await ks.Engine.open(store="memory:", page_size=16) as ref_eng:
        _, _, ref = await co_batched(ref_eng, "model", n_victims=3)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        inject(monkeypatch, eng, "model")
        victims, c, got = await co_batched(eng, "model", n_victims=3)
        assert isinstance(got["c"], Injected), got
        for i, v in enumerate(victims):
            r = got[f"v{i}"]
            assert isinstance(r, ks.Reply), got
            assert r.token_ids == ref[f"v{i}"].token_ids
            assert r.usage.prefill_tokens > ref[f"v{i}"].usage.prefill_tokens  # it ran tokens again
            await assert_equals_fresh_prefill(eng, v)
        await assert_equals_fresh_prefill(eng, c)
        monkeypatch.undo()
        for v in victims:  # later turns continue from the rolled-back state
            assert len((await v.generate(max_tokens=3, ignore_eos=True)).token_ids) == 3
            await assert_equals_fresh_prefill(eng, v)


async def test_rollback_copies_a_partial_page_a_fork_shares(monkeypatch):
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session()
        await s.append(prompt(3, 40))
        await s.checkpoint("mid")  # state at 41 tokens: 2 full pages and a partial one
        child = await s.fork("mid")
        await s.generate(max_tokens=20, ignore_eos=True)  # fills the partial page and the next
        child_before = pool_state(eng, child)
        parent_pages = list(s.state.pages)
        eng.runner.rollback(s.state)  # as after a failed model call
        assert s.state.num_cached == eng.sessions[s.id].checkpoints["mid"].state_pos
        assert pool_state(eng, child).equal(child_before)
        assert s.state.pages[:2] == parent_pages[:2] and len(s.state.pages) == 3
        await assert_equals_fresh_prefill(eng, s)
        r = await s.generate(max_tokens=2, ignore_eos=True)
        assert r.usage.prefill_tokens > 0
        await assert_equals_fresh_prefill(eng, s)


@pytest.mark.parametrize("seed", [0, 1])
async def test_random_faults_fail_exactly_their_requests(seed, monkeypatch):
    """Faults at random rows and steps: the sampler raises for a random row now and then, and from a random step
    on, one random session's row makes every model call that holds it raise. Exactly the requests hit fail; every
    session, failed or not, holds pools equal to a fresh prefill of its tokens and answers the next call."""
    import random

    rng = random.Random(seed)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        sessions = []
        for i in range(4):
            s = await eng.create_session()
            await s.append(prompt(i))
            sessions.append(s)
        hit: set[int] = set()  # id() of the SamplingParams of requests whose sampler raised
        poisoned = {"slot": None, "after": rng.randrange(2, 8), "calls": 0}
        real_sample = runner_module.sample_batch_top
        real_step = eng.runner.model.step

        def sample_batch_top(logits, params, generators):  # type: ignore[no-untyped-def]
            out = real_sample(logits, params, generators)
            for i, p in enumerate(params):
                if rng.random() < 0.04:
                    hit.add(id(p))
                    out[i] = Injected("sampler fault")
            return out

        def step(batch, pools, *args):  # type: ignore[no-untyped-def]
            poisoned["calls"] += 1
            if poisoned["slot"] is None and poisoned["calls"] >= poisoned["after"]:
                poisoned["slot"] = rng.choice(batch.slots.tolist())
            if poisoned["slot"] in batch.slots.tolist():
                raise Injected("model fault")
            return real_step(batch, pools, *args)

        monkeypatch.setattr(runner_module, "sample_batch_top", sample_batch_top)
        monkeypatch.setattr(eng.runner.model, "step", step)
        out: dict[int, Any] = {}
        params: dict[int, Any] = {}
        real_start = eng.manager.admission.start

        async def start(s, p, **kw):  # type: ignore[no-untyped-def]
            params[next(i for i, x in enumerate(sessions) if x.state is s)] = p
            return await real_start(s, p, **kw)

        monkeypatch.setattr(eng.manager.admission, "start", start)

        async def go(i: int) -> None:
            try:
                out[i] = await sessions[i].generate(max_tokens=10, ignore_eos=True)
            except Injected as e:
                out[i] = e

        async with anyio.create_task_group() as tg:
            with one_step(eng):
                for i in range(4):
                    tg.start_soon(go, i)
                await wait_queued(eng, 4)
        poisoned_slot = poisoned["slot"]
        monkeypatch.undo()
        for i, s in enumerate(sessions):
            expect_fail = id(params[i]) in hit or s.state.slot == poisoned_slot
            assert isinstance(out[i], Injected) == expect_fail, (i, out[i], expect_fail)
            if not expect_fail:
                assert len(out[i].token_ids) == 10
            await assert_equals_fresh_prefill(eng, s)
        for s in sessions:
            assert len((await s.generate(max_tokens=2, ignore_eos=True)).token_ids) == 2
            await assert_equals_fresh_prefill(eng, s)
