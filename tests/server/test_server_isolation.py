"""What clients read when things go wrong on the server (issue 24.3-24.5, 24.8): a code, a message they can act
on and a request id, never the store's URL or credentials, a server path, a pid or a host name; a corrupt
server-side file is a 5xx; a 500 keeps the connection open; a non-streamed request whose client leaves stops."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from pathlib import Path

import anyio
import httpx
import pytest
from redis_server import REDIS_SERVER, start_redis_server, stop_redis_server

import kda_sessions as ks

from .server_helpers import start_server

HOSTS = {socket.gethostname(), socket.getfqdn()}


def assert_private_kept(r: httpx.Response, *secrets: str) -> dict:
    """The body is an error with a code and the request id (also in the header), naming no pid, host or secret."""
    body = r.json()["error"]
    assert body["code"] and body["message"]
    assert body["request_id"] and body["request_id"] == r.headers["x-request-id"]
    text = r.text
    for s in secrets:
        assert s not in text, (s, text)
    assert not re.search(rf"\b{os.getpid()}\b", text), text
    for host in HOSTS:
        assert not re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", text), (host, text)
    assert not re.search(r"(?<![\w/])/(?:[\w.@+~-]+/)+", text), text  # no absolute path
    return body


def test_a_corrupt_lease_fence_is_a_server_error_naming_no_path(tmp_path: Path):
    store = tmp_path / "store"
    srv = start_server(store=f"disk:{store}")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            sid = http.post("/v1/sessions", json={}).json()["session_id"]
            assert http.post(f"/v1/sessions/{sid}/append", json={"tokens": [1, 2, 3, 4]}).status_code == 200
            assert http.post(f"/v1/sessions/{sid}/save").status_code == 200
            (store / "leases" / f"{sid}.fence").write_bytes(b"\x00garbage")
            (store / "leases" / f"{sid}.lock").unlink()  # as if the lease had expired: the next save reads the fence
            r = http.post(f"/v1/sessions/{sid}/save")
        assert r.status_code == 500, r.text
        body = assert_private_kept(r, str(tmp_path))
        assert body["code"] == "integrity_error"
    finally:
        srv.stop()


def test_a_session_leased_by_another_engine_is_409_naming_no_pid_or_host(tmp_path: Path):
    url = f"disk:{tmp_path / 'store'}"
    srv = start_server(store=url)

    async def hold_elsewhere_and_ask() -> httpx.Response:
        async with await ks.Engine.open(store=url) as other:
            s = await other.create_session(session_id="held-elsewhere")
            await s.append([5, 6, 7, 8])
            await s.save()
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                assert (await http.post("/v1/sessions/held-elsewhere/append", json={"tokens": [9, 10]})).status_code == 200
                return await http.post("/v1/sessions/held-elsewhere/save")

    try:
        r = anyio.run(hold_elsewhere_and_ask)
        assert r.status_code == 409, r.text
        assert assert_private_kept(r, str(tmp_path))["code"] == "session_busy"
    finally:
        srv.stop()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not on PATH")
def test_an_unreachable_redis_is_503_without_its_url_or_password(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    password = "s3cret-PW-4711"
    port, proc = start_redis_server(tmp_path / "redis", extra_args=("--user", "agent", "on", f">{password}", "~*", "&*", "+@all"))
    url = f"redis://agent:{password}@127.0.0.1:{port}/0"
    srv = start_server(store=url)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            sid = http.post("/v1/sessions", json={}).json()["session_id"]
            assert http.post(f"/v1/sessions/{sid}/append", json={"tokens": [1, 2, 3]}).status_code == 200
            stop_redis_server(proc)
            r = http.post(f"/v1/sessions/{sid}/save")
        assert r.status_code == 503, r.text
        body = assert_private_kept(r, password, "agent:", f":{port}", "kda:", "redis://")
        assert body["code"] == "store_unavailable" and r.headers.get("retry-after")
        # the details are in the server log, under the request id
        logged = [rec.getMessage() for rec in caplog.records if body["request_id"] in rec.getMessage()]
        assert logged and any("StoreUnavailable" in m for m in logged), logged
    finally:
        stop_redis_server(proc)
        srv.stop()


def test_a_500_names_nothing_and_keeps_the_connection_open(server, monkeypatch):
    srv = server
    try:
        def boom() -> dict:
            raise RuntimeError(f"failed at {Path(__file__).resolve()} (pid {os.getpid()})")

        monkeypatch.setattr(srv.engine, "stats", boom)  # an unexpected fault inside a route
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/v1/stats", headers={"X-Request-Id": "client-chosen-id-42"})
        r = conn.getresponse()
        text = r.read().decode()
        assert r.status == 500 and r.getheader("connection") != "close"
        body = json.loads(text)["error"]
        assert body["code"] == "internal_error" and body["request_id"] == "client-chosen-id-42"
        assert __file__ not in text and str(os.getpid()) not in text
        sock = conn.sock
        conn.request("GET", "/health")  # the same connection
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["status"] == "ok"
        assert conn.sock is sock  # not reopened
        conn.close()
    finally:
        monkeypatch.undo()


def test_a_non_streamed_request_stops_when_its_client_leaves(server):
    srv = server
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["session_id"]
        assert http.post(f"/v1/sessions/{sid}/append", json={"tokens": list(range(1, 40))}).status_code == 200
        body = json.dumps({"max_tokens": 20000, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/sessions/" + sid.encode() + b"/generate HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 30
            while srv.engine.stats()["tokens_decoded"] < 5:  # it is generating
                assert time.monotonic() < deadline
                time.sleep(0.02)
        # the client has gone: the generation stops and the session takes requests again at once
        deadline = time.monotonic() + 10
        while True:
            r = http.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.json()["error"]["code"] == "session_busy"
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        decoded = srv.engine.stats()["tokens_decoded"]
        assert decoded < 5000
        time.sleep(0.3)
        assert srv.engine.stats()["tokens_decoded"] == decoded  # nothing runs on


def test_extreme_sampling_values_answer_and_impossible_schemas_are_400(server):
    srv = server
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for extreme in ({"temperature": 1e-45}, {"top_p": 1e-300}, {"temperature": 1e-45, "top_p": 1e-300}):
            r = http.post("/v1/chat/completions", json={**chat, **extreme})
            assert r.status_code == 200, (extreme, r.text)
        for schema, field in (({"type": "banana"}, "parameters.type"), ({"type": []}, "parameters.type"),
                              ({"additionalProperties": False, "required": ["a"]}, "parameters.required")):
            tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
            r = http.post("/v1/chat/completions", json={**chat, "tools": tools, "tool_choice": "required"})
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"] and r.json()["error"]["code"] == "invalid_value"
        assert http.get("/health").json()["status"] == "ok"
