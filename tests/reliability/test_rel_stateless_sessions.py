"""Sessions created by stateless chat completions (no session_id) are bounded: forgotten from memory when idle
past the TTL or beyond the cap (LRU); sessions created through /v1/sessions are never forgotten. These run with
``save_chat_sessions=False`` (the memory-only policy): a saved one resumes from the store, an unsaved one is 404.
The default policy (saved after every turn) is tested in tests/server/test_server_openai_durable.py."""

from __future__ import annotations

import time

import httpx
import pytest
from server.server_helpers import start_server


def _chat(url: str, text: str, session_id: str | None = None) -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0.0}
    if session_id is not None:
        body["session_id"] = session_id
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["X-Session-Id"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(store=f"disk:{tmp_path_factory.mktemp('store')}", max_stateless_sessions=3,
                     stateless_session_ttl_s=0.5, save_chat_sessions=False)
    yield s
    s.stop()


def test_stateless_sessions_are_bounded_lru(srv):
    tracker = srv.app.state.stateless
    before = srv.engine.stats()["sessions_in_memory"]
    ids = [_chat(srv.url, f"question {i}") for i in range(8)]
    assert len(tracker) <= 3
    assert srv.engine.stats()["sessions_in_memory"] <= before + 3
    held = srv.engine.sessions
    assert ids[-1] in held and ids[0] not in held  # least recently used forgotten first
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "again"}], "max_tokens": 2, "session_id": ids[0]})
    assert r.status_code == 404  # never saved: gone


def test_idle_stateless_session_is_forgotten_but_a_saved_one_resumes(srv):
    sid = _chat(srv.url, "keep me")
    assert httpx.post(f"{srv.url}/v1/sessions/{sid}/save", timeout=60).status_code == 200
    explicit = httpx.post(f"{srv.url}/v1/sessions", json={"system": "explicit"}, timeout=60).json()["session_id"]
    time.sleep(0.8)  # past the TTL
    _chat(srv.url, "another")  # a stateless request sweeps
    assert sid not in srv.engine.sessions
    assert explicit in srv.engine.sessions  # created through /v1/sessions: never forgotten
    assert _chat(srv.url, "continue", session_id=sid) == sid  # resumed from the store
    assert srv.app.state.stateless.forgotten >= 1


async def test_prefix_reuse_from_a_stored_session_does_not_hold_it(tmp_path):
    import kda_sessions as ks

    async with await ks.Engine.open(model="tiny-random", store=f"disk:{tmp_path}", page_size=16) as eng:
        history = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}]
        a = await eng.create_session_from_messages(history)
        await a.send("run the tests", max_tokens=2)
        await a.save()
        msgs = a.messages  # checkpoints sit at the boundaries of messages sent through the session
        assert await eng.default.forget(a.id)
        assert not eng.default.holds(a.id) and a.id not in eng.io.snapshots.leased
        pages_free = eng.pages.num_free
        b = await eng.create_session_from_messages(msgs)  # starts from a's stored checkpoint
        assert b.state.parent == a.id  # the prefix was reused
        assert not eng.default.holds(a.id)  # ... without keeping a in memory
        assert a.id not in eng.io.snapshots.leased  # ... or its lease
        await eng.delete_session(b.id)
        assert eng.pages.num_free == pages_free  # the parent's loaded pages went back with b's


def test_a_forgotten_stateless_session_evicted_to_the_store_leaves_it(tmp_path):
    """Under memory pressure the engine evicts idle sessions to the store; a stateless one nobody saved must not
    stay there after it is forgotten (the store would grow with every request), while a saved one does."""
    from kda_sessions.engine.config import EngineConfig

    s = start_server(store=f"disk:{tmp_path}", max_stateless_sessions=2, stateless_session_ttl_s=600.0,
                     engine=EngineConfig(max_active_sessions=2), save_chat_sessions=False)
    try:
        saved = _chat(s.url, "keep me")
        assert httpx.post(f"{s.url}/v1/sessions/{saved}/save", timeout=60).status_code == 200
        ids = [_chat(s.url, f"question {i}") for i in range(6)]  # 2 slots: every new one evicts an older one
        listed = httpx.get(f"{s.url}/v1/sessions", timeout=60).json()["data"]
        stored = {d["session_id"] for d in listed}  # held ones and stored ones
        forgotten = [i for i in ids if i not in s.engine.sessions]
        assert forgotten, "the cap of 2 forgot nothing"
        assert saved in stored  # saved on purpose: kept
        assert not stored & set(forgotten), "an unsaved stateless session outlived being forgotten"
        for sid in forgotten:
            r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "again"}], "max_tokens": 2, "session_id": sid})
            assert r.status_code == 404
    finally:
        s.stop()
