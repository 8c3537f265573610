"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right status."""

from __future__ import annotations

import logging
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
    StoreUnavailable,
)

log = logging.getLogger(__name__)

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
    (ValueError, 400, "invalid_value"),
]

_RETRY_AFTER = {429: "1", 503: "2"}


def to_api_error(exc: BaseException) -> ApiError:
    """The answer for any exception (an unexpected one is a 500 that names no internals)."""
    if isinstance(exc, ApiError):
        return exc
    for cls, status, code in _MAPPING:
        if isinstance(exc, cls):
            if isinstance(exc, ValueError) and "already exists" in str(exc):
                status, code = 409, "session_exists"
            headers = {"Retry-After": _RETRY_AFTER[status]} if status in _RETRY_AFTER else None
            return ApiError(status, str(exc), code, headers=headers)
    if isinstance(exc, KdaSessionsError):
        return ApiError(500, str(exc), "internal_error")
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, "internal server error", "internal_error")


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
    for cls in (ApiError, KdaSessionsError, EngineBusy, OutOfSlots, OutOfPages, ValueError, Exception):
        app.add_exception_handler(cls, on_api_error)
