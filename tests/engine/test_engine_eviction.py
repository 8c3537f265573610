"""Eviction skips a session it cannot save (another engine holds its write lease) and frees the next one
(issue 24.3)."""

from __future__ import annotations

import kda_sessions as ks

from .isolation_helpers import prompt


async def test_eviction_skips_a_session_leased_elsewhere(tmp_path):
    url = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=url, page_size=16) as other:
        held = await other.create_session(session_id="held-elsewhere")
        await held.append(prompt(1))
        await held.save()  # `other` keeps the write lease while it lives
        async with await ks.Engine.open(store=url, max_active_sessions=2, page_size=16) as eng:
            x = await eng.resume("held-elsewhere")  # reading is allowed; it is the least recently used
            y = await eng.create_session()
            await y.append(prompt(2))
            z = await eng.create_session()  # needs a slot: x cannot be saved, so y moves out
            await z.append(prompt(3))
            assert x.state.resident and not y.state.resident and z.state.resident
            r = await y.generate(max_tokens=3, ignore_eos=True)  # y comes back; z (idle, saveable) moves out
            assert len(r.token_ids) == 3 and x.state.resident and not z.state.resident


async def generate_all(sessions: list) -> list:
    """Each session's 6 greedy tokens, all at once; a request refused for want of a slot gives its OutOfSlots."""
    import anyio

    got: list = [None] * len(sessions)

    async def go(i: int) -> None:
        try:
            got[i] = (await sessions[i].generate(max_tokens=6, ignore_eos=True)).token_ids
        except ks.OutOfSlots as e:
            got[i] = e

    async with anyio.create_task_group() as tg:
        for i in range(len(sessions)):
            tg.start_soon(go, i)
    return got


async def test_more_concurrent_requests_than_slots_queue_for_a_slot(tmp_path):
    """Four sessions generating at once on two slots: the two without one wait for a running one to end (and move
    out), as a request waits for pages; each gets the tokens it gets alone. With page_wait_s 0 the ones without a
    slot are refused with OutOfSlots and their sessions are as they were."""
    async with await ks.Engine.open(store=f"disk:{tmp_path}", page_size=16) as ref:
        alone = []
        for i in range(4):
            s = await ref.create_session()
            await s.append(prompt(i))
            alone.append((await s.generate(max_tokens=6, ignore_eos=True)).token_ids)
    for wait in (30.0, 0.0):
        async with await ks.Engine.open(store=f"disk:{tmp_path / str(wait)}", page_size=16, max_active_sessions=2,
                                        page_wait_s=wait) as eng:
            sessions = []
            for i in range(4):
                s = await eng.create_session()
                await s.append(prompt(i))
                sessions.append(s)
            got = await generate_all(sessions)
            if wait:
                assert got == alone
            else:
                refused = [i for i, g in enumerate(got) if isinstance(g, ks.OutOfSlots)]
                assert refused and all(got[i] == alone[i] for i in range(4) if i not in refused)
                assert sessions[refused[0]].num_tokens == len(prompt(refused[0]))  # a refused session is unchanged
