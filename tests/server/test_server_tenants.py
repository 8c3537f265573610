"""Tenants: each API key sees only its own sessions; another tenant's id answers exactly like an unknown one;
prefix reuse never crosses tenants."""

from __future__ import annotations

import httpx
import pytest

from .server_helpers import start_server

KEY_A, KEY_B = "tenant-a-key-0001", "tenant-b-key-0002"


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    srv = start_server(store=f"disk:{tmp_path_factory.mktemp('tenants')}", tenants={"acme": [KEY_A], "globex": [KEY_B]})
    yield srv
    srv.stop()


def _post(srv, key, path, body):
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _get(srv, key, path):
    return httpx.get(srv.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_other_tenants_session_is_not_found(tenant_server):
    srv = tenant_server
    history = [{"role": "system", "content": "Shared corporate prompt. " * 20}, {"role": "user", "content": "hello"}]
    r = _post(srv, KEY_A, "/v1/chat/completions", {"model": "tiny-random", "messages": history, "max_tokens": 2})
    assert r.status_code == 200
    sid = r.json()["session_id"]
    assert _post(srv, KEY_A, f"/v1/sessions/{sid}/save", {}).status_code == 200
    # B: the real id and a made-up id get byte-identical answers
    real = _get(srv, KEY_B, f"/v1/sessions/{sid}")
    fake = _get(srv, KEY_B, "/v1/sessions/s_00000000000000000000000000000000")
    assert real.status_code == fake.status_code == 404
    assert real.json()["error"]["message"].replace(sid, "X") == fake.json()["error"]["message"].replace(
        "s_00000000000000000000000000000000", "X"
    )
    cont = _post(srv, KEY_B, "/v1/chat/completions",
                 {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_id": sid})
    assert cont.status_code == 404
    assert sid not in {s["session_id"] for s in _get(srv, KEY_B, "/v1/sessions").json()["data"]}
    assert sid in {s["session_id"] for s in _get(srv, KEY_A, "/v1/sessions").json()["data"]}
    # prefix reuse: A's resend of the same history reuses A's prefix; B's identical history reuses nothing
    again = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    ra = _post(srv, KEY_A, "/v1/chat/completions", {"model": "tiny-random", "messages": again, "max_tokens": 2})
    rb = _post(srv, KEY_B, "/v1/chat/completions", {"model": "tiny-random", "messages": again, "max_tokens": 2})
    assert ra.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert rb.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
