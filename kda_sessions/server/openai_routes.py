"""``/v1/chat/completions`` and ``/v1/models``, compatible with the official openai SDK, plus the
``session_id`` extension: name a session to continue it with the new messages only."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.engine import Engine
from ..engine.tenancy import TenantEngine
from ..engine.types import Done, Reply, StreamEvent, TokenDelta, ToolCallEvent
from ..sessions.session import Session
from .chat import (
    ChunkWriter,
    check_tool_calls,
    completion_body,
    finish_reason,
    logprobs_body,
    new_completion_id,
    sampling_args,
    split_history,
    tool_choice_met,
)
from .errors import to_api_error
from .schemas import ChatCompletionRequest
from .sse import EventStream, sse_data

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    name = request.app.state.settings.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": request.app.state.started,
                                        "owned_by": "kda-sessions"}]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | EventStream:
    engine: Engine = request.app.state.engine
    settings = request.app.state.settings
    tools = None if body.tool_choice == "none" else body.tools_plain()
    messages = [m.to_template() for m in body.messages]
    view = await engine.for_tenant(request.scope.get("state", {}).get("tenant"))
    session, new = await open_session(view, body.session_id, messages, tools)
    inflight = request.app.state.inflight
    inflight.check(view.tenant, session.id)
    tools = session.state.tools if body.session_id else tools
    sampling = sampling_args(body, settings)
    headers = {"X-Session-Id": session.id}
    model = body.model or settings.model_name
    stateless = request.app.state.stateless.use(view, session.id, created=body.session_id is None)
    if body.stream:
        events = stream_completion(request, session, new, sampling, body, tools, model)
        return EventStream(inflight.claimed_stream(view.tenant, session.id, _tracked(stateless, events)), headers=headers)
    with inflight.claim(view.tenant, session.id):
        async with stateless:
            reply = await send_with_tool_choice(session, new, sampling, body.tool_choice)
    calls = _checked_calls(request, reply, tools, body.tool_choice)
    lp = logprobs_body(reply.token_ids, reply.logprobs, engine.tokenizer.decode) if body.logprobs else None
    return JSONResponse(completion_body(reply, calls, model, new_completion_id(), lp), headers=headers)


async def _tracked(use: AbstractAsyncContextManager[None], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The stream's events with the session kept from being forgotten until the stream ends."""
    async with use:
        async for chunk in events:
            yield chunk


async def open_session(
    engine: Engine | TenantEngine, session_id: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[Session, list[dict[str, Any]]]:
    """(the session to answer in, the messages still to send). Without a session id, the closed part of the
    history becomes a new session started from the longest stored prefix of its tokens."""
    if session_id is not None:
        return await engine.resume(session_id), messages
    prefix, new = split_history(messages)
    return await engine.create_session_from_messages(prefix, tools), new


async def send_with_tool_choice(
    session: Session, messages: list[dict[str, Any]], sampling: dict[str, Any], tool_choice: Any
) -> Reply:
    """Passes tool_choice through where the engine accepts it (constrained decoding), else sends without."""
    if tool_choice not in (None, "auto", "none"):
        choice = tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump()
        try:
            return await session.send_messages(messages, tool_choice=choice, **sampling)
        except TypeError as e:
            if "tool_choice" not in str(e):
                raise
    return await session.send_messages(messages, **sampling)


def _checked_calls(request: Request, reply: Reply, tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[Any]:
    calls, problems = check_tool_calls(list(reply.tool_calls), tools, tool_choice)
    for p in problems:
        log.warning("session %s: %s", reply.session_id, p)
    if not tool_choice_met(tool_choice, calls):
        request.app.state.metrics.tool_choice_unmet += 1
        log.warning("session %s: tool_choice %r not met (decoding is not constrained yet)", reply.session_id, tool_choice)
    return calls


async def _stream_events(session: Session, messages: list[dict[str, Any]], sampling: dict[str, Any],
                         tool_choice: Any) -> AsyncIterator[StreamEvent]:
    if tool_choice not in (None, "auto", "none"):
        choice = tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump()
        gen = session.stream(messages, tool_choice=choice, **sampling)
        try:
            first = await gen.__anext__()
        except TypeError as e:
            if "tool_choice" not in str(e):
                raise
        except StopAsyncIteration:
            return
        else:
            try:
                yield first
                async for ev in gen:
                    yield ev
            finally:
                await gen.aclose()  # type: ignore[attr-defined]
            return
    gen = session.stream(messages, **sampling)
    try:
        async for ev in gen:
            yield ev
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


async def stream_completion(
    request: Request, session: Session, messages: list[dict[str, Any]], sampling: dict[str, Any],
    body: ChatCompletionRequest, tools: list[dict[str, Any]] | None, model: str,
) -> AsyncIterator[bytes]:
    chunks = ChunkWriter(new_completion_id(), model, session.id)
    specials = list(session.engine.tokenizer.special_ids)
    yield sse_data(chunks.role())
    calls: list[Any] = []
    events = _stream_events(session, messages, sampling, body.tool_choice)
    try:
        async for ev in events:
            if isinstance(ev, TokenDelta):
                text = _strip_specials(ev.text, specials)
                if text:
                    yield sse_data(chunks.content(text))
            elif isinstance(ev, ToolCallEvent):
                ok, problems = check_tool_calls([ev.tool_call], tools, body.tool_choice)
                for p in problems:
                    log.warning("session %s: %s", session.id, p)
                for call in ok:
                    calls.append(call)
                    yield sse_data(chunks.tool_call(call))
            elif isinstance(ev, Done):
                if not tool_choice_met(body.tool_choice, calls):
                    request.app.state.metrics.tool_choice_unmet += 1
                yield sse_data(chunks.finish(finish_reason(ev.reply.finish_reason, calls)))
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse_data(chunks.usage(ev.reply.usage))
    except Exception as e:  # headers are sent: the error goes in the stream, as OpenAI does
        yield sse_data(to_api_error(e).body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield sse_data("[DONE]")


def _strip_specials(text: str, specials: list[str]) -> str:
    """Stream deltas carry special tokens as text; the non-streamed reply skips them, and so do chunks."""
    if "<|" not in text:
        return text
    for s in specials:
        text = text.replace(s, "")
    return text
