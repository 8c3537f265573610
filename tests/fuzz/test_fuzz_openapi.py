"""schemathesis against the server's own OpenAPI schema, over real HTTP: no request may get a 5xx, and every
error body has OpenAI's shape. Generation lengths are clamped to a few tokens so the run stays short; what
happens with huge ``max_tokens`` is tested on its own below."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from server.server_helpers import ServerThread, start_server

MAX_TOKENS = 4
GENERATING = ("/v1/chat/completions", "/messages", "/generate")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerThread]:
    srv = start_server()
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        ids = []
        for system in ("You are a fuzz target.", None):
            r = http.post("/v1/sessions", json={"system": system})
            assert r.status_code == 201, r.text
            ids.append(r.json()["session_id"])
        r = http.post(f"/v1/sessions/{ids[0]}/messages", json={"content": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert http.post(f"/v1/sessions/{ids[0]}/checkpoints", json={"name": "cp"}).status_code == 201
        assert http.post(f"/v1/sessions/{ids[0]}/save").status_code == 200
    srv.known_ids = ids  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerThread) -> Any:
    schema = schemathesis.openapi.from_dict(fuzz_server.app.openapi())
    schema.config.update(base_url=fuzz_server.url)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _shorten(case: Any, known_ids: list[str]) -> None:
    """Clamp generation lengths, and aim half of the session routes at sessions that exist (chosen from the
    generated id, so a failing example replays the same way)."""
    path = case.operation.path
    if isinstance(case.body, dict) and case.method.upper() == "POST" and path.endswith(GENERATING):
        for name in LENGTH_FIELDS:
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                case.body[name] = MAX_TOKENS
        if not any(name in case.body for name in LENGTH_FIELDS):
            case.body["max_tokens"] = MAX_TOKENS
    params = case.path_parameters or {}
    sid = params.get("session_id")
    if isinstance(sid, str) and case.method.upper() != "DELETE":
        h = zlib.crc32(sid.encode("utf-8", "surrogatepass"))
        if h % 2 == 0:
            params["session_id"] = known_ids[h // 2 % len(known_ids)]


def assert_openai_error(status: int, body: Any) -> None:
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{status}: {body!r}"
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and (err["code"] is None or isinstance(err["code"], str)), err


FUZZ = {"deadline": None, "suppress_health_check": list(HealthCheck), "derandomize": True, "database": None}


@schema.parametrize()
@settings(max_examples=4, **FUZZ)
def test_fuzz_openapi_no_5xx(case: Any, fuzz_server: ServerThread) -> None:
    """A few requests per operation (the same ones every run); the long run below tries 40."""
    _call_and_check(case, fuzz_server)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=40, **FUZZ)
def test_fuzz_openapi_no_5xx_long(case: Any, fuzz_server: ServerThread) -> None:
    _call_and_check(case, fuzz_server)


def _call_and_check(case: Any, fuzz_server: ServerThread) -> None:
    _shorten(case, fuzz_server.known_ids)  # type: ignore[attr-defined]
    response = case.call(base_url=fuzz_server.url, timeout=30)
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {body!r}"
    if response.status_code >= 400 and case.operation.path != "/metrics":
        assert_openai_error(response.status_code, body)


@pytest.mark.parametrize("route", ["session", "chat"])
@pytest.mark.parametrize("max_tokens", [10**6, 2**63], ids=["1e6", "2^63"])
def test_fuzz_huge_max_tokens_is_a_client_error(fuzz_server: ServerThread, route: str, max_tokens: int) -> None:
    sid = fuzz_server.known_ids[1]  # type: ignore[attr-defined]
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        if route == "session":
            r = http.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "max_tokens": max_tokens})
        else:
            r = http.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens})
    assert_openai_error(r.status_code, r.json())
    assert r.status_code == 400, r.text


def test_fuzz_invalid_utf8_body_has_a_code(fuzz_server: ServerThread) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        r = http.post("/v1/chat/completions", content=b'"\xff"', headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert_openai_error(r.status_code, r.json())
    assert r.json()["error"]["code"] == "invalid_request", r.text
