"""ks.Client against a real uvicorn server: the session API over HTTP, typed errors, retries."""

from __future__ import annotations

import httpx
import pytest

import kda_sessions as ks
from kda_sessions.client import AuthenticationError, Client, RemoteSession, error_from_body

from .server_helpers import API_KEY, start_server


async def test_create_send_stream_checkpoint_fork_save_delete(server):
    async with Client(server.url) as client:
        s = await client.create_session(system="You are terse.")
        assert isinstance(s, RemoteSession) and s.id.startswith("s_")
        r = await s.send("hello", max_tokens=4, ignore_eos=True)
        assert isinstance(r, ks.Reply) and r.session_id == s.id
        assert r.usage.completion_tokens == 4 and r.finish_reason == "length"

        events = [ev async for ev in s.stream("go on", max_tokens=4, ignore_eos=True)]
        assert isinstance(events[-1], ks.Done)
        assert all(isinstance(e, ks.TokenDelta | ks.ToolCallEvent) for e in events[:-1])
        done = events[-1].reply
        assert done.usage.cached_tokens > 0  # the first turn's state was kept, not prefilled again

        cp = await s.checkpoint("after-two")
        assert isinstance(cp, ks.CheckpointInfo) and cp.name == "after-two" and cp.position > 0
        child = await s.fork("after-two")
        assert child.id != s.id
        r_child = await child.send("branch", max_tokens=2, ignore_eos=True)
        assert r_child.usage.cached_tokens >= cp.position - 1

        saved = await s.save()
        assert saved.blobs_written > 0
        ids = {i.session_id: i for i in await client.list_sessions()}
        assert ids[s.id].saved and ids[child.id].parent == s.id
        info = await client.get_session(s.id)
        assert "after-two" in info.checkpoints

        usage = await s.append([40, 41, 42])
        assert isinstance(usage, ks.Usage) and usage.prefill_tokens >= 2
        g = await s.generate(max_tokens=3, ignore_eos=True)
        assert len(g.token_ids) == 3

        await client.delete_session(child.id)
        with pytest.raises(ks.SessionNotFound):
            await client.resume(child.id)
        assert (await client.astats())["queue_depth"] == 0
        assert client.stats()["sessions_in_memory"] >= 1


async def test_errors_are_typed(server):
    async with Client(server.url) as client:
        with pytest.raises(ks.SessionNotFound):
            await client.resume("s_" + "0" * 32)
        s = await client.create_session(session_id="s_fixed_id_for_conflict")
        with pytest.raises(ValueError, match="already exists"):
            await client.create_session(session_id="s_fixed_id_for_conflict")
        with pytest.raises(ks.CheckpointNotFound):
            await client.fork(s.id, "no-such-checkpoint")
        with pytest.raises(ValueError):
            await s.generate(max_tokens=0)
        with pytest.raises(TypeError, match="unknown sampling"):
            await s.send("x", max_tokenz=3)


async def test_resume_through_another_server_sharing_the_store(tmp_path):
    store = f"disk:{tmp_path / 'store'}"
    a, b = start_server(store=store), start_server(store=store)
    try:
        async with Client(a.url) as ca, Client(b.url) as cb:
            s = await ca.create_session(system="sys")
            await s.send("remember this", max_tokens=3, ignore_eos=True)
            await s.save()
            s2 = await cb.resume(s.id)
            assert s2.id == s.id and s2.info.num_tokens > 0
            r = await s2.send("and now", max_tokens=2, ignore_eos=True)
            assert r.usage.cached_tokens > 0 and r.usage.prefill_tokens < r.usage.prompt_tokens
            assert b.engine.stats()["resumes"] == 1
    finally:
        a.stop()
        b.stop()


async def test_wrong_key_is_authentication_error(keyed_server):
    async with Client(keyed_server.url, api_key="wrong-key-xxxxxxxx") as client:
        with pytest.raises(AuthenticationError):
            await client.list_sessions()
    async with Client(keyed_server.url, api_key=API_KEY) as client:
        assert isinstance(await client.list_sessions(), list)


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (404, "session_not_found", ks.SessionNotFound),
        (404, "checkpoint_not_found", ks.CheckpointNotFound),
        (503, "store_unavailable", ks.StoreUnavailable),
        (503, "out_of_slots", ks.OutOfSlots),
        (429, "engine_busy", ks.EngineBusy),
        (429, "rate_limited", ks.EngineBusy),
        (409, "session_busy", ks.SessionBusy),
        (409, "session_exists", ValueError),
        (400, "invalid_request", ValueError),
        (500, "internal_error", ks.KdaSessionsError),
    ],
    ids=lambda v: str(v) if not isinstance(v, type) else v.__name__,
)
def test_error_mapping(status, code, cls):
    err = error_from_body(status, {"error": {"message": "m", "type": "t", "param": None, "code": code}})
    assert isinstance(err, cls) and "m" in str(err)


async def test_only_idempotent_calls_are_retried():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        return httpx.Response(503, json={"error": {"message": "down", "type": "x", "param": None,
                                                   "code": "store_unavailable"}})

    async with Client("http://test", transport=httpx.MockTransport(handler), max_retries=2, backoff_s=0.001) as c:
        with pytest.raises(ks.StoreUnavailable):
            await c.list_sessions()
        assert calls == ["GET"] * 3
        calls.clear()
        with pytest.raises(ks.StoreUnavailable):
            await c.create_session(system="x")
        assert calls == ["POST"]
        calls.clear()
        with pytest.raises(ks.StoreUnavailable):
            await RemoteSession(c, ks.SessionInfo(session_id="s_x", num_tokens=0, checkpoints=[], active=True,
                                                  saved=False)).save()
        assert calls == ["POST"] * 3
