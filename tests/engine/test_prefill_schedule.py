"""The prefill schedule: a larger budget when nothing decodes, decode rows first when something does, several
prompts packed into one model call; greedy outputs equal those of one unchunked prefill alone (CPU)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import kda_sessions as ks
from kda_sessions.engine.sampler import SamplingParams
from kda_sessions.engine.scheduler import MIN_SHARE, Scheduler, Work
from kda_sessions.engine.sequence import Sequence
from kda_sessions.model import ForwardBatch


def work(name: str, n: int) -> Work:
    return Work(session=Sequence(id=name), prompt=[1] * n, params=SamplingParams())


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    ("busy", "idle", "num_decode", "expected"),
    [(2048, 8192, 0, 8192), (2048, 8192, 5, 2043), (2048, None, 0, 2048), (2048, 1024, 0, 2048),
     (256, 8192, 250, MIN_SHARE), (16, 8192, 40, 16)],
    ids=["idle", "decode-first", "idle-unset", "idle-never-below-busy", "floor", "floor-capped-by-busy"],
)
def test_budget_policy(busy: int, idle: int | None, num_decode: int, expected: int) -> None:
    assert Scheduler(busy, 8, idle).budget(num_decode) == expected


def test_plan_packs_prompts_into_the_budget_left_by_decode_rows() -> None:
    sched = Scheduler(prefill_budget=1000, max_queued=8, idle_prefill_budget=4000)
    prompts = [work(f"p{i}", 3000) for i in range(3)]
    for w in prompts:
        sched.submit(w)
    idle = sched.plan()
    assert idle.decode == [] and len(idle.prefill) == 3 and sum(n for _, n in idle.prefill) == 4000
    generating = work("g", 10)
    generating.done_prefill = 10
    sched.running.append(generating)
    busy = sched.plan()
    assert busy.decode == [generating] and len(busy.prefill) == 3 and sum(n for _, n in busy.prefill) == 999


def record_calls(eng: Any, calls: list[list[int]]) -> None:
    """Make every model call of ``eng`` append its batch's num_new to ``calls``."""
    step = eng.model.step

    def recorded(batch: ForwardBatch, pools: Any, *args: Any) -> Any:
        calls.append(list(batch.num_new))
        return step(batch, pools, *args)

    eng.model.step = recorded


async def test_engine_uses_the_idle_chunk_alone_and_shares_the_busy_one() -> None:
    calls: list[list[int]] = []
    async with await ks.Engine.open(store="memory:", page_size=16, prefill_chunk_tokens=128,
                                    prefill_chunk_tokens_idle=256) as eng:
        record_calls(eng, calls)
        s = await eng.create_session()
        await s.append(ids(600, 1))
        assert [sum(c) for c in calls] == [256, 256, 87]  # alone: idle chunks (the last token waits for a call)
        calls.clear()
        g = await eng.create_session()
        await g.append(ids(20, 2))
        p = await eng.create_session()

        async def generate() -> None:
            await g.generate(max_tokens=40, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            with anyio.fail_after(60):  # g runs before the prompt arrives (else the prompt may finish alone first)
                while [1] not in calls:
                    await anyio.sleep(0.001)
            await p.append(ids(600, 3))
        prefills = [c for c in calls if c != [1]]
        # while g decodes (a [1] call per step), the prompt gets what its row leaves of 128; alone, the idle chunk
        assert any(sum(c) == 127 for c in prefills), calls
        assert all(sum(c) <= 256 for c in prefills) and sum(sum(c) for c in prefills) >= 600


async def test_concurrent_prefills_share_model_calls() -> None:
    calls: list[list[int]] = []
    async with await ks.Engine.open(store="memory:", page_size=16, prefill_chunk_tokens=256,
                                    prefill_chunk_tokens_idle=1024) as eng:
        record_calls(eng, calls)
        sessions = [await eng.create_session() for _ in range(4)]
        async with anyio.create_task_group() as tg:
            for i, s in enumerate(sessions):
                tg.start_soon(s.append, ids(300, 10 + i))
        # 1,200 tokens of 4 prompts in 2 calls of up to 1,024, not 4 or more
        assert len(calls) <= 3 and max(len(c) for c in calls) >= 3


async def test_greedy_under_the_schedule_equals_one_unchunked_prefill_alone() -> None:
    """Chunk boundaries move float sums (KDA's chunked form, MLA's tiles), so equality of greedy tokens is the
    promise, and logprobs agree within 1e-4 (float32, tiny-random)."""
    prompts = [ids(n, 20 + i) for i, n in enumerate((700, 450, 90, 520))]
    alone = []
    async with await ks.Engine.open(store="memory:", page_size=16, prefill_chunk_tokens=4096) as eng:
        for p in prompts:
            s = await eng.create_session()
            await s.append(p)
            alone.append(await s.generate(max_tokens=10, ignore_eos=True, logprobs=True))
    together: list[Any] = [None] * len(prompts)
    calls: list[list[int]] = []
    async with await ks.Engine.open(store="memory:", page_size=16, prefill_chunk_tokens=96,
                                    prefill_chunk_tokens_idle=384) as eng:
        record_calls(eng, calls)
        sessions = [await eng.create_session() for _ in prompts]

        async def go(i: int) -> None:
            await anyio.sleep(0.05 * i)  # later ones prefill while earlier ones decode
            await sessions[i].append(prompts[i])
            together[i] = await sessions[i].generate(max_tokens=10, ignore_eos=True, logprobs=True)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(go, i)
    assert any(len(c) > 1 for c in calls)  # some calls did pack several sequences
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids and a.logprobs is not None and b.logprobs is not None
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
