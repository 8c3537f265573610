"""Scale-out on one shared Redis: two servers (two uvicorn instances, each with its own Engine, in their own
threads and event loops) use the same store; a session saved through one resumes through the other and
continues exactly as it would have where it was saved. Every test runs twice: on one redis-server and on a
3-node Redis Cluster started on loopback (`redis_cluster_url`); test_scaleout_redis_cluster.py covers the
cluster's key layout, leases and faults."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import anyio
import httpx
import pytest
from server.server_helpers import ServerThread, start_server

from kda_sessions.client import Client
from kda_sessions.errors import SessionBusy

SAMPLING = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LEASE_TTL_S = 0.5  # short: the handoff test waits past it


@pytest.fixture(scope="module", params=["redis", "cluster"])
def two_servers(request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, ServerThread]]:
    options = f"prefix=scaleout-{uuid.uuid4().hex[:8]}:&lease_ttl={LEASE_TTL_S}"
    if request.param == "redis":
        store = f"{request.getfixturevalue('redis_url')}?{options}"
    else:
        store = f"{request.getfixturevalue('redis_cluster_url')}&{options}"
    a = start_server(store=store)
    try:
        b = start_server(store=store)
    except Exception:
        a.stop()
        raise
    yield a, b
    b.stop()
    a.stop()


async def test_scaleout_session_saved_on_a_resumes_on_b(two_servers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_servers
    async with Client(a.url) as ca, Client(b.url) as cb:
        s = await ca.create_session(system="You are a coding agent.")
        await s.send("list the files", **SAMPLING)
        await s.checkpoint("after-list")
        saved = await s.save()
        assert saved.blobs_written > 0
        info_a = await ca.get_session(s.id)

        # what the session says next where it was saved (a fork leaves the original untouched)
        ref = await (await s.fork()).send("now read main.py", **SAMPLING)

        r = await cb.resume(s.id)
        assert r.info.num_tokens == info_a.num_tokens
        assert r.info.checkpoints == info_a.checkpoints and "after-list" in r.info.checkpoints
        assert r.info.active
        got = await r.send("now read main.py", **SAMPLING)
        assert got.token_ids == ref.token_ids
        assert got.text == ref.text
        # the history came from the store, not prefilled again (the last token may stay pending)
        assert got.usage == ref.usage
        assert got.usage.cached_tokens >= info_a.num_tokens - 1
        assert (await cb.get_session(s.id)).num_tokens == (await ca.get_session(ref.session_id)).num_tokens
        # B's own sessions, saved, are listed by A through the store
        mine = await cb.create_session(system="made on B")
        await mine.save()
        assert mine.id in {i.session_id for i in await ca.list_sessions()}


async def test_scaleout_chat_completion_with_session_id_on_b(two_servers: tuple[ServerThread, ServerThread]) -> None:
    a, b = two_servers
    first = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "plan the refactor"}],
             **SAMPLING}
    async with httpx.AsyncClient(timeout=60) as http, Client(a.url) as ca:
        r1 = await http.post(f"{a.url}/v1/chat/completions", json=first)
        assert r1.status_code == 200, r1.text
        sid = r1.json()["session_id"]
        assert r1.headers["x-session-id"] == sid
        await ca.request("POST", f"/v1/sessions/{sid}/save", idempotent=True)
        num_tokens = (await ca.get_session(sid)).num_tokens

        child = await ca.fork(sid)
        nxt = {"messages": [{"role": "user", "content": "now step 1"}], **SAMPLING}
        ref = await http.post(f"{a.url}/v1/chat/completions", json={**nxt, "session_id": child.id})
        assert ref.status_code == 200, ref.text

        got = await http.post(f"{b.url}/v1/chat/completions", json={**nxt, "session_id": sid})
        assert got.status_code == 200, got.text
        assert got.json()["session_id"] == sid
        assert got.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
        usage = got.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= num_tokens - 1
        assert usage == ref.json()["usage"]


async def test_scaleout_unknown_session_is_404_on_both(two_servers: tuple[ServerThread, ServerThread]) -> None:
    for srv in two_servers:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            r = await http.post("/v1/sessions/s_" + "0" * 32 + "/resume")
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "session_not_found"


async def test_scaleout_one_writer_then_handoff(two_servers: tuple[ServerThread, ServerThread]) -> None:
    """A's save takes the session's lease, and A renews it for as long as it holds the session: B may resume and
    continue it but not save it, even past the lease's lifetime. Once A lets the session go, B's save wins, and
    A, resuming again, gets B's version."""
    a, b = two_servers
    async with Client(a.url) as ca, Client(b.url) as cb:
        s = await ca.create_session(system="handoff")
        await s.send("step one", **SAMPLING)
        await s.save()

        r = await cb.resume(s.id)
        await r.send("step two", **SAMPLING)
        with pytest.raises(SessionBusy):
            await r.save()
        await anyio.sleep(LEASE_TTL_S + 0.3)
        with pytest.raises(SessionBusy):  # A's engine renewed the lease meanwhile
            await r.save()

        assert await _forget(a, s.id)  # A drops the session and gives its lease back
        await r.save()
        after_b = await cb.get_session(s.id)
        await r.send("step three", **SAMPLING)
        await r.save()
        assert (await cb.get_session(s.id)).num_tokens > after_b.num_tokens
        again = await ca.resume(s.id)
        assert again.info.num_tokens == (await cb.get_session(s.id)).num_tokens


async def _forget(server: ServerThread, session_id: str) -> bool:
    """`forget` on the server's engine, run on the server's own event loop (its store client belongs there)."""
    engine = server.engine
    return await anyio.to_thread.run_sync(
        lambda: anyio.from_thread.run(engine.default.forget, session_id, token=engine.loop_token)
    )
