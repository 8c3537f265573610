"""One ASGI layer in front of every route: the request id, request metrics, API key, per-key rate and
concurrency limits, the body-size limit (from Content-Length, and again while the body streams in, before it is
buffered), and the answer to an exception no route handled (a 500 that keeps the connection open)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import HTTPException

from .auth import KeyChecker, bearer_token
from .errors import REQUEST_ID, ApiError, new_request_id, to_api_error
from .metrics import Metrics
from .settings import ServerSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"})


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


@dataclass
class _Bucket:
    tokens: float
    updated: float = field(default_factory=time.monotonic)
    in_flight: int = 0


class KeyLimits:
    """Token bucket (requests per minute) and in-flight count per key name."""

    def __init__(self, per_minute: int | None, concurrent: int | None) -> None:
        self.per_minute = per_minute
        self.concurrent = concurrent
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str) -> ApiError | None:
        b = self._buckets.setdefault(key, _Bucket(tokens=float(self.per_minute or 0)))
        if self.per_minute is not None:
            now = time.monotonic()
            b.tokens = min(float(self.per_minute), b.tokens + (now - b.updated) * self.per_minute / 60.0)
            b.updated = now
            if b.tokens < 1.0:
                wait = math.ceil((1.0 - b.tokens) * 60.0 / self.per_minute)
                return ApiError(429, f"rate limit of {self.per_minute} requests per minute exceeded",
                                "rate_limited", headers={"Retry-After": str(wait)})
        if self.concurrent is not None and b.in_flight >= self.concurrent:
            return ApiError(429, f"at most {self.concurrent} concurrent requests per key",
                            "too_many_concurrent_requests", headers={"Retry-After": "1"})
        if self.per_minute is not None:
            b.tokens -= 1.0
        b.in_flight += 1
        return None

    def release(self, key: str) -> None:
        self._buckets[key].in_flight -= 1


class GuardMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: Metrics) -> None:
        self.app = app
        self.limit = settings.max_body_bytes
        self.keys = KeyChecker(settings.api_keys, settings.tenants)
        self.limits = KeyLimits(settings.rate_limit_per_minute, settings.max_concurrent_per_key)
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        started = {"yes": False}
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)
        rid = new_request_id(given)
        token = REQUEST_ID.set(rid)

        t0 = time.perf_counter()
        observed = {"yes": False}

        def observe() -> None:
            if not observed["yes"]:
                observed["yes"] = True
                self.metrics.observe_request(scope.get("path", ""), status["code"], time.perf_counter() - t0)

        async def send_tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                started["yes"] = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                observe()  # before the client can have the whole answer
            await send(message)

        try:
            await self._guarded(scope, receive, send_tracked, started)
        except Exception as e:  # no route handled it: answer here, so the connection stays usable
            if started["yes"]:
                raise
            await _answer(scope, send_tracked, to_api_error(e))
        finally:
            REQUEST_ID.reset(token)
            observe()

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, started: dict[str, bool]) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if scope.get("path") in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        key = self.keys.identify(bearer_token(headers.get("authorization")))
        if key is None:
            await _answer(scope, send, ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                                "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        scope.setdefault("state", {})["api_key_name"] = key
        scope["state"]["tenant"] = None if key == "anonymous" else key
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _answer(scope, send, ApiError(413, f"request body exceeds the limit of {self.limit} bytes",
                                                "request_too_large"))
            return
        refused = self.limits.acquire(key)
        if refused is not None:
            await _answer(scope, send, refused)
            return
        try:
            await self._cancel_on_disconnect(scope, self._counting(receive), send)
        except BodyTooLarge as e:
            if started["yes"]:
                raise
            await _answer(scope, send, ApiError(413, str(e.detail), "request_too_large"))
        finally:
            self.limits.release(key)

    async def _cancel_on_disconnect(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; if the client goes away before a (non-streamed) response is sent, cancel it, so that a
        generation nobody will read stops and frees its session and batch slot. Streams are left to the streaming
        response, which notices the disconnect itself. Disconnects are watched only once the body has been read,
        so the watcher never takes a body chunk from the app."""
        body_read = anyio.Event()
        state = {"streaming": False, "done": False}

        async def receive_tracked() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def send_tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctype = next((v for k, v in message.get("headers", []) if k.lower() == b"content-type"), b"")
                state["streaming"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        failed: Exception | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await body_read.wait()
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                if not state["streaming"] and not state["done"]:
                    log.info("request %s: the client disconnected; cancelling it", REQUEST_ID.get())
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.app(scope, receive_tracked, send_tracked)
            except Exception as e:  # raised as itself below, not wrapped in the task group's ExceptionGroup
                failed = e
            tg.cancel_scope.cancel()
        if failed is not None:
            raise failed

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return wrapped


async def _answer(scope: Scope, send: Send, error: ApiError) -> None:
    await error.response()(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
