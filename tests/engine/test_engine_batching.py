"""Continuous batching, sampling, cancellation, back-pressure and eviction on the CPU engine."""

from __future__ import annotations

import anyio
import pytest

import kda_sessions as ks


def prompt(i: int, n: int = 30) -> list[int]:
    return [(i * 13 + j * 7) % 250 for j in range(n + i)]


# 6 sessions in the default run (prompts of 30..35 tokens: 2 and 3 pages of 16), 16 with -m slow
@pytest.mark.parametrize("n", [6, pytest.param(16, marks=pytest.mark.slow)], ids=lambda n: f"{n}-sessions")
async def test_concurrent_sessions_match_one_at_a_time(n):
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        alone = []
        for i in range(n):
            s = await eng.create_session()
            await s.append(prompt(i))
            alone.append((await s.generate(max_tokens=8, ignore_eos=True)).token_ids)
        sessions = []
        for i in range(n):
            s = await eng.create_session()
            await s.append(prompt(i))
            sessions.append(s)
        together: list[list[int]] = [[] for _ in range(n)]
        steps_before = eng.runner.steps

        async def go(i: int) -> None:
            together[i] = (await sessions[i].generate(max_tokens=8, ignore_eos=True)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(go, i)
        assert together == alone
        # they really shared steps: far fewer than n x 8 model calls
        assert eng.runner.steps - steps_before < n * 8 // 2


async def test_seeded_sampling_repeats_and_params_are_checked():
    async with await ks.Engine.open(store="memory:") as eng:
        outs = []
        for _ in range(2):
            s = await eng.create_session()
            await s.append(prompt(1))
            outs.append((await s.generate(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)).token_ids)
        assert outs[0] == outs[1]
        s = await eng.create_session()
        await s.append(prompt(1))
        other = (await s.generate(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)).token_ids
        assert other != outs[0]
        with pytest.raises(ValueError, match="top_p"):
            await s.generate(top_p=0)
        with pytest.raises(ValueError, match="max_tokens"):
            await s.generate(max_tokens=0)


async def test_stop_strings_and_logprobs():
    async with await ks.Engine.open(store="memory:") as eng:
        s = await eng.create_session()
        await s.append(prompt(2))
        full = await s.generate(max_tokens=20, ignore_eos=True, logprobs=True)
        assert full.logprobs is not None and len(full.logprobs) == 20 and all(lp <= 0 for lp in full.logprobs)
        text = full.text
        stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable() and text[i : i + 2].strip()), None)
        if stop is None:
            pytest.skip("no printable stop candidate in this output")
        s2 = await eng.create_session()
        await s2.append(prompt(2))
        r = await s2.generate(max_tokens=20, ignore_eos=True, stop=[stop])
        assert r.finish_reason == "stop" and stop not in r.text and len(r.token_ids) < 20


async def test_cancelled_stream_frees_its_slot():
    async with await ks.Engine.open(store="memory:") as eng:
        s = await eng.create_session()
        await s.append(prompt(3))
        with anyio.fail_after(60):
            n = 0
            async for ev in s.stream("go", max_tokens=10_000, ignore_eos=True):
                if isinstance(ev, ks.TokenDelta):
                    n += 1
                if n >= 3:
                    break
            # the generation stopped: nothing is running, the session is usable again
            await anyio.sleep(0.05)
            assert eng.scheduler.running == [] and eng.stats()["queue_depth"] == 0
            r = await s.send("again", max_tokens=3, ignore_eos=True)
            assert len(r.token_ids) == 3
            # a cancelled task cancels its generation too
            with anyio.move_on_after(0.3):
                await s.generate(max_tokens=10_000, ignore_eos=True)
            await anyio.sleep(0.05)
            assert eng.scheduler.running == []
            r = await s.generate(max_tokens=2, ignore_eos=True)
            assert len(r.token_ids) == 2


async def test_stream_yields_deltas_then_done():
    async with await ks.Engine.open(store="memory:") as eng:
        s = await eng.create_session(system="sys")
        events = [ev async for ev in s.stream("hello", max_tokens=6, ignore_eos=True)]
        assert isinstance(events[-1], ks.Done)
        reply = events[-1].reply
        streamed = "".join(ev.text for ev in events if isinstance(ev, ks.TokenDelta))
        assert streamed == reply.text and reply.usage.completion_tokens == 6


def test_queue_bound_answers_busy():
    from kda_sessions.engine.sampler import SamplingParams
    from kda_sessions.engine.scheduler import Scheduler, Work
    from kda_sessions.engine.sequence import Sequence

    sched = Scheduler(prefill_budget=64, max_queued=2)
    works = [Work(session=Sequence(id=f"s{i}"), prompt=[1, 2], params=SamplingParams()) for i in range(3)]
    sched.submit(works[0])
    sched.submit(works[1])
    with pytest.raises(ks.EngineBusy, match="queued"):
        sched.submit(works[2])
    plan = sched.plan()  # the queue drains into the running batch, making room again
    assert {w.session.id for w, _ in plan.prefill} == {"s0", "s1"}
    sched.submit(works[2])


async def test_idle_sessions_are_evicted_and_come_back(tmp_path):
    async with await ks.Engine.open(store=f"disk:{tmp_path}", max_active_sessions=2, num_pages=24, page_size=16) as eng:
        ref = []
        sessions = []
        for i in range(4):  # 4 sessions, 2 slots: older ones move out to the store
            s = await eng.create_session()
            await s.append(prompt(i, 100))
            sessions.append(s)
        assert sum(1 for s in sessions if s.state.resident) <= 2
        assert eng.stats()["evictions"] >= 2
        for s in sessions:
            ref.append((await s.generate(max_tokens=4, ignore_eos=True)).token_ids)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        for i in range(4):
            s = await eng.create_session()
            await s.append(prompt(i, 100))
            assert (await s.generate(max_tokens=4, ignore_eos=True)).token_ids == ref[i]


async def test_checkpoints_in_memory_are_bounded(tmp_path):
    async with await ks.Engine.open(store=f"disk:{tmp_path}", max_checkpoints_in_memory=3) as eng:
        s = await eng.create_session(system="sys")
        await s.send("one", max_tokens=2)
        await s.save()  # msg-1, msg-2 are now stored
        for word in ("two", "three", "four"):
            await s.send(word, max_tokens=2)
        await s.checkpoint("mine")
        in_memory = [c.name for c in s.state.checkpoints.values() if c.resident]
        # the head (msg-0: the system prompt, which other conversations start from) is kept besides the newest 3
        assert sum(1 for n in in_memory if n.startswith("msg-") and n != "msg-0") == 3
        assert "msg-0" in in_memory and "mine" in in_memory
        # an old, saved checkpoint still forks (its state comes back from the store)
        assert not s.state.checkpoints["msg-1"].resident
        child = await eng.fork(s.id, "msg-1")
        r = await child.send("again", max_tokens=2)
        assert r.usage.cached_tokens > 0


def test_prefill_budget_is_shared_fairly():
    from kda_sessions.engine.sampler import SamplingParams
    from kda_sessions.engine.scheduler import Scheduler, Work
    from kda_sessions.engine.sequence import Sequence

    sched = Scheduler(prefill_budget=1000, max_queued=8)
    huge = Work(session=Sequence(id="big"), prompt=[1] * 100_000, params=SamplingParams())
    small = [Work(session=Sequence(id=f"s{i}"), prompt=[1] * 150, params=SamplingParams()) for i in range(3)]
    for w in (huge, *small):
        sched.submit(w)
    plan = sched.plan()
    got = {w.session.id: n for w, n in plan.prefill}
    assert sum(got.values()) == 1000
    assert all(got[f"s{i}"] == 150 for i in range(3))  # the short prompts finish in this very step
    assert got["big"] == 1000 - 450


async def test_refused_call_leaves_the_session_unchanged():
    async with await ks.Engine.open(store="memory:", num_pages=8, page_size=16) as eng:
        s = await eng.create_session(system="sys")
        await s.send("hi", max_tokens=2)
        before = (list(s.state.tokens), list(s.messages), s.state.turn_open)
        with pytest.raises(ValueError, match="KV capacity"):
            await s.send("again", max_tokens=10**6)
        with pytest.raises(ValueError, match="KV capacity"):
            await s.append(list(range(200)))
        assert (list(s.state.tokens), list(s.messages), s.state.turn_open) == before
        r = await s.send("fine", max_tokens=2)
        assert r.usage.completion_tokens >= 1
