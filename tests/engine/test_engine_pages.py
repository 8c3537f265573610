"""KV pages under pressure (issue 24.7): admission reserves a request's prompt pages and waits while running
requests hold the pool; generating requests that together overrun it are preempted (parked, their KV rows on the
host) and resume when pages free up, with the tokens of a run without pressure."""

from __future__ import annotations

import anyio
import pytest

import kda_sessions as ks
from kda_sessions.engine.pool import OutOfPages

from .isolation_helpers import assert_equals_fresh_prefill, one_step, prompt, wait_queued


async def test_requests_that_cannot_all_fit_do_not_fail_together():
    # 3 sessions of 2 pages each (30-32 tokens, pages of 16), each then asking for 2 more pages: 12 > 10 pages
    async with await ks.Engine.open(store="memory:", page_size=16) as ref_eng:
        alone: list[list[int]] = [[], [], []]

        async def ref(i: int) -> None:
            s = await ref_eng.create_session()
            await s.append(prompt(i))
            alone[i] = (await s.generate(max_tokens=20, ignore_eos=True)).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(ref, i)
    async with await ks.Engine.open(store="memory:", page_size=16, num_pages=10) as eng:
        sessions = []
        for i in range(3):
            s = await eng.create_session()
            await s.append(prompt(i))
            sessions.append(s)
        out: dict[int, object] = {}

        async def go(i: int) -> None:
            try:
                out[i] = await sessions[i].generate(max_tokens=20, ignore_eos=True)
            except Exception as e:  # the test inspects it
                out[i] = e

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(go, i)
        for i in range(3):
            r = out[i]
            assert isinstance(r, ks.Reply), out
            assert r.token_ids == alone[i]
        assert eng.pages.reserved == 0
        assert any(not s.state.resident for s in sessions)  # one waited for another to end and move out
        for s in sessions:
            if s.state.resident:
                await assert_equals_fresh_prefill(eng, s)


async def test_a_request_waits_for_a_busy_session_then_is_refused_or_served():
    async with await ks.Engine.open(store="memory:", page_size=16, num_pages=4, page_wait_s=0.3) as eng:
        s = await eng.create_session()
        await s.append(prompt(1))  # 2 pages
        t = await eng.create_session()
        await t.append(prompt(2))  # 2 pages: the pool is full
        before = s.num_tokens
        await t.state.lock.acquire()  # t answers a request: it cannot be moved out
        t0 = anyio.current_time()
        try:
            with pytest.raises(OutOfPages):
                await s.generate(max_tokens=20, ignore_eos=True)
        finally:
            t.state.lock.release()
        assert 0.25 <= anyio.current_time() - t0 < 5 and s.num_tokens == before and eng.pages.reserved == 0
        r = await s.generate(max_tokens=20, ignore_eos=True)  # t is idle now: it moves out to the store
        assert len(r.token_ids) == 20 and not t.state.resident and eng.pages.reserved == 0


async def generate_all(eng: ks.Engine, n: int, max_tokens: int, stream: int = -1) -> tuple[list[ks.Session], dict]:
    """n sessions with prompt(i) prefilled, then n generations started in one engine step (the ``stream``-th
    one streamed); their replies (or errors) by index."""
    sessions = []
    for i in range(n):
        s = await eng.create_session()
        await s.append(prompt(i))
        sessions.append(s)
    out: dict[int, object] = {}

    async def go(i: int) -> None:
        try:
            if i == stream:
                events = [ev async for ev in sessions[i].stream([], max_tokens=max_tokens, ignore_eos=True)]
                out[i] = events[-1].reply  # type: ignore[union-attr]
            else:
                out[i] = await sessions[i].generate(max_tokens=max_tokens, ignore_eos=True)
        except Exception as e:  # the test inspects it
            out[i] = e

    async with anyio.create_task_group() as tg:
        with one_step(eng):
            for i in range(n):
                tg.start_soon(go, i)
            await wait_queued(eng, n)
    return sessions, out


async def test_generations_that_overrun_the_pool_are_preempted_and_resume_bit_for_bit():
    """3 sessions of 2 pages (pages of 16) each generating 40 tokens need 15 pages; the pool has 10. Each passes
    admission (its prompt fits); the youngest are parked when pages run out and resume as others end. With
    worst-case reservations (no preemption) the second request is refused after page_wait_s."""
    async with await ks.Engine.open(store="memory:", page_size=16) as ref_eng:
        _, want = await generate_all(ref_eng, 3, 40, stream=2)
    async with await ks.Engine.open(store="memory:", page_size=16, num_pages=10, page_wait_s=0.5) as eng:
        sessions, got = await generate_all(eng, 3, 40, stream=2)
        for i in range(3):
            assert isinstance(got[i], ks.Reply), got
            assert got[i].token_ids == want[i].token_ids  # type: ignore[union-attr]
        stats = eng.stats()
        assert stats["preemptions"] > 0 and stats["pages_reserved"] == 0
        for s in sessions:  # parked and resumed, or moved out and back: the state is a fresh prefill's
            r = await s.generate(max_tokens=1, ignore_eos=True)
            assert r.usage.prefill_tokens == 1  # only the pending token: nothing was recomputed
            await assert_equals_fresh_prefill(eng, s)


async def test_a_parked_request_that_is_cancelled_leaves_a_consistent_session():
    # the old request reserves its worst case (4 of 4 free pages); the young one starts on its prompt's pages,
    # needs a third page at once, is parked (nobody younger to park), and is cancelled there
    async with await ks.Engine.open(store="memory:", page_size=16, num_pages=8) as eng:
        sessions = []
        for i in range(2):
            s = await eng.create_session()
            await s.append(prompt(i))
            sessions.append(s)
        young = anyio.CancelScope()

        async def go_young() -> None:
            with young:
                await sessions[1].generate(max_tokens=60, ignore_eos=True)

        async def cancel_when_parked() -> None:
            with anyio.fail_after(30):
                while not eng.scheduler.parked:
                    await anyio.sleep(0.005)
            young.cancel()

        async with anyio.create_task_group() as tg:
            with one_step(eng):
                tg.start_soon(sessions[0].generate, 60, 0.0, None, None, 1.0, 0, False, True)
                tg.start_soon(go_young)
                await wait_queued(eng, 2)
            tg.start_soon(cancel_when_parked)
        assert young.cancelled_caught and not eng.scheduler.parked and eng.pages.reserved == 0
        assert eng.stats()["preemptions"] == 1
        assert sessions[1].state.num_cached == 0  # it starts over: its tokens are pending again
        for s in sessions:
            await s.generate(max_tokens=2, ignore_eos=True)
            await assert_equals_fresh_prefill(eng, s)
