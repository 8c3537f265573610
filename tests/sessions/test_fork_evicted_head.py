"""A session the engine evicted to the store to free its slot can still be forked at its head (the fork loads
the head back instead of failing on the missing slot)."""

from __future__ import annotations

import kda_sessions as ks


async def test_fork_at_the_head_of_an_evicted_session():
    async with await ks.Engine.open(model="tiny-random", store="memory:", max_active_sessions=2, page_size=16) as eng:
        a = await eng.create_session(system="first")
        await a.send("hello", max_tokens=3, temperature=0.0)
        for text in ("second", "third"):  # two slots: a, the least recently used, is evicted to the store
            other = await eng.create_session(system=text)
            await other.send("push a out", max_tokens=2)
        assert not a.state.resident
        child = await eng.fork(a.id)
        assert child.num_tokens == a.num_tokens
        ref = await eng.fork(a.id)  # the parent is resident again now: a second fork agrees with the first
        r1 = await child.send("next", max_tokens=4, temperature=0.0)
        r2 = await ref.send("next", max_tokens=4, temperature=0.0)
        assert r1.token_ids == r2.token_ids
