"""Admission reserves the KV pages a request may need, and queues a request while running ones hold the pool
(issue 24.7): requests admitted together never run out of pages in the middle of their generations."""

from __future__ import annotations

import anyio
import pytest

import kda_sessions as ks
from kda_sessions.engine.pool import OutOfPages

from .isolation_helpers import assert_equals_fresh_prefill, prompt


async def test_requests_that_cannot_all_fit_queue_instead_of_failing_together():
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
