"""The session manager owns session state: per-tenant registries, checkpoint states in the host pool (freed with
their sessions), forks from a head by a slot copy on the device."""

from __future__ import annotations

import pytest

import kda_sessions as ks


async def test_checkpoint_states_live_in_the_host_pool_and_leave_with_their_session():
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        pages_total = eng.stats()["pages_free"]
        s = await eng.create_session(system="sys")
        await s.send("one", max_tokens=3)
        await s.checkpoint("mine")
        resident = [c for c in s.state.checkpoints.values() if c.resident]
        assert {"msg-1", "msg-2", "mine"} <= {c.name for c in resident}
        assert eng.stats()["checkpoint_states_in_memory"] == len(resident)
        child = await s.fork()  # from the head: no host state, a slot copy
        assert eng.stats()["checkpoint_states_in_memory"] == len(resident)
        assert child.state.pages[: len(child.state.pages) - 1] == s.state.pages[: len(child.state.pages) - 1]
        r1 = await s.generate(max_tokens=4)
        r2 = await child.generate(max_tokens=4)
        assert r1.token_ids == r2.token_ids and r2.usage.prefill_tokens == 1
        await eng.delete_session(s.id)
        await eng.delete_session(child.id)
        stats = eng.stats()
        assert stats["checkpoint_states_in_memory"] == 0 and stats["pages_free"] == pages_total


async def test_tenants_have_their_own_ids_and_prefixes():
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        a, b = await eng.for_tenant("a"), await eng.for_tenant("b")
        s = await a.create_session(system="shared system prompt", session_id="s_same")
        await s.send("hi", max_tokens=2)
        with pytest.raises(ks.SessionNotFound):
            await b.resume("s_same")
        t = await b.create_session(system="shared system prompt", session_id="s_same")  # the id is free in b
        assert t.state is not s.state and eng.manager.get("b", "s_same") is t.state
        assert t.state.parent is None  # a's prefix is not b's to reuse
        again = await a.create_session(system="shared system prompt")
        assert again.state.parent == "s_same" and again.state.num_cached > 0
        with pytest.raises(ValueError, match="already exists"):
            await a.create_session(session_id="s_same")
