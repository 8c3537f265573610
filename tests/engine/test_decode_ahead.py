"""Decode ahead (``EngineConfig.decode_ahead``): each decode step queued before the host reads the one before it,
its ids fed on the device. On a CPU the option does nothing, so these tests give the runner the static-buffer
step (``DecodeGraphs``, eager) and turn it on by hand; the reference engine runs the same step without it. Tokens,
logprobs and the states sessions are left in must be the same, token for token."""

from __future__ import annotations

import anyio
import pytest
import torch

import kda_sessions as ks
from kda_sessions.engine.runner import runs_ahead
from kda_sessions.engine.scheduler import Work
from kda_sessions.engine.sequence import Sequence
from kda_sessions.model.graphs import DecodeGraphs
from kda_sessions.types import SamplingParams


def prompt(i: int, n: int = 30) -> list[int]:
    return [(i * 13 + j * 7) % 250 for j in range(n + i)]


async def engine(ahead: bool) -> ks.Engine:
    eng = await ks.Engine.open(store="memory:", page_size=16)
    r = eng.runner
    r.graphs = DecodeGraphs(r.model, r.pools.tensors, enabled=False, capture_lock=r.pools.mutex)
    r.decode_ahead = ahead
    return eng


async def together(sessions: list, **kw_each: list) -> list:
    """``generate`` on every session at once; kw_each: per-session keyword lists."""
    replies: list = [None] * len(sessions)

    async def go(i: int) -> None:
        replies[i] = await sessions[i].generate(**{k: v[i] for k, v in kw_each.items()})

    async with anyio.create_task_group() as tg:
        for i in range(len(sessions)):
            tg.start_soon(go, i)
    return replies


async def test_rows_leaving_by_length_give_the_same_tokens_logprobs_and_states():
    lengths = [3, 7, 12, 20]
    runs = []
    for ahead in (False, True):
        eng = await engine(ahead)
        async with eng:
            sessions = []
            for i in range(len(lengths)):
                s = await eng.create_session()
                await s.append(prompt(i))
                sessions.append(s)
            first = await together(sessions, max_tokens=lengths, ignore_eos=[True] * 4, logprobs=[True] * 4)
            then = await together(sessions, max_tokens=[5] * 4, ignore_eos=[True] * 4)
            runs.append({
                "tokens": [r.token_ids for r in first], "logprobs": [r.logprobs for r in first],
                "then": [r.token_ids for r in then], "ahead": eng.runner.steps_ahead,
                "reasons": [r.finish_reason for r in first],
            })
    off, on = runs
    assert off["ahead"] == 0 and on["ahead"] >= 15  # 20 steps, the first of each run not ahead
    assert [len(t) for t in on["tokens"]] == lengths and on["reasons"] == ["length"] * 4
    assert on["tokens"] == off["tokens"]
    for a, b in zip(on["logprobs"], off["logprobs"]):
        assert a == pytest.approx(b, abs=1e-6)
    assert on["then"] == off["then"]  # each session was left where it would be without decode ahead


async def test_a_stop_token_ends_its_row_and_leaves_the_state_at_the_pending_token():
    # the stop token: one the reference's greedy row 0 yields at its 5th token and not before
    async with await engine(False) as eng:
        s = await eng.create_session()
        await s.append(prompt(0))
        toks = (await s.generate(max_tokens=12, ignore_eos=True)).token_ids
    at = next(i for i in range(4, 12) if toks[i] not in toks[:i])
    stop = toks[at]
    runs = []
    for ahead in (False, True):
        eng = await engine(ahead)
        async with eng:
            eng.runner.tokenizer.eos_ids = {stop}
            a, b = await eng.create_session(), await eng.create_session()
            await a.append(prompt(0))
            await b.append(prompt(1))
            first = await together([a, b], max_tokens=[12, 16], ignore_eos=[False, True])
            then = await together([a, b], max_tokens=[6, 6], ignore_eos=[True, True])
            runs.append(([r.token_ids for r in first], [r.finish_reason for r in first],
                         [r.token_ids for r in then], eng.runner.steps_ahead))
    (off_first, off_reason, off_then, _), (on_first, on_reason, on_then, on_ahead) = runs
    assert on_ahead > 0
    assert off_reason == on_reason == ["stop", "length"]
    assert on_first == off_first and len(on_first[0]) == at + 1 and on_first[0][-1] == stop
    # row 0 ran as a dummy in the step after its stop token: its state did not move
    assert on_then == off_then


engine_on_cpu = engine


def stop_string_at(tok, toks: list[int], first: int = 4) -> tuple[int, str]:
    """(i, s): a string s that ``toks`` decoded reaches at token i (>= first) and not before."""
    for i in range(first, len(toks)):
        before, upto = tok.decode(toks[:i], skip_special=True), tok.decode(toks[: i + 1], skip_special=True)
        for n in (1, 2, 3):
            s = upto[-n:]
            if len(upto) - len(before) >= n and s.strip() and s not in before:
                return i, s
    raise AssertionError(f"no stop string in {toks}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_a_stop_string_found_a_step_late_is_undone(device: str):
    """Rows with ``stop`` strings run ahead: the host finds the stop after the next step has moved the row's state,
    and that step is undone (``StepUndo``), so the reply, the state the session is left in and what it generates
    next are those of a run without decode ahead. Beside it, a row whose stop string never comes and one without.
    On CUDA, with the engine's graphs."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    async def engine(ahead: bool) -> ks.Engine:
        if device == "cpu":
            return await engine_on_cpu(ahead)
        eng = await ks.Engine.open(store="memory:", device="cuda", page_size=16, decode_ahead=ahead)
        assert eng.runner.graphs is not None and eng.runner.graphs.use_graphs
        return eng

    async with await engine(False) as eng:
        s = await eng.create_session()
        await s.append(prompt(0))
        toks = (await s.generate(max_tokens=16, ignore_eos=True)).token_ids
        at, stop = stop_string_at(eng.runner.tokenizer, toks)
    runs = []
    for ahead in (False, True):
        eng = await engine(ahead)
        async with eng:
            ss = [await eng.create_session() for _ in range(3)]
            for i, x in enumerate(ss):
                await x.append(prompt(i))
            first = await together(ss, max_tokens=[16, 14, 10], ignore_eos=[True] * 3,
                                   stop=[[stop], ["\x00never"], None], logprobs=[True] * 3)
            states = [(eng.sessions[x.id].num_cached, len(eng.sessions[x.id].tokens)) for x in ss]
            then = await together(ss, max_tokens=[6] * 3, ignore_eos=[True] * 3)
            runs.append(([r.token_ids for r in first], [r.finish_reason for r in first], [r.text for r in first],
                         [r.logprobs for r in first], states, [r.token_ids for r in then], eng.runner.steps_ahead,
                         eng.runner.rows_undone))
    off, on = runs
    assert on[6] >= 10 and off[6] == 0 and on[7] == 1
    assert on[1] == off[1] == ["stop", "length", "length"]
    assert on[0] == off[0] and on[0][0] == toks[: at + 1] and stop not in on[2][0]
    for a, b in zip(on[3], off[3]):  # the undone step ran the stopped row beside the others: another batch size
        assert a == pytest.approx(b, abs=1e-5)
    assert on[4] == off[4] and all(c == n - 1 for c, n in on[4])  # the last token pending, as always
    assert on[5] == off[5]  # each session was left where it is without decode ahead


async def test_without_room_for_the_undo_state_stop_string_rows_decode_step_by_step(monkeypatch):
    async with await engine(False) as ref:
        r = await ref.create_session()
        await r.append(prompt(1))
        want = (await r.generate(max_tokens=10, ignore_eos=True, stop=["\x00never"])).token_ids
    async with await engine(True) as eng:
        def no_room(*a: object, **k: object) -> None:
            raise torch.OutOfMemoryError("no room")

        monkeypatch.setattr(eng.runner.undo, "_allocate", no_room)
        s = await eng.create_session()
        await s.append(prompt(1))
        got = await s.generate(max_tokens=10, ignore_eos=True, stop=["\x00never"])
        assert got.token_ids == want and eng.runner.steps_ahead == 0
        plain = await s.generate(max_tokens=10, ignore_eos=True)  # rows without stop strings still run ahead
        assert len(plain.token_ids) == 10 and eng.runner.steps_ahead > 0


@pytest.mark.parametrize("stacked", [True, False])
def test_the_undo_state_puts_a_slot_back(stacked: bool):
    """Both layouts of the pools: every layer in one tensor (the engine's) and a tensor per layer."""
    from kda_sessions.engine.undo import StepUndo
    from kda_sessions.model import StatePools

    g = torch.Generator().manual_seed(0)
    kda, conv = torch.randn(2, 5, 2, 3, 3, generator=g), torch.randn(2, 5, 2, 4, generator=g).bfloat16()
    if stacked:
        pools = StatePools(kda=list(kda.unbind(0)), conv=list(conv.unbind(0)), kv=[], page_size=4, kda_layers=kda,
                           conv_layers=conv)
    else:
        pools = StatePools(kda=[t.clone() for t in kda], conv=[t.clone() for t in conv], kv=[], page_size=4)
    before = [t.clone() for t in pools.kda + pools.conv]
    undo = StepUndo(pools)
    assert (undo.stacked is not None) == stacked
    assert undo.reserve(3) and undo.rows == 4 and undo.bytes_per_row == 2 * (18 * 4 + 8 * 2)
    undo.save([4, 1])
    for t in pools.kda + pools.conv:
        t.add_(1)
    undo.restore(1, 1)  # slot 1 from row 1; slot 4 (row 0) stays moved
    for t, b in zip(pools.kda + pools.conv, before):
        assert torch.equal(t[1], b[1]) and torch.equal(t[4], b[4] + 1) and torch.equal(t[0], b[0] + 1)
    assert undo.reserve(2) and undo.rows == 4  # no smaller buffer
    none = StepUndo(StatePools(kda=[], conv=[], kv=[], page_size=4))  # a model without KDA layers: nothing to keep
    assert none.reserve(3) and none.bytes_per_row == 0
    none.save([0, 1])
    none.restore(0, 1)


async def test_seeded_sampling_is_the_same_ahead():
    outs = []
    for ahead in (False, True):
        async with await engine(ahead) as eng:
            s1, s2 = await eng.create_session(), await eng.create_session()
            await s1.append(prompt(2))
            await s2.append(prompt(3))
            r = await together([s1, s2], max_tokens=[10, 14], temperature=[0.9, 1.2], seed=[5, 6],
                               top_k=[40, 0], top_p=[1.0, 0.9], ignore_eos=[True, True])
            outs.append(([x.token_ids for x in r], eng.runner.steps_ahead))
    assert outs[1][1] > 0 and outs[0][0] == outs[1][0]


async def test_a_request_arriving_mid_run_stops_the_queueing_and_both_complete():
    async with await engine(True) as eng:
        a, b = await eng.create_session(), await eng.create_session()
        await a.append(prompt(4))
        got: list = [None, None]

        async def long() -> None:
            got[0] = await a.generate(max_tokens=40, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            while eng.runner.steps_ahead < 3:
                await anyio.sleep(0.005)
            await b.append(prompt(5))  # a prefill: the queued steps end, the plan takes it, then they go on
            got[1] = await b.generate(max_tokens=5, ignore_eos=True)
        assert len(got[0].token_ids) == 40 and len(got[1].token_ids) == 5
        ahead = eng.runner.steps_ahead
        assert ahead >= 10
        # a's session ended with its last token pending, as always
        sa = eng.sessions[a.id]
        assert sa.num_cached == len(sa.tokens) - 1
    async with await engine(False) as ref:
        r = await ref.create_session()
        await r.append(prompt(4))
        alone = await r.generate(max_tokens=40, ignore_eos=True)
    assert got[0].token_ids == alone.token_ids


def test_which_rows_run_ahead():
    def work(**kw: object) -> Work:
        return Work(session=Sequence("s"), prompt=[], params=SamplingParams(**kw))  # type: ignore[arg-type]

    assert runs_ahead(work(max_tokens=4))
    assert runs_ahead(work(max_tokens=4, logprobs=True, temperature=0.7))
    assert runs_ahead(work(max_tokens=4, stop=["x"]))  # the step after the stop is undone (StepUndo)
    assert runs_ahead(work(max_tokens=4, logprobs=True, top_logprobs=2))  # drawn with the token, on the device
    constrained = work(max_tokens=4)
    constrained.constraint = object()  # type: ignore[assignment]
    assert not runs_ahead(constrained)  # its masks follow the tokens the host reads


async def test_top_logprobs_are_the_same_ahead():
    """Top logprobs come with the draw, so their rows run ahead; the same tokens and lists as without."""
    outs = []
    for ahead in (False, True):
        async with await engine(ahead) as eng:
            ss = [await eng.create_session() for _ in range(3)]
            for i, x in enumerate(ss):
                await x.append(prompt(i + 2))
            r = await together(ss, max_tokens=[9, 12, 7], ignore_eos=[True] * 3, logprobs=[True] * 3,
                               top_logprobs=[3, 0, 5], temperature=[0.0, 0.8, 0.8], seed=[None, 1, 2])
            outs.append(([x.token_ids for x in r], [x.top_logprobs for x in r], eng.runner.steps_ahead))
    (t0, top0, a0), (t1, top1, a1) = outs
    assert a0 == 0 and a1 >= 8 and t0 == t1
    assert top1[1] is None or all(not t for t in top1[1])
    for want, got, k in zip(top0, top1, [3, 0, 5]):
        if not k:
            continue
        assert len(got) == len(want) and all(len(g) == k for g in got)
        for g, w in zip(got, want):
            assert [t.token_id for t in g] == [t.token_id for t in w]
            assert [t.logprob for t in g] == pytest.approx([t.logprob for t in w], abs=1e-5)


@pytest.mark.gpu
async def test_decode_ahead_on_cuda_gives_the_same_tokens_and_states():
    """Graph replays, pinned copies and events as they run on a GPU: a stop token, rows leaving by length, seeded
    sampling and logprobs, then a continuation of every session; the same with and without decode ahead."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    base = prompt(0)
    runs = []
    stop = None
    for ahead in (False, True):
        async with await ks.Engine.open(store="memory:", device="cuda", page_size=16, decode_ahead=ahead) as eng:
            assert eng.runner.graphs is not None and eng.runner.graphs.use_graphs
            if stop is None:  # a token the greedy row yields at its 5th token and not before
                s = await eng.create_session()
                await s.append(base)
                toks = (await s.generate(max_tokens=12, ignore_eos=True)).token_ids
                at = next(i for i in range(4, 12) if toks[i] not in toks[:i])
                stop = toks[at]
            eng.runner.tokenizer.eos_ids = {stop}
            sessions = []
            for i in range(4):
                s = await eng.create_session()
                await s.append(prompt(i) if i else base)
                sessions.append(s)
            first = await together(sessions, max_tokens=[12, 5, 17, 9], ignore_eos=[False, True, True, True],
                                   temperature=[0.0, 0.0, 0.8, 0.0], seed=[None, None, 3, None],
                                   logprobs=[False, True, False, True])
            then = await together(sessions, max_tokens=[6] * 4, ignore_eos=[True] * 4)
            runs.append(([r.token_ids for r in first], [r.finish_reason for r in first],
                         [r.logprobs for r in first], [r.token_ids for r in then], eng.runner.steps_ahead))
    (t0, f0, l0, n0, a0), (t1, f1, l1, n1, a1) = runs
    assert a0 == 0 and a1 >= 10
    assert f0 == f1 and f1[0] == "stop"
    assert t0 == t1 and n0 == n1
    for x, y in zip(l0, l1):
        assert (x is None and y is None) or x == pytest.approx(y, abs=1e-5)


async def test_a_queued_step_that_fails_to_launch_is_retried_row_by_row(caplog):
    """As a failed decode step of several rows: each row is rolled back and run again alone, and goes on."""
    async with await engine(False) as ref:
        rs = [await ref.create_session() for _ in range(2)]
        for i, r in enumerate(rs):
            await r.append(prompt(6 + i))
        want = [x.token_ids for x in await together(rs, max_tokens=[12, 12], ignore_eos=[True, True])]
    async with await engine(True) as eng:
        graphs = eng.runner.graphs
        assert graphs is not None
        run, fed = graphs.run, []

        def flaky(*args, **kw):
            if len(args) > 4 and args[4] is not None:
                fed.append(1)
                if len(fed) == 3:
                    raise RuntimeError("launch failed")
            return run(*args, **kw)

        graphs.run = flaky  # type: ignore[method-assign]
        ss = [await eng.create_session() for _ in range(2)]
        for i, s in enumerate(ss):
            await s.append(prompt(6 + i))
        got = await together(ss, max_tokens=[12, 12], ignore_eos=[True, True])
        more = await together(ss, max_tokens=[4, 4], ignore_eos=[True, True])
    assert "launch failed" in caplog.text and len(fed) > 3
    assert [x.token_ids for x in got] == want and [x.finish_reason for x in got] == ["length"] * 2
    assert [len(x.token_ids) for x in more] == [4, 4]


async def test_a_row_without_a_distribution_fails_alone_while_its_next_step_is_queued():
    """Nan logits in one sampled row, with the step after it already queued: the sampler draws -1 there (it never
    waits for the device to check), the feed runs the row as a dummy, its request fails with NoDistribution and its
    state stays a fresh prefill's; the other row's tokens are those it draws without the fault."""
    from engine.isolation_helpers import assert_equals_fresh_prefill
    from kda_sessions.engine.sampler import NoDistribution

    kw = dict(max_tokens=[12, 12], ignore_eos=[True, True], temperature=[0.8, 0.8], seed=[4, 5])
    async with await engine(True) as ref:
        rs = [await ref.create_session() for _ in range(2)]
        for i, r in enumerate(rs):
            await r.append(prompt(8 + i))
        want = (await together(rs, **kw))[0].token_ids
    async with await engine(True) as eng:
        graphs = eng.runner.graphs
        assert graphs is not None
        run, fed = graphs.run, []

        def poisoned(*args, **kw):  # type: ignore[no-untyped-def]
            logits = run(*args, **kw)
            if len(args) > 4 and args[4] is not None and len(args[0]) == 2:
                fed.append(1)
                if len(fed) == 3:
                    with torch.inference_mode():
                        logits[1] = float("nan")
            return logits

        graphs.run = poisoned  # type: ignore[method-assign]
        ss = [await eng.create_session() for _ in range(2)]
        for i, s in enumerate(ss):
            await s.append(prompt(8 + i))
        ahead = eng.runner.steps_ahead
        got: list = [None, None]

        async def go(i: int) -> None:
            try:
                got[i] = await ss[i].generate(**{k: v[i] for k, v in kw.items()})
            except Exception as e:
                got[i] = e

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(go, i)
        assert eng.runner.steps_ahead - ahead >= 5 and len(fed) > 3
        assert got[0].token_ids == want, got
        assert isinstance(got[1], Exception) and "no distribution" in str(got[1]), got[1]
        assert isinstance(got[1], NoDistribution) or isinstance(got[1].__cause__, NoDistribution)
        await assert_equals_fresh_prefill(eng, ss[1])
        again = await ss[1].generate(max_tokens=3, ignore_eos=True)
        assert len(again.token_ids) == 3


@pytest.mark.parametrize("trials", [pytest.param(4, id="short"), pytest.param(60, id="long", marks=pytest.mark.slow)])
async def test_random_stop_strings_and_settings_give_the_same_replies_and_states_ahead(trials: int):
    """Random batches of requests with stop strings (some found in the reply, some never), greedy or seeded
    sampling, stop tokens, top logprobs: with decode ahead and without, the same tokens, texts, finish reasons and
    logprobs, sessions left with their last token pending, and the same continuation after."""
    import random

    rng = random.Random(11)
    async with await engine(False) as off, await engine(True) as on:
        tok = off.runner.tokenizer
        for _ in range(trials):
            n = rng.randint(1, 4)
            kws: dict[str, list] = {"max_tokens": [], "stop": [], "temperature": [], "seed": [], "ignore_eos": [],
                                    "logprobs": [], "top_logprobs": []}
            prompts = [[rng.randrange(250) for _ in range(rng.randint(5, 40))] for _ in range(n)]
            probe = []
            for p in prompts:  # each row's greedy reply, to draw stop strings from
                s = await off.create_session()
                await s.append(p)
                probe.append(tok.decode((await s.generate(max_tokens=14, ignore_eos=True)).token_ids,
                                        skip_special=True))
            for i in range(n):
                text = probe[i]
                at = rng.randrange(max(1, len(text)))
                kws["stop"].append(rng.choice([None, ["\x00never"], [text[at : at + rng.randint(1, 3)] or "x"],
                                               ["\x00never", text[at:][:2] or "y"]]))
                kws["max_tokens"].append(rng.randint(1, 14))
                greedy = rng.random() < 0.5
                kws["temperature"].append(0.0 if greedy else rng.choice([0.7, 1.0]))
                kws["seed"].append(None if greedy else rng.randrange(1000))
                kws["ignore_eos"].append(rng.random() < 0.7)
                kws["logprobs"].append(rng.random() < 0.5)
                kws["top_logprobs"].append(rng.choice([0, 0, 2]) if kws["logprobs"][-1] else 0)
            runs = []
            for eng in (off, on):
                ss = []
                for p in prompts:
                    s = await eng.create_session()
                    await s.append(p)
                    ss.append(s)
                first = await together(ss, **kws)
                states = [(eng.sessions[x.id].num_cached, len(eng.sessions[x.id].tokens)) for x in ss]
                then = await together(ss, max_tokens=[3] * n, ignore_eos=[True] * n)
                runs.append(([r.token_ids for r in first], [r.text for r in first], [r.finish_reason for r in first],
                             [r.logprobs for r in first],
                             [[[t.token_id for t in pos] for pos in r.top_logprobs or []] for r in first],
                             states, [r.token_ids for r in then]))
            (t0, x0, f0, l0, k0, s0, n0), (t1, x1, f1, l1, k1, s1, n1) = runs
            assert (t1, x1, f1, k1, s1, n1) == (t0, x0, f0, k0, s0, n0), kws
            assert all(c == m - 1 for c, m in s1)
            for a, b in zip(l1, l0):  # rows run beside others ahead: other batch sizes, other last bits
                assert (a is None and b is None) or a == pytest.approx(b, abs=1e-5)
        assert on.runner.steps_ahead > 0 and on.runner.rows_undone > 0
