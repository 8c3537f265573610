"""Auth, body limits, bind rule, rate limits, metrics."""

from __future__ import annotations

import hmac
import re

import httpx
import pytest

from kda_sessions.server import InsecureBindError, ServerSettings, build_app, serve
from kda_sessions.server import auth as auth_module
from kda_sessions.server.auth import KeyChecker, is_loopback
from kda_sessions.server.middleware import KeyLimits

from .server_helpers import API_KEY

CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_key_required(keyed_server):
    async with httpx.AsyncClient(base_url=keyed_server.url) as http:
        for headers in ({}, _auth("not-the-key-123"), {"Authorization": API_KEY}):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/v1/sessions")).status_code == 401
        assert (await http.get("/health")).status_code == 200  # liveness needs no key
        r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth(API_KEY))
        assert r.status_code == 200


def test_keys_compared_in_constant_time(monkeypatch):
    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    checker = KeyChecker(["first-key-aaaaaaaa", "second-key-bbbbbbbb"])
    assert checker.identify("first-key-aaaaaaaa") == auth_module.key_tenant("first-key-aaaaaaaa")
    assert seen == [(32, 32), (32, 32)]  # every key, fixed-length digests, no early exit
    assert checker.identify("x") is None and checker.identify(None) is None


async def test_oversized_body_is_413_from_content_length(keyed_server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    async with httpx.AsyncClient(base_url=keyed_server.url) as http:
        r = await http.post("/v1/chat/completions", json=big, headers=_auth(API_KEY))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_oversized_chunked_body_is_413_while_streaming(keyed_server):
    async def body():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 1000
        yield b'"}]}'

    async with httpx.AsyncClient(base_url=keyed_server.url) as http:
        r = await http.post("/v1/chat/completions", content=body(),
                            headers={**_auth(API_KEY), "Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
async def test_non_loopback_bind_without_key_refuses_to_start(host):
    settings = ServerSettings(host=host, store="memory:")
    with pytest.raises(InsecureBindError, match="API key"):
        build_app(None, settings)
    with pytest.raises(InsecureBindError):
        await serve(settings)
    build_app(None, ServerSettings(host=host, store="memory:", api_keys=["a-long-enough-key"]))  # fine with a key


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("[::1]", True), ("0.0.0.0", False), ("192.168.0.1", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_rate_and_concurrency_limits():
    limits = KeyLimits(per_minute=2, concurrent=None)
    assert limits.acquire("k") is None and limits.acquire("k") is None
    refused = limits.acquire("k")
    assert refused is not None and refused.status == 429 and refused.headers["Retry-After"]
    assert limits.acquire("other") is None  # per key
    limits = KeyLimits(per_minute=None, concurrent=1)
    assert limits.acquire("k") is None
    assert limits.acquire("k").code == "too_many_concurrent_requests"
    limits.release("k")
    assert limits.acquire("k") is None


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                     r"(-?[0-9.eE+-]+|NaN|\+Inf|-Inf)$")


async def test_metrics_is_prometheus_text(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/v1/chat/completions", json=CHAT)
        r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    typed: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "summary", "histogram") and name not in typed
            typed[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a Prometheus sample line: {line!r}"
            family = re.sub(r"_(sum|count|bucket)$", "", m.group(1))
            assert m.group(1) in typed or family in typed, f"{m.group(1)} has no # TYPE"
            samples[line.rsplit(" ", 1)[0]] = float(m.group(4))
    for name in ("kda_tokens_prefilled_total", "kda_tokens_decoded_total", "kda_prefill_avoided_tokens_total",
                 "kda_cache_hit_ratio", "kda_queue_depth", "kda_resume_seconds_count",
                 "kda_evictions_total", "kda_preemptions_total", "kda_segment_cache_hits_total",
                 "kda_segment_cache_tokens", "kda_message_cache_hits_total", "kda_message_cache_tokens"):
        assert name in samples
    assert samples['kda_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
