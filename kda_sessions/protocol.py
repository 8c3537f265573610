"""The surface shared by the in-process engine and the HTTP client: code written against these protocols
runs unchanged on ``ks.Engine`` (local) and ``ks.Client`` (remote). ``tests/server`` checks both classes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from .types import CheckpointInfo, Reply, SaveResult, SessionInfo, StreamEvent, Usage


@runtime_checkable
class SessionLike(Protocol):
    """One conversation: ``ks.Session`` in process, ``ks.client.RemoteSession`` over HTTP."""

    @property
    def id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def messages(self) -> list[dict[str, Any]]: ...

    async def append(self, tokens: list[int] | str) -> Usage: ...

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
    ) -> Reply: ...

    async def send(self, content: str, **sampling: Any) -> Reply: ...

    async def send_tool_result(self, call_id: str, output: str, **sampling: Any) -> Reply: ...

    async def send_messages(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply: ...

    def stream(self, content: str | list[dict[str, Any]], **sampling: Any) -> AsyncIterator[StreamEvent]: ...

    async def checkpoint(self, name: str) -> CheckpointInfo: ...

    async def save(self) -> SaveResult: ...

    async def fork(self, checkpoint: str | None = None) -> SessionLike: ...


@runtime_checkable
class EngineLike(Protocol):
    """Sessions in, replies out: ``ks.Engine`` in process, ``ks.Client`` over HTTP."""

    async def create_session(
        self,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        *,
        session_id: str | None = None,
    ) -> SessionLike: ...

    async def resume(self, session_id: str) -> SessionLike: ...

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> SessionLike: ...

    async def list_sessions(self) -> list[SessionInfo]: ...

    async def delete_session(self, session_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> EngineLike: ...

    async def __aexit__(self, *exc: object) -> None: ...
