"""Sessions made through /v1/chat/completions are durable by default: saved after every turn, so a session_id
answers after the server forgets the session from memory, evicts it, or restarts; an unused one expires from
the store by the retention policy."""

from __future__ import annotations

import time

import httpx
import pytest

from kda_sessions.engine.config import EngineConfig

from .server_helpers import start_server


def _chat(url: str, text: str, session_id: str | None = None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0.0}
    if session_id is not None:
        body["session_id"] = session_id
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _stored(srv) -> set[str]:
    return {d["session_id"] for d in httpx.get(f"{srv.url}/v1/sessions", timeout=60).json()["data"] if d["saved"]}


def _wait_saved(srv, sid: str, timeout: float = 30.0) -> None:
    """The save runs once the reply is out; wait until the store lists it."""
    deadline = time.monotonic() + timeout
    while sid not in _stored(srv):
        assert time.monotonic() < deadline, f"{sid} was never saved"
        time.sleep(0.05)


# Sessions after the first: twice the memory cap forgets it; 40 (with -m slow) churns the store as a day would.
OTHERS = [8, pytest.param(40, marks=pytest.mark.slow)]


@pytest.mark.parametrize("others", OTHERS)
def test_a_session_answers_after_many_others_and_a_restart(tmp_path, others):
    store = f"disk:{tmp_path}"
    srv = start_server(store=store, max_stateless_sessions=4, engine=EngineConfig(max_active_sessions=4))
    try:
        first = _chat(srv.url, "remember the number 42").json()
        sid = first["session_id"]
        assert sid.startswith("s_chat_")
        for i in range(others):
            _chat(srv.url, f"another question {i}")
        assert sid not in srv.engine.sessions  # forgotten from memory (cap of 4) ...
        assert sid in _stored(srv)  # ... but saved
        body = {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
            streamed = r.headers["X-Session-Id"]
            assert r.read().endswith(b"data: [DONE]\n\n")
        _wait_saved(srv, streamed)  # streamed turns are saved too
    finally:
        srv.stop()
    srv = start_server(store=store)
    try:
        again = _chat(srv.url, "what was the number?", session_id=sid).json()
        assert again["session_id"] == sid
        # the history came from the store: nothing of it was prefilled again
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    finally:
        srv.stop()


def test_an_unused_chat_session_expires_from_the_store(tmp_path):
    srv = start_server(store=f"disk:{tmp_path}", chat_session_retention_s=0.5, stateless_session_ttl_s=0.0)
    try:
        old = _chat(srv.url, "old").headers["X-Session-Id"]
        explicit = httpx.post(f"{srv.url}/v1/sessions", json={"system": "explicit"}, timeout=60).json()["session_id"]
        assert httpx.post(f"{srv.url}/v1/sessions/{explicit}/save", timeout=60).status_code == 200
        _wait_saved(srv, old)
        time.sleep(0.7)  # past the retention
        new = _chat(srv.url, "new").headers["X-Session-Id"]  # its finish sweeps and expires
        _wait_saved(srv, new)
        deadline = time.monotonic() + 30
        while old in _stored(srv):
            assert time.monotonic() < deadline, "the unused session never expired"
            time.sleep(0.1)
        assert explicit in _stored(srv)  # created through /v1/sessions: not subject to the retention
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "again"}], "max_tokens": 2, "session_id": old})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_saving_off_keeps_the_memory_only_policy(tmp_path):
    srv = start_server(store=f"disk:{tmp_path}", save_chat_sessions=False, max_stateless_sessions=1)
    try:
        a = _chat(srv.url, "a").headers["X-Session-Id"]
        _chat(srv.url, "b")
        _chat(srv.url, "c")
        assert a not in srv.engine.sessions and a not in _stored(srv)
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "again"}], "max_tokens": 2, "session_id": a})
        assert r.status_code == 404
    finally:
        srv.stop()


def test_a_failed_request_leaves_nothing_in_the_store(tmp_path):
    srv = start_server(store=f"disk:{tmp_path}")
    try:
        _wait_saved(srv, _chat(srv.url, "fine").headers["X-Session-Id"])
        before = _stored(srv)
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "too long"}], "max_tokens": 10**7})
        assert r.status_code == 400, r.text
        _chat(srv.url, "fine again")  # its finish sweeps; the failed request's session was not saved
        time.sleep(0.5)
        assert len(_stored(srv) - before) == 1
    finally:
        srv.stop()
