"""An agent's turns through ``Engine`` with short prefill steps run by ``PrefillGraphs`` (replayed CUDA graphs on
a GPU; on the CPU its static-buffer step run eagerly) against the eager prefill step: the same greedy tokens, logprobs
within float tolerance, and the padded step used for the short appends only."""

from __future__ import annotations

import anyio
import pytest
import torch

import kda_sessions as ks
from kda_sessions.model.prefill_graphs import PrefillGraphs

from .test_decode_ahead import prompt, together


def padded_or_not(eng: ks.Engine, device: str, graphs: bool):  # type: ignore[no-untyped-def]
    """The engine's runner with ``PrefillGraphs`` (on the CPU its static-buffer step, eagerly) or without any."""
    r = eng.runner
    if device == "cpu" and graphs:
        r.prefill_graphs = PrefillGraphs(r.model, r.pools.tensors, enabled=False, capture_lock=r.pools.mutex)
    if not graphs:
        r.prefill_graphs = None
    return r


async def turns(device: str, graphs: bool) -> dict:
    """Two sessions: a 40-token prompt (prefilled from nothing: eager), a reply, then two tool outputs of 9 and 23
    tokens each (short appends after a cached context: the padded step), a reply after each."""
    async with await ks.Engine.open(store="memory:", device=device, page_size=16) as eng:
        r = padded_or_not(eng, device, graphs)
        ss = [await eng.create_session() for _ in range(2)]
        for i, s in enumerate(ss):
            await s.append(prompt(i, 40))
        replies = [await together(ss, max_tokens=[4, 4], ignore_eos=[True] * 2, logprobs=[True] * 2)]
        for n in (9, 23):
            for i, s in enumerate(ss):
                await s.append([(7 * j + i + n) % 250 for j in range(n)])
            replies.append(await together(ss, max_tokens=[3, 3], ignore_eos=[True] * 2, logprobs=[True] * 2))
        pg = r.prefill_graphs
        return {"tokens": [[x.token_ids for x in rs] for rs in replies],
                "logprobs": [[x.logprobs for x in rs] for rs in replies],
                "padded_steps": (pg.replays + pg.eager_runs) if pg is not None else 0,
                "replays": pg.replays if pg is not None else 0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_short_appends_run_padded_with_the_same_tokens(device: str):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eager = await turns(device, False)
    padded = await turns(device, True)
    assert padded["padded_steps"] >= 2 and eager["padded_steps"] == 0
    if device == "cuda":
        assert padded["replays"] == padded["padded_steps"]
    assert padded["tokens"] == eager["tokens"]
    tol = 1e-3 if device == "cpu" else 5e-2
    for a, b in zip(padded["logprobs"], eager["logprobs"]):
        for x, y in zip(a, b):
            assert x is not None and y is not None
            assert max(abs(float(u) - float(v)) for u, v in zip(x, y)) < tol


async def chat(device: str, graphs: bool) -> dict:
    """Two chat sessions, two turns each (the second's input after a cached context: short, with its message's end
    a checkpoint inside the chunk), then a fork from that checkpoint generating on."""
    async with await ks.Engine.open(store="memory:", device=device, page_size=16) as eng:
        r = padded_or_not(eng, device, graphs)
        ss = [await eng.create_session() for _ in range(2)]
        first = [await s.send(f"hi {i}", max_tokens=3, ignore_eos=True) for i, s in enumerate(ss)]
        second: list = [None, None]

        async def send(i: int, text: str) -> None:
            second[i] = await ss[i].send(text, max_tokens=4, ignore_eos=True, logprobs=True)

        async with anyio.create_task_group() as tg:  # both turns' inputs in one step
            for i, text in enumerate(["ok", "go on"]):
                tg.start_soon(send, i, text)
        forks = [await s.fork("msg-2") for s in ss]
        again = await together(forks, max_tokens=[4, 4], ignore_eos=[True] * 2)
        pg = r.prefill_graphs
        return {"tokens": [x.token_ids for x in first + second + again],
                "logprobs": [x.logprobs for x in second],
                "padded_steps": (pg.replays + pg.eager_runs) if pg is not None else 0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_a_chat_turns_input_runs_padded_with_its_checkpoint(device: str):
    """The second turn's input holds its message's end (a checkpoint) before the assistant's header: one padded step
    that also returns the state there; a fork from it continues as from the eager step's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eager = await chat(device, False)
    padded = await chat(device, True)
    assert padded["padded_steps"] >= 1 and eager["padded_steps"] == 0
    assert padded["tokens"] == eager["tokens"]
    tol = 1e-3 if device == "cpu" else 5e-2
    for x, y in zip(padded["logprobs"], eager["logprobs"]):
        assert max(abs(float(u) - float(v)) for u, v in zip(x, y)) < tol


async def random_ops(seed: int, graphs: bool) -> tuple[list, int]:
    """A seeded mix of what agents do, one call at a time on two sessions: appends of 1 to 140 tokens (the graphs'
    buckets and past their longest chunk), generates, chat turns, a named checkpoint and a fork from it."""
    import random

    rnd = random.Random(seed)
    out: list = []
    async with await ks.Engine.open(store="memory:", device="cpu", page_size=16) as eng:
        r = padded_or_not(eng, "cpu", graphs)
        ss = [await eng.create_session() for _ in range(2)]
        for i, s in enumerate(ss):
            await s.append(prompt(i, 20))
        for step in range(10):
            i = rnd.randrange(len(ss))
            s, op = ss[i], rnd.choice(["append", "append", "generate", "send", "fork"])
            if op == "append":
                n = rnd.choice([1, 5, 17, 70, 140])
                await s.append([rnd.randrange(250) for _ in range(n)])
            elif op == "generate":
                out.append((step, (await s.generate(max_tokens=rnd.randint(1, 4), ignore_eos=True)).token_ids))
            elif op == "send":
                out.append((step, (await s.send(f"turn {step}", max_tokens=3, ignore_eos=True)).token_ids))
            else:
                await s.checkpoint(f"at-{step}")
                ss.append(await s.fork(f"at-{step}"))
                out.append((step, (await ss[-1].generate(max_tokens=2, ignore_eos=True)).token_ids))
        for s in ss:  # every session's state as the next token shows it
            out.append((-1, (await s.generate(max_tokens=2, ignore_eos=True)).token_ids))
        return out, r.prefill_graphs.eager_runs if r.prefill_graphs is not None else 0


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_agent_calls_give_the_same_tokens_padded(seed: int):
    """Differential: the same seeded calls through an engine whose short prefills run padded (``PrefillGraphs``'
    static-buffer step, on the CPU) and through one that runs them all in ``HybridModel.step``: the same tokens."""
    padded, steps = await random_ops(seed, True)
    eager, none = await random_ops(seed, False)
    assert steps >= 1 and none == 0
    assert padded == eager


async def checkpoints_in_one_chunk(graphs: bool, inside: int) -> list:
    """An 11-token chunk after 40 tokens with checkpoints at its last position and ``inside`` (0-2) inside it, run
    through the runner's prefill; checks what every variant must hold, returns the inside checkpoints' states."""
    from kda_sessions.engine.runner import StepResult
    from kda_sessions.engine.scheduler import Work
    from kda_sessions.engine.sequence import Checkpoint
    from kda_sessions.types import SamplingParams

    async with await ks.Engine.open(store="memory:", device="cpu", page_size=16) as eng:
        r = padded_or_not(eng, "cpu", graphs)
        s = await eng.create_session()
        await s.append(prompt(0, 40))  # the step thread is idle once this returns
        seq = eng.sessions[s.id]
        lo, n = seq.num_cached, 11
        seq.tokens.extend(range(5, 5 + n - 1))
        cps = [Checkpoint(name=f"in-{p}", position=lo + p + 1, state_pos=-1) for p in (4, 8)[:inside]]
        end = Checkpoint(name="end", position=lo + n + 1, state_pos=-1)  # target lo + n: the chunk's end
        w = Work(session=seq, prompt=seq.tokens[lo:], params=SamplingParams(max_tokens=1), prefill_only=True,
                 checkpoints=[*cps, end])
        r._prefill([(w, n)], StepResult())
        assert seq.num_cached == lo + n and end.state_pos == lo + n
        assert [c.state_pos for c in cps] == [lo + 4, lo + 8][:inside]
        for a, b in zip(r.pools.host.get(end.state_id), r.pools.read_slot(seq.slot)):
            assert torch.equal(a, b)
        assert all(seq.checkpoints[c.name] is c for c in [*cps, end])
        padded_steps = r.prefill_graphs.eager_runs if r.prefill_graphs is not None else 0
        assert padded_steps == ((3 if inside == 2 else 1) if graphs else 0)
        return [r.pools.host.get(c.state_id) for c in cps]


@pytest.mark.parametrize("inside", [0, 1, 2], ids=["end", "one-inside", "two-inside"])
async def test_checkpoints_inside_and_at_the_chunks_end_are_captured(inside: int):
    """Checkpoints in one chunk, padded and eager: at its last position (captured from the slot after the step: the
    slot's state), and 0, 1 or 2 inside it. One inside: the replay returns its state (one step); two: the chunk runs
    in three pieces, each captured from the slot after its piece. The inside states equal the eager step's kernels'
    (float tolerance)."""
    padded = await checkpoints_in_one_chunk(True, inside)
    eager = await checkpoints_in_one_chunk(False, inside)
    assert len(padded) == len(eager) == inside
    for (pk, pc), (ek, ec) in zip(padded, eager):
        torch.testing.assert_close(pk, ek, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pc, ec, atol=1e-5, rtol=1e-4)
