"""EventStream's close hook: it runs however the response ends, also when the client is gone before the first
event (the generator never starts, so its own ``finally`` never runs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from kda_sessions.server.sse import EventStream, sse_data


async def _run(stream: EventStream, disconnect_first: bool) -> list[dict]:
    sent: list[dict] = []
    gate = anyio.Event()

    async def receive() -> dict:
        if not disconnect_first:
            await gate.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("type") == "http.response.body" and not message.get("more_body", False):
            gate.set()

    await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    return sent


@pytest.mark.parametrize("disconnect_first", [True, False])
def test_on_close_runs_once_whether_or_not_the_stream_started(disconnect_first: bool) -> None:
    started, closed = [], []

    async def events() -> AsyncIterator[bytes]:
        started.append(True)
        yield sse_data({"n": 1})
        yield sse_data("[DONE]")

    async def on_close() -> None:
        closed.append(True)

    async def main() -> list[dict]:
        return await _run(EventStream(events(), on_close=on_close), disconnect_first)

    sent = anyio.run(main)
    assert closed == [True]
    if not disconnect_first:  # the whole body went out before the hook ran
        assert started == [True]
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert body.endswith(b"data: [DONE]\n\n")
