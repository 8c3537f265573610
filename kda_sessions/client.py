"""``ks.Client``: the engine's methods over HTTP (httpx, async), returning the engine's own types.

    async with ks.Client("http://127.0.0.1:8000", api_key=KEY) as client:
        s = await client.create_session(system="You are a coding agent.")
        r = await s.send("hello", max_tokens=32)

Only idempotent calls (GET, DELETE, save, resume) are retried, on connection errors and 503, with backoff.
HTTP errors come back as the engine's typed exceptions (404 -> SessionNotFound, 429 -> EngineBusy, ...).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import anyio
import httpx
from pydantic import TypeAdapter

from .errors import (
    AuthenticationError,
    CheckpointNotFound,
    EngineBusy,
    IncompatibleSnapshot,
    IntegrityError,
    OutOfPages,
    OutOfSlots,
    ServerError,
    ServerUnreachable,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
)
from .types import (
    CheckpointInfo,
    Done,
    Reply,
    SaveResult,
    SessionInfo,
    StreamEvent,
    TokenDelta,
    ToolCallEvent,
    Usage,
)

SAMPLING_ARGS = frozenset({"max_tokens", "temperature", "seed", "stop", "top_p", "top_k", "logprobs", "ignore_eos",
                           "top_logprobs"})
_EVENT: TypeAdapter[StreamEvent] = TypeAdapter(TokenDelta | ToolCallEvent | Done)
# the client's own errors live in kda_sessions.errors; these names stay importable from here
__all__ = ["AuthenticationError", "Client", "RemoteSession", "ServerError", "ServerUnreachable", "error_from_body"]

_BY_CODE: dict[str, type[Exception]] = {
    "session_not_found": SessionNotFound,
    "checkpoint_not_found": CheckpointNotFound,
    "store_unavailable": StoreUnavailable,
    "out_of_slots": OutOfSlots,
    "out_of_pages": OutOfPages,
    "engine_busy": EngineBusy,
    "rate_limited": EngineBusy,
    "too_many_concurrent_requests": EngineBusy,
    "session_busy": SessionBusy,
    "session_exists": ValueError,
    "incompatible_snapshot": IncompatibleSnapshot,
    "integrity_error": IntegrityError,
}
_BY_STATUS: dict[int, type[Exception]] = {
    400: ValueError, 401: AuthenticationError, 404: SessionNotFound, 409: ValueError, 413: ValueError,
    422: ValueError, 429: EngineBusy, 503: StoreUnavailable,
}


def error_from_body(status: int, body: Any) -> Exception:
    """The typed exception for an error answer in OpenAI's shape."""
    err = body.get("error") if isinstance(body, dict) else None
    message = str(err.get("message")) if isinstance(err, dict) else f"HTTP {status}"
    code = err.get("code") if isinstance(err, dict) else None
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status)
    if cls is None:
        return ServerError(message, status)
    return cls(message)


def _path(session_id: str) -> str:
    return "/v1/sessions/" + quote(session_id, safe="")


def _check_sampling(sampling: dict[str, Any], extra: frozenset[str] = frozenset()) -> None:
    unknown = set(sampling) - SAMPLING_ARGS - extra
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; allowed: {sorted(SAMPLING_ARGS)}")


class Client:
    """The same methods and return types as ``ks.Engine`` (see ``kda_sessions.protocol``), over HTTP."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: float = 120.0,
        max_retries: int = 2,
        *,
        backoff_s: float = 0.25,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout,
                                       transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plumbing --------------------------------------------------------------------------------------------

    async def request(self, method: str, path: str, body: Any = None, *, idempotent: bool = False) -> Any:
        """One call; idempotent ones are retried on connection errors and 503 with exponential backoff."""
        attempts = 1 + (self.max_retries if idempotent else 0)
        for attempt in range(attempts):
            last = attempt + 1 == attempts
            try:
                r = await self._http.request(method, path, json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if last:
                    raise ServerUnreachable(f"cannot reach {self.base_url}: {e}") from e
                await anyio.sleep(self.backoff_s * 2**attempt)
                continue
            if r.status_code == 503 and not last:
                await anyio.sleep(self._retry_delay(r, attempt))
                continue
            if r.status_code >= 400:
                raise error_from_body(r.status_code, _json_or_none(r))
            return r.json() if r.content else None
        raise AssertionError("unreachable")

    def _retry_delay(self, r: httpx.Response, attempt: int) -> float:
        try:
            hinted = float(r.headers.get("retry-after", ""))
        except ValueError:
            hinted = 0.0
        return min(max(hinted, self.backoff_s * 2**attempt), 10.0)

    async def stream_events(self, path: str, body: dict[str, Any]) -> AsyncIterator[StreamEvent]:
        """Server-sent events of a session route as engine events. Leaving early closes the connection,
        which makes the server cancel the generation."""
        async with self._http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                raise error_from_body(r.status_code, _json_or_none(r))
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:].strip())
                    if event == "error" or "error" in data:
                        raise error_from_body(data.get("status", 500), data)
                    yield _EVENT.validate_python(data)
                    event = None

    # -- the engine's methods --------------------------------------------------------------------------------

    async def create_session(
        self,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> RemoteSession:
        body = {"system": system, "tools": tools, "session_id": session_id}
        info = SessionInfo.model_validate(await self.request("POST", "/v1/sessions", body))
        return RemoteSession(self, info)

    async def resume(self, session_id: str) -> RemoteSession:
        info = SessionInfo.model_validate(await self.request("POST", _path(session_id) + "/resume", idempotent=True))
        return RemoteSession(self, info)

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> RemoteSession:
        body = {"checkpoint": checkpoint, "session_id": new_id}
        info = SessionInfo.model_validate(await self.request("POST", _path(session_id) + "/fork", body))
        return RemoteSession(self, info)

    async def list_sessions(self) -> list[SessionInfo]:
        data = await self.request("GET", "/v1/sessions", idempotent=True)
        return [SessionInfo.model_validate(i) for i in data["data"]]

    async def get_session(self, session_id: str) -> SessionInfo:
        return SessionInfo.model_validate(await self.request("GET", _path(session_id), idempotent=True))

    async def delete_session(self, session_id: str) -> None:
        await self.request("DELETE", _path(session_id), idempotent=True)

    def stats(self) -> dict[str, Any]:
        """The server engine's counters. Synchronous like ``Engine.stats``, so it blocks for one short HTTP
        request; in async code prefer ``await client.astats()``."""
        return self.get_blocking("/v1/stats")  # type: ignore[no-any-return]

    def get_blocking(self, path: str) -> Any:
        """One GET that blocks the caller: for the synchronous members that mirror ``Engine`` / ``Session``
        (``stats()``, ``RemoteSession.messages``)."""
        with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
            try:
                r = http.get(path)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                raise ServerUnreachable(f"cannot reach {self.base_url}: {e}") from e
        if r.status_code >= 400:
            raise error_from_body(r.status_code, _json_or_none(r))
        return r.json()

    async def astats(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/stats", idempotent=True)


class RemoteSession:
    """A session held by the server; the same methods and properties as ``ks.Session``."""

    def __init__(self, client: Client, info: SessionInfo) -> None:
        self.client = client
        self._id = info.session_id
        self.info = info
        # the context length as of the last answer from the server; None once a call ended without one (an
        # error, a stream left early), and then the next read asks the server
        self._num_tokens: int | None = info.num_tokens

    @property
    def id(self) -> str:
        return self._id

    @property
    def num_tokens(self) -> int:
        """Tokens in the context. Known from the server's last answer; where a call ended without one, read
        from the server (a short blocking request)."""
        if self._num_tokens is None:
            self._num_tokens = int(self.client.get_blocking(_path(self._id) + "/messages")["num_tokens"])
        return self._num_tokens

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat messages so far, as the server holds them (a short blocking request: the history can be
        long, so it is not mirrored here)."""
        data = self.client.get_blocking(_path(self._id) + "/messages")
        self._num_tokens = int(data["num_tokens"])
        return list(data["data"])

    def __repr__(self) -> str:
        return f"RemoteSession({self._id!r}, num_tokens={self._num_tokens})"

    async def _call(self, route: str, body: Any = None, *, idempotent: bool = False) -> Any:
        """A call that may change the context: its length is unknown until the answer says it."""
        self._num_tokens = None
        return await self.client.request("POST", _path(self._id) + route, body, idempotent=idempotent)

    def _replied(self, reply: Reply) -> Reply:
        self._num_tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
        return reply

    async def append(self, tokens: list[int] | str) -> Usage:
        usage = Usage.model_validate(await self._call("/append", {"tokens": tokens}))
        self._num_tokens = usage.prompt_tokens
        return usage

    async def generate(
        self,
        max_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        logprobs: bool = False,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
    ) -> Reply:
        body = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stop": stop, "top_p": top_p,
                "top_k": top_k, "logprobs": logprobs, "ignore_eos": ignore_eos, "top_logprobs": top_logprobs}
        return self._replied(Reply.model_validate(await self._call("/generate", body)))

    async def send(self, content: str, **sampling: Any) -> Reply:
        return await self._messages({"content": content}, sampling)

    async def send_tool_result(self, call_id: str, output: str, **sampling: Any) -> Reply:
        return await self.send_messages([{"role": "tool", "tool_call_id": call_id, "content": output}], **sampling)

    async def send_messages(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply:
        return await self._messages({"messages": messages}, sampling)

    async def _messages(self, body: dict[str, Any], sampling: dict[str, Any]) -> Reply:
        _check_sampling(sampling, frozenset({"tool_choice"}))
        return self._replied(Reply.model_validate(await self._call("/messages", {**body, **sampling})))

    async def stream(self, content: str | list[dict[str, Any]], **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Like ``send`` but yields ``TokenDelta`` / ``ToolCallEvent`` as they come, then ``Done``.
        Leaving the loop early closes the connection; the server then cancels the generation."""
        _check_sampling(sampling)
        body: dict[str, Any] = {"content": content} if isinstance(content, str) else {"messages": content}
        events = self.client.stream_events(_path(self._id) + "/messages", {**body, **sampling, "stream": True})
        self._num_tokens = None
        try:
            async for ev in events:
                if isinstance(ev, Done):
                    self._replied(ev.reply)
                yield ev
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def checkpoint(self, name: str) -> CheckpointInfo:
        data = await self.client.request("POST", _path(self._id) + "/checkpoints", {"name": name})
        return CheckpointInfo.model_validate(data)

    async def save(self) -> SaveResult:
        data = await self.client.request("POST", _path(self._id) + "/save", idempotent=True)
        data.pop("session_id", None)
        return SaveResult(**data)

    async def fork(self, checkpoint: str | None = None) -> RemoteSession:
        return await self.client.fork(self._id, checkpoint)


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None
