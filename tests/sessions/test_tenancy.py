"""Tenancy (sessions/tenancy.py, the tenants' store namespaces in store_io.py): every tenant has its own store
namespace, ids, listing, deletes and forgets; another tenant's id answers like an unknown one."""

from __future__ import annotations

import pytest

import kda_sessions as ks
from kda_sessions.sessions.store_io import tenant_store_url


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("disk:/data/store", "disk:/data/store/tenants/acme"),
        ("disk:/data/store/", "disk:/data/store/tenants/acme"),
        ("redis://h:6379/0", "redis://h:6379/0?prefix=kda%3At.acme%3A"),
        ("redis://h:6379/0?prefix=x:&lease_ttl=2", "redis://h:6379/0?prefix=x%3At.acme%3A&lease_ttl=2"),
        ("memory:", "memory:"),
    ],
    ids=["disk", "disk-slash", "redis", "redis-prefix", "memory"],
)
def test_tenant_store_url_gives_each_tenant_its_namespace(url: str, want: str) -> None:
    got = tenant_store_url(url, "acme")
    if url.startswith("redis") and "lease_ttl" in url:  # query order is not part of the promise
        assert set(got.split("?")[1].split("&")) == set(want.split("?")[1].split("&"))
    else:
        assert got == want


@pytest.mark.parametrize("tenant", ["", "../up", "a/b", "x" * 200], ids=["empty", "dotdot", "slash", "long"])
def test_tenant_names_that_could_escape_their_namespace_are_refused(tenant: str) -> None:
    with pytest.raises(ValueError, match="tenant must match"):
        tenant_store_url("disk:/data/store", tenant)


async def test_each_tenant_has_its_own_ids_listing_store_and_deletes(tmp_path) -> None:
    root = tmp_path / "store"
    async with await ks.Engine.open(store=f"disk:{root}", page_size=16) as eng:
        a, b = await eng.for_tenant("a"), await eng.for_tenant("b")
        assert await eng.for_tenant("a") is a  # one handle per tenant
        sa = await a.create_session(system="sys a", session_id="s_one")
        sb = await b.create_session(system="sys b", session_id="s_one")  # the same id, another tenant
        await sa.append([40, 41, 42])
        await sa.save()
        await sb.save()
        assert (root / "tenants" / "a").is_dir() and (root / "tenants" / "b").is_dir()
        assert [i.session_id for i in await a.list_sessions()] == ["s_one"]
        assert [i.session_id for i in await eng.list_sessions()] == []  # the default tenant saw nothing
        assert a.holds("s_one") and not (await eng.for_tenant("c")).holds("s_one")
        assert a.sessions["s_one"] is sa.state and b.sessions["s_one"] is sb.state

        await a.delete_session("s_one")
        assert not a.holds("s_one") and await a.list_sessions() == []
        with pytest.raises(ks.SessionNotFound):
            await a.resume("s_one")
        assert b.holds("s_one") and [i.session_id for i in await b.list_sessions()] == ["s_one"]
        with pytest.raises(ks.SessionNotFound):  # an unknown tenant's view of b's id
            await eng.resume("s_one")


async def test_forget_drops_only_memory_and_a_saved_session_resumes(tmp_path) -> None:
    async with await ks.Engine.open(store=f"disk:{tmp_path / 'store'}", page_size=16) as eng:
        t = await eng.for_tenant("t")
        s = await t.create_session(system="keep me")
        await s.append([50, 51])
        await s.save()
        tokens, cached = list(s.state.tokens), s.state.num_cached
        unsaved = await t.create_session(system="lose me")
        free = eng.stats()["pages_free"]
        assert await t.forget(s.id) and await t.forget(unsaved.id)
        assert not t.holds(s.id) and eng.stats()["pages_free"] > free
        assert not await t.forget(s.id)  # no longer held
        again = await t.resume(s.id)
        assert list(again.state.tokens) == tokens and again.state.num_cached == cached
        with pytest.raises(ks.SessionNotFound):
            await t.resume(unsaved.id)


async def test_create_from_messages_keeps_the_system_prompt_and_messages() -> None:
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        t = await eng.for_tenant("t")
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        s = await t.create_session_from_messages(msgs)
        assert s.state.system == "be brief" and s.state.messages == msgs and s.state.messages[0] is not msgs[0]
        assert s.state.next_message_index == 2 and s.state.num_tokens > 0
        with pytest.raises(ValueError, match="session_id must match"):
            await t.create_session(session_id="bad id!")
