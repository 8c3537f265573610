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
