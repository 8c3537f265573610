"""A caller cancelled in the middle of a session operation leaves the session as it was or as it would be after
the operation, never in between: a save cancelled after its commit, and a resume (the slot taken, the state not
yet loaded) cancelled, then the session used again. Each pause is made wide by slowing one step down, and the
cancel lands inside it."""

from __future__ import annotations

import anyio
import pytest

import kda_sessions as ks
from kda_sessions.storage.snapshot import SnapshotStore


def prompt(n: int = 40) -> list[int]:
    return [(j * 7) % 250 for j in range(n)]


async def test_a_save_cancelled_after_its_commit_still_counts(tmp_path, monkeypatch):
    url = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=url, page_size=16) as eng:
        s = await eng.create_session(session_id="saved")
        await s.append(prompt())
        await s.generate(max_tokens=4, ignore_eos=True)
        repair = SnapshotStore._repair_after_commit

        async def slow_repair(self, *args, **kw):
            await anyio.sleep(0.3)  # the manifest is committed: a cancel here lands after the commit
            return await repair(self, *args, **kw)

        monkeypatch.setattr(SnapshotStore, "_repair_after_commit", slow_repair)
        with anyio.move_on_after(0.1) as scope:
            await s.save()
        monkeypatch.setattr(SnapshotStore, "_repair_after_commit", repair)
        assert not scope.cancelled_caught  # shielded: the save ended, the cancel is the caller's afterwards
        await s.generate(max_tokens=3, ignore_eos=True)
        await s.save()  # its generation is the store's: no SnapshotConflict
        want = (await s.generate(max_tokens=5, ignore_eos=True)).token_ids
        tokens = list(s.state.tokens)
        await s.save()
    async with await ks.Engine.open(store=url, page_size=16) as eng:
        r = await eng.resume("saved")
        assert list(r.state.tokens) == tokens
        ref = await eng.create_session()
        await ref.append(tokens[: -len(want)])
        assert (await ref.generate(max_tokens=5, ignore_eos=True)).token_ids == want


async def test_a_resume_cancelled_while_it_makes_room_leaves_it_moved_out(tmp_path, monkeypatch):
    """One slot: resuming a means evicting b (a save). The cancel lands during that save, which finishes
    (shielded), and reaches the resume right after it took the slot, before a's state is back."""
    async with await ks.Engine.open(store=f"disk:{tmp_path}", page_size=16, max_active_sessions=1) as eng:
        a = await eng.create_session()
        await a.append(prompt())
        first = await a.generate(max_tokens=4, ignore_eos=True)
        b = await eng.create_session()
        await b.append(prompt(30))  # a moves out for b
        assert not a.state.resident
        repair = SnapshotStore._repair_after_commit

        async def slow_repair(self, *args, **kw):
            await anyio.sleep(0.3)
            return await repair(self, *args, **kw)

        monkeypatch.setattr(SnapshotStore, "_repair_after_commit", slow_repair)
        with anyio.move_on_after(0.1) as scope:
            await a.generate(max_tokens=4, ignore_eos=True)
        monkeypatch.setattr(SnapshotStore, "_repair_after_commit", repair)
        assert scope.cancelled_caught and not b.state.resident
        assert not a.state.resident and a.state.slot is None and a.state.pages == []
        got = await a.generate(max_tokens=4, ignore_eos=True)  # loads its state again from the store
    async with await ks.Engine.open(store="memory:", page_size=16) as ref:
        r = await ref.create_session()
        await r.append(prompt())
        assert (await r.generate(max_tokens=4, ignore_eos=True)).token_ids == first.token_ids
        assert (await r.generate(max_tokens=4, ignore_eos=True)).token_ids == got.token_ids


async def test_a_turn_refused_after_a_prefix_seat_leaves_the_state_at_its_tokens(monkeypatch):
    """A second conversation on the same system prompt is seated on the first one's checkpoint inside its new
    turn's tokens (prefix reuse), then refused (no pages): the turn's tokens go, and the state must not stay past
    them. The next turn then gives what a fresh conversation gives."""
    from kda_sessions.errors import OutOfPages
    from kda_sessions.sessions.residency import Residency

    system, turns = "You are a coding agent.", ["task 1", "more " * 12, "again " * 10]
    async with await ks.Engine.open(store="memory:", page_size=16, checkpoint_interval_pages=2) as eng:
        a = await eng.create_session(system=system)
        for t in turns:
            await a.send(t, max_tokens=4)
        b = await eng.create_session(system=system)
        await b.send(turns[0], max_tokens=4)
        hits = eng.stats()["prefix_cache_hits"]
        ensure = Residency.ensure_pages

        async def refuse(self, s, total):
            raise OutOfPages("no pages (test)")

        monkeypatch.setattr(Residency, "ensure_pages", refuse)
        with pytest.raises(OutOfPages):
            await b.send(turns[1], max_tokens=4)
        monkeypatch.setattr(Residency, "ensure_pages", ensure)
        st = b.state
        assert eng.stats()["prefix_cache_hits"] > hits  # the refused turn was seated first
        assert st.num_cached <= st.num_tokens - 1
        got = (await b.send(turns[1] + " again", max_tokens=6)).token_ids
    async with await ks.Engine.open(store="memory:", page_size=16, checkpoint_interval_pages=0) as ref:
        r = await ref.create_session(system=system)
        await r.send(turns[0], max_tokens=4)
        assert (await r.send(turns[1] + " again", max_tokens=6)).token_ids == got
