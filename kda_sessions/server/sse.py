"""Server-sent events whose producer is always shut down: when the client disconnects, the generator is
cancelled at once (its ``finally`` cancels the generation and frees the batch slot), not at garbage collection."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse_data(obj: Any, event: str | None = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {data}\n\n".encode()


class EventStream(StreamingResponse):
    """``on_close`` runs once when the response ends, however it ends: also when the client went away before the
    first event, when the generator never started and so never reached its own ``finally``."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def produce() -> None:
                    with contextlib.suppress(OSError):  # the client went away while we wrote
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(produce)
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    aclose = getattr(self._events, "aclose", None)
                    if aclose is not None:
                        await aclose()
                finally:
                    if self._on_close is not None:
                        await self._on_close()
