"""Interval checkpoints inside long messages: a resent long message reuses all of it up to its last interval
boundary (also after a restart, through the store), never across tenants, with outputs equal to a run without
reuse; the host memory of checkpoint states stays within its bound and keeps the prefixes that were hit."""

from __future__ import annotations

import kda_sessions as ks
from kda_sessions.server.session_routes import session_info

SYSTEM = "You are a careful coding agent. "
LONG = "".join(f"line {i}: def f{i}(x): return x * {i} + {i * i}\n" for i in range(22))  # ~800 byte tokens
EDITED = LONG[:-60] + "# the tail of this tool output differs from the first one\n"
OPTIONS = {"page_size": 16, "checkpoint_interval_pages": 4}  # a checkpoint every 64 tokens
STEP = 64


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _last_boundary(common: int) -> int:
    """The last interval boundary B whose checkpoint's prefix (B + 1 tokens) the two prompts share."""
    return (common - 1) // STEP * STEP


async def _reference(text: str) -> list[int]:
    async with await ks.Engine.open(store="memory:", **OPTIONS) as ref:
        return (await (await ref.create_session(system=SYSTEM)).send(text, max_tokens=6, ignore_eos=True)).token_ids


async def test_a_resent_long_message_reuses_up_to_its_last_interval_boundary():
    want_edited, want_long = await _reference(EDITED), await _reference(LONG)
    async with await ks.Engine.open(store="memory:", **OPTIONS) as eng:
        a = await eng.create_session(system=SYSTEM)
        await a.send(LONG, max_tokens=6, ignore_eos=True)
        assert sum(n.startswith("__at-") for n in a.state.checkpoints) >= 10
        listed = session_info(a).checkpoints  # what GET /v1/sessions/{id} shows: the engine's own are not listed
        assert "msg-1" in listed and not any(n.startswith("__") for n in listed)
        b = await eng.create_session(system=SYSTEM)
        got = await b.send(EDITED, max_tokens=6, ignore_eos=True)
        assert got.usage.cached_tokens == _last_boundary(_common(a.state.tokens, b.state.tokens))
        assert got.token_ids == want_edited  # bit for bit on the CPU
        # the same message again (a retry): reused up to the checkpoint at the message's end
        c = await eng.create_session(system=SYSTEM)
        again = await c.send(LONG, max_tokens=6, ignore_eos=True)
        assert again.usage.cached_tokens == a.state.checkpoints["msg-1"].state_pos
        assert again.token_ids == want_long
        other = await (await eng.for_tenant("other")).create_session(system=SYSTEM)
        r = await other.send(EDITED, max_tokens=6, ignore_eos=True)
        assert r.usage.cached_tokens == 0 and r.token_ids == want_edited


async def test_a_restarted_engine_finds_saved_interval_checkpoints(tmp_path):
    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store, **OPTIONS) as eng:
        a = await eng.create_session(system=SYSTEM)
        await a.send(LONG, max_tokens=6, ignore_eos=True)
        await a.save()
        tokens = list(a.state.tokens)
    async with await ks.Engine.open(store=store, **OPTIONS) as eng:
        b = await eng.create_session(system=SYSTEM)
        got = await b.send(EDITED, max_tokens=6, ignore_eos=True)
        assert got.usage.cached_tokens == _last_boundary(_common(tokens, b.state.tokens))
        assert got.token_ids == await _reference(EDITED)
        other = await (await eng.for_tenant("other")).create_session(system=SYSTEM)
        assert (await other.send(EDITED, max_tokens=6, ignore_eos=True)).usage.cached_tokens == 0


async def test_checkpoint_memory_is_bounded_and_keeps_what_was_hit():
    async with await ks.Engine.open(store="memory:", **OPTIONS) as eng:
        cache = eng.manager.prefix_cache
        eng.manager.config.checkpoint_memory_bytes = 20 * cache.state_bytes
        a = await eng.create_session(system=SYSTEM)
        await a.send(LONG, max_tokens=4, ignore_eos=True)
        b = await eng.create_session(system=SYSTEM)
        got = await b.send(EDITED, max_tokens=4, ignore_eos=True)
        hit = f"__at-{got.usage.cached_tokens}"
        assert a.state.checkpoints[hit].resident
        for i in range(6):  # other agents' long tool outputs
            s = await eng.create_session(system=SYSTEM)
            await s.send(f"agent {i}\n" + LONG.replace("line", f"row{i}"), max_tokens=4, ignore_eos=True)
            assert len(eng.manager.core.pools.host) <= 20
            if i == 0:  # the prefix that was hit outlives those captured before it that were not
                assert a.state.checkpoints[hit].resident and "__at-64" not in a.state.checkpoints
                assert eng.prefix_index.longest(a.state.tokens[:66]).checkpoint != "__at-64"
        assert a.state.checkpoints["msg-0"].resident  # the shared head is pinned


async def test_a_trimmed_unsaved_checkpoint_leaves_the_index():
    async with await ks.Engine.open(store="memory:", max_checkpoints_in_memory=1, **OPTIONS) as eng:
        s = await eng.create_session(system=SYSTEM)
        for word in ("one", "two", "three"):
            await s.send(word, max_tokens=2, ignore_eos=True)
        kept = {n for n in s.state.checkpoints if n.startswith("msg-")}
        assert kept == {"msg-0", "msg-6"}  # the newest, and the head (system prompt), which others start from
        index = eng.prefix_index
        assert all(index.key_of(s.id, f"msg-{i}", 1) is None for i in range(1, 6))
        assert {h.checkpoint for h in index.matches(s.state.tokens)} <= set(s.state.checkpoints)


async def test_a_forgotten_unsaved_session_leaves_no_prefix_behind():
    """Its checkpoints are gone with it: a later session with the same message takes every interval checkpoint
    again (none skipped as if still held), and one forgotten after a save keeps its stored prefixes findable."""
    async with await ks.Engine.open(store="memory:", **OPTIONS) as eng:
        t = await eng.for_tenant("t")
        a = await t.create_session(system=SYSTEM)
        await a.send(LONG, max_tokens=4, ignore_eos=True)
        taken = sorted(n for n in a.state.checkpoints if n.startswith("__at-"))
        assert len(taken) >= 10
        assert await t.forget(a.id)
        assert eng.manager.stats()["prefix_index_entries"] == 0
        b = await t.create_session(system=SYSTEM)
        got = await b.send(LONG, max_tokens=4, ignore_eos=True)
        assert got.usage.cached_tokens == 0
        assert sorted(n for n in b.state.checkpoints if n.startswith("__at-")) == taken
        await b.save()
        held = eng.manager.stats()["prefix_index_entries"]
        assert await t.forget(b.id)
        assert eng.manager.stats()["prefix_index_entries"] == held
        c = await t.create_session(system=SYSTEM)
        again = await c.send(LONG, max_tokens=4, ignore_eos=True)
        assert again.usage.cached_tokens > 0
