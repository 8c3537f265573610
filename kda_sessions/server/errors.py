"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code", "request_id"}}``, with the right
status.

What a client reads must not tell it about the server: errors from the store (whose messages name its URL,
credentials, key prefixes, paths, and the pid and host of another writer) answer with a fixed message per code,
and every other message goes through ``redact`` (URLs, absolute paths, pids and this host's name are cut). The
full message goes to the server log under the request's id, which the body and the ``X-Request-Id`` header carry.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
from contextvars import ContextVar
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.pool import OutOfPages, OutOfSlots
from ..engine.scheduler import EngineBusy
from ..errors import (
    CheckpointNotFound,
    IncompatibleSnapshot,
    IntegrityError,
    KdaSessionsError,
    SessionBusy,
    SessionNotFound,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

REQUEST_ID: ContextVar[str | None] = ContextVar("kda_sessions_request_id", default=None)
"""The id of the request being answered (set by GuardMiddleware for the request's task and its stream)."""
_REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{8,64}$")


def new_request_id(client_given: str | None = None) -> str:
    """The client's ``X-Request-Id`` when it is a plain token of 8-64 characters, else a fresh one."""
    if client_given is not None and _REQUEST_ID_PATTERN.match(client_given):
        return client_given
    return "req_" + secrets.token_hex(12)


_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")
_PATH = re.compile(r"(?<![\w/])(?:[A-Za-z]:)?/(?:[\w.@+~-]+/)+[\w.@+~-]*|(?<=disk:)\S+")
_PID = re.compile(r"\bpid[ =:]*\d+", re.IGNORECASE)


def redact(message: str) -> str:
    """``message`` without URLs, absolute paths, pids or this host's name."""
    message = _URL.sub("<url>", message)
    message = _PATH.sub("<path>", message)
    message = _PID.sub("pid <hidden>", message)
    for host in {socket.gethostname(), socket.getfqdn()}:
        if len(host) >= 2:
            message = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", message)
    return message

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error the server answers with; ``code`` is machine-readable and what the Client maps back."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
                "request_id": REQUEST_ID.get(),
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# (exception class, status, code); the first match wins, so subclasses come before their bases
_MAPPING: list[tuple[type[BaseException], int, str]] = [
    (SessionNotFound, 404, "session_not_found"),
    (CheckpointNotFound, 404, "checkpoint_not_found"),
    (SessionBusy, 409, "session_busy"),
    (IncompatibleSnapshot, 409, "incompatible_snapshot"),
    (EngineBusy, 429, "engine_busy"),
    (StoreUnavailable, 503, "store_unavailable"),
    (OutOfSlots, 503, "out_of_slots"),
    (OutOfPages, 503, "out_of_pages"),
    (IntegrityError, 500, "integrity_error"),
    (StoreError, 500, "store_error"),
    (ValueError, 400, "invalid_value"),
]

# what a client reads for errors whose own message is the server's business (module doc)
_FIXED_MESSAGES: list[tuple[type[BaseException], str]] = [
    (SnapshotConflict, "the session was saved by another engine since this one loaded it; resume it again to continue"),
    (SessionBusy, "the session is held by another engine (its write lease); retry later or continue it there"),
    (StoreUnavailable, "the session store is unavailable; retry later"),
    (IntegrityError, "stored data of this session failed an integrity check; the server log has the details"),
    (StoreError, "the session store failed; the server log has the details"),
]

_RETRY_AFTER = {429: "1", 503: "2"}


def to_api_error(exc: BaseException) -> ApiError:
    """The answer for any exception: a code, a message a client can act on and nothing about the server (module
    doc); the full story is logged under the request id. An unexpected exception is a 500 that names nothing."""
    if isinstance(exc, ApiError):
        exc.message = redact(exc.message)
        return exc
    rid = REQUEST_ID.get()
    for cls, status, code in _MAPPING:
        if isinstance(exc, cls):
            if isinstance(exc, ValueError) and "already exists" in str(exc):
                status, code = 409, "session_exists"
            headers = {"Retry-After": _RETRY_AFTER[status]} if status in _RETRY_AFTER else None
            fixed = next((m for c, m in _FIXED_MESSAGES if isinstance(exc, c)), None)
            message = fixed if fixed is not None else redact(str(exc))
            if fixed is not None or status >= 500 or message != str(exc):
                log.warning("request %s: %d %s: %s: %s", rid, status, code, type(exc).__name__, exc)
            return ApiError(status, message, code, headers=headers)
    log.error("request %s: unhandled error", rid, exc_info=exc)
    return ApiError(500, "internal server error; the server log has the details", "internal_error")


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is (body, character offset), not a field
            at = first.get("loc", ("body", 0))[-1]
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            return ApiError(400, f"the request body is not valid JSON: {reason} at character {at}",
                            "invalid_json").response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(_describe(e) for e in errors[:5])
        return ApiError(400, message or "invalid request", "invalid_request", param=".".join(loc) or None).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        default = "invalid_request" if 400 <= exc.status_code < 500 else "server_error"
        return ApiError(exc.status_code, str(exc.detail), codes.get(exc.status_code, default),
                        headers=dict(exc.headers) if exc.headers else None).response()

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Not Exception: Starlette re-raises after answering a handler of Exception, which makes the server close
    # the connection; GuardMiddleware answers an unexpected exception itself and keeps it open.
    for cls in (ApiError, KdaSessionsError, EngineBusy, OutOfSlots, OutOfPages, ValueError):
        app.add_exception_handler(cls, on_api_error)
