"""Random sequences of session operations (append, generate alone and batched, a cancelled generate, checkpoint,
fork, save, resume, delete) on an engine with few state slots, so sessions are evicted to the store and resumed
all the time. After every few operations, and for every session at the end, the invariant every operation must
keep: a session's state is its own tokens' state. Checked as the next token's top-5 log-probabilities of the
session against a fresh prefill of the same tokens on a reference engine (1e-3; the argmax the same unless the
two best are within 1e-3 of each other). The default suite runs a short campaign per store and with decode ahead
(``EngineConfig.decode_ahead``, wired on the CPU as tests/engine/test_decode_ahead.py does); ``-m slow`` a long
one."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio

import kda_sessions as ks
from kda_sessions.model.graphs import DecodeGraphs

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref() -> AsyncIterator[ks.Engine]:
    """Fresh prefills: each check makes a session, appends the tokens, reads the next token, deletes it."""
    async with await ks.Engine.open(store="memory:", page_size=16, checkpoint_interval_pages=0) as eng:
        yield eng


async def next_token(s: ks.Session) -> dict[int, float]:
    r = await s.generate(max_tokens=1, logprobs=True, top_logprobs=5, ignore_eos=True)
    assert r.top_logprobs is not None
    return {t.token_id: t.logprob for t in r.top_logprobs[0]}


async def check(s: ks.Session, ref: ks.Engine, what: str) -> None:
    tokens = list(s.state.tokens)
    got = await next_token(s)
    r = await ref.create_session()
    await r.append(tokens)
    want = await next_token(r)
    await ref.delete_session(r.id)
    best, second = sorted(want.values(), reverse=True)[:2]
    top_got, top_want = max(got, key=got.__getitem__), max(want, key=want.__getitem__)
    assert top_got == top_want or best - second < 1e-3, f"{what}: next token {top_got} != {top_want} ({len(tokens)})"
    for tok in set(got) & set(want):
        assert abs(got[tok] - want[tok]) < 1e-3, f"{what}: logprob of {tok} {got[tok]} != {want[tok]}"
    assert len(set(got) & set(want)) >= 3, f"{what}: top tokens {sorted(got)} against {sorted(want)}"


OPS = ("new", "append", "generate", "batch", "batch", "cancel", "checkpoint", "fork", "save", "resume", "delete", "check",
       "chat", "send")
"""The operations a campaign draws from (batch twice: the decode steps of several sessions are where most can go
wrong). ``chat`` starts a conversation on one of three system prompts (conversations that share one reuse its
checkpointed head: the prefix cache), ``send`` adds a user turn to one. ``interrupt`` (not in OPS: see
``WITH_INTERRUPTS``) cancels an append, fork, checkpoint, user turn or save at a random moment."""

WITH_INTERRUPTS = (*OPS, "interrupt", "interrupt")
"""OPS with interrupted operations. Not run by the suite: an interrupt splits a prefill where a fresh prefill makes
one call, and on some machines the rounding that moves flips a router's near-tie (seed 611 of 300 operations
seats sessions on a checkpoint whose last KDA layer's state moved 4e-2 so), which the check against a fresh
prefill cannot tell from a lost token. tests/model/test_prefill_split.py asserts what does hold across splits."""

SYSTEMS = ("You are a coding agent.", "You review diffs and answer briefly.", "Plan first, then act.")


async def campaign(seed: int, ops: int, store: str, ahead: bool, ref: ks.Engine,
                   op_names: tuple[str, ...] = OPS, after: Any = None) -> dict[str, int]:
    """``after(eng, sessions, i, op)``, awaited after every operation: a hook for hunting a failure down."""
    rng = random.Random(seed)
    done: dict[str, int] = {}
    async with await ks.Engine.open(store=store, page_size=16, max_active_sessions=3,
                                    max_checkpoints_in_memory=2, checkpoint_interval_pages=2) as eng:
        if ahead:
            r = eng.runner
            r.graphs = DecodeGraphs(r.model, r.pools.tensors, enabled=False, capture_lock=r.pools.mutex)
            r.decode_ahead = True
        sessions: list[ks.Session] = []
        named: list[tuple[ks.Session, str]] = []

        def ids(n: int) -> list[int]:
            return [rng.randrange(256) for _ in range(n)]

        async def new() -> None:
            s = await eng.create_session()
            await s.append(ids(rng.randint(3, 60)))
            sessions.append(s)

        for _ in range(4):  # one more than the slots: from the start, a session moves out for another
            await new()

        chats: list[ks.Session] = []

        async def one(i: int, op: str) -> None:
            nonlocal named, chats
            if op == "new" or not sessions:
                await new()
            elif op == "chat" or (op == "send" and not chats):
                c = await eng.create_session(system=rng.choice(SYSTEMS))
                await c.send(f"task {rng.randrange(5)}", max_tokens=rng.randint(1, 8))
                sessions.append(c)
                chats.append(c)
            elif op == "send":
                await rng.choice(chats).send(f"more {rng.randrange(99)}", max_tokens=rng.randint(1, 8))
            elif op == "append":
                await rng.choice(sessions).append(ids(rng.randint(1, 40)))
            elif op == "generate":
                await rng.choice(sessions).generate(max_tokens=rng.randint(1, 12), ignore_eos=True)
            elif op == "batch":  # several sessions decoding in the same steps, leaving at different lengths
                some = rng.sample(sessions, min(len(sessions), rng.randint(2, 4)))
                async with anyio.create_task_group() as tg:
                    for s in some:
                        tg.start_soon(lambda s=s: s.generate(max_tokens=rng.randint(1, 16), ignore_eos=True))
            elif op == "cancel":  # a generate cancelled after a few steps: what it generated stays
                s = rng.choice(sessions)
                with anyio.move_on_after(rng.uniform(0.0, 0.03)):
                    await s.generate(max_tokens=200, ignore_eos=True)
            elif op == "checkpoint":
                s = rng.choice(sessions)
                name = f"c{i}"
                await s.checkpoint(name)
                named.append((s, name))
            elif op == "fork":
                if named and rng.random() < 0.6:
                    parent, name = rng.choice(named)
                    sessions.append(await eng.fork(parent.id, name))
                else:
                    sessions.append(await rng.choice(sessions).fork())
            elif op == "save":
                await rng.choice(sessions).save()
            elif op == "resume":
                s = rng.choice(sessions)
                r = await eng.resume(s.id)
                sessions[sessions.index(s)] = r
                chats = [r if c.id == r.id else c for c in chats]
            elif op == "delete" and len(sessions) > 2:
                s = rng.choice(sessions)
                await eng.delete_session(s.id)
                sessions.remove(s)
                named = [(p, n) for p, n in named if p.id != s.id]
                chats = [c for c in chats if c.id != s.id]
            elif op == "interrupt":
                what = rng.choice(["append", "fork", "checkpoint", "send", "save"])
                what = "append" if what == "send" and not chats else what
                s = rng.choice(chats if what == "send" else sessions)
                with anyio.move_on_after(rng.uniform(0.0, 0.02)):
                    if what == "append":
                        await s.append(ids(rng.randint(1, 80)))
                    elif what == "fork":
                        sessions.append(await s.fork())
                    elif what == "checkpoint":
                        await s.checkpoint(f"c{i}")
                        named.append((s, f"c{i}"))
                    elif what == "send":
                        await s.send(f"more {rng.randrange(99)}", max_tokens=rng.randint(1, 8))
                    else:
                        await s.save()
            elif op == "check":
                s = rng.choice(sessions)
                await check(s, ref, f"seed {seed} op {i} session {s.id}")

        history: list[str] = []
        for i in range(ops):
            op = rng.choice(op_names)
            history.append(f"{i}:{op}")
            try:
                await one(i, op)
            except Exception as e:
                raise AssertionError(f"seed {seed}, op {i} ({op}) failed; ops before: {history[-16:]}") from e
            done[op] = done.get(op, 0) + 1
            if after is not None:
                await after(eng, sessions, i, op)
        for s in sessions:
            await check(s, ref, f"seed {seed} end, session {s.id}")
        done["sessions"] = len(sessions)
        done["steps_ahead"] = eng.runner.steps_ahead
        done["evictions"] = eng.stats()["evictions"]
        done["prefix_hits"] = eng.stats()["prefix_cache_hits"]
    return done


@pytest.mark.parametrize("store,ahead", [("disk", False), ("disk", True), ("memory", True)],
                         ids=["disk", "disk-ahead", "memory-ahead"])
async def test_sessions_keep_their_state_under_random_operations(ref, tmp_path, store, ahead):
    url = f"disk:{tmp_path / 'store'}" if store == "disk" else "memory:"
    done = await campaign(11 if ahead else 7, 36, url, ahead, ref)
    assert sum(v for k, v in done.items() if k not in ("sessions", "steps_ahead", "evictions", "prefix_hits")) == 36
    assert done["evictions"] > 0 and done["sessions"] > 3  # sessions moved out and back in
    if ahead:
        assert done["steps_ahead"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("store", ["disk", "redis"])
async def test_long_random_session_campaign(ref, tmp_path, request, store, seed):
    url = f"disk:{tmp_path / 'store'}" if store == "disk" else (
        request.getfixturevalue("redis_url") + f"?prefix=fz{seed}{tmp_path.name[-8:]}:")
    await campaign(100 + seed, 200, url, seed % 2 == 1, ref)
