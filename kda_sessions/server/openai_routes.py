"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, compatible with the official openai SDK,
plus the ``session_id`` extension: name a session to continue it with the new messages only. Every session a
completion answers in is saved once the reply is out (server/stateless.py has the policy)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from ..api import Engine
from ..engine.types import Done, Reply, StreamEvent, TokenDelta, ToolCallEvent
from ..sessions.session import Session
from ..sessions.tenancy import TenantSessions
from .chat import (
    ChunkWriter,
    check_tool_calls,
    completion_body,
    finish_reason,
    logprobs_body,
    new_completion_id,
    sampling_args,
    split_history,
    text_completion_body,
    tool_choice_met,
    unique_call_ids,
)
from .errors import ApiError, to_api_error
from .schemas import ChatCompletionRequest, CompletionRequest
from .settings import ServerSettings
from .sse import EventStream, sse_data
from .stateless import StatelessSessions, new_chat_session_id

log = logging.getLogger(__name__)
router = APIRouter()


def check_model(settings: ServerSettings, model: str | None) -> None:
    """A request's ``model`` must be the served model or one of its aliases (None: the served one)."""
    if model is not None and model not in settings.model_names:
        served = ", ".join(repr(n) for n in sorted(settings.model_names))
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {served}", "model_not_found",
                       param="model")


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    settings: ServerSettings = request.app.state.settings
    names = [settings.model_name, *(a for a in settings.served_model_aliases if a != settings.model_name)]
    return {"object": "list", "data": [{"id": name, "object": "model", "created": request.app.state.started,
                                        "owned_by": "kda-sessions"} for name in names]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | EventStream:
    engine: Engine = request.app.state.engine
    settings: ServerSettings = request.app.state.settings
    check_model(settings, body.model)
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
    tracker: StatelessSessions = request.app.state.stateless
    tracker.begin(view, session.id, created=body.session_id is None)
    if body.stream:
        await tracker.tidy(view)
        events = stream_completion(request, session, new, sampling, body, tools, model)
        return EventStream(inflight.claimed_stream(view.tenant, session.id, events), headers=headers,
                           on_close=functools.partial(_finish_all, tracker, view, [session]))
    sessions = [session]
    try:
        with inflight.claim(view.tenant, session.id):
            prompt_end = f"msg-{len(session.messages) + len(new) - 1}"  # the checkpoint the turn takes at its input's end
            reply = await send_with_tool_choice(session, new, sampling, body.tool_choice)
            more = []
            for i in range(1, body.n or 1):  # the other choices continue forks of the prompt's state
                child = await view.fork(session.id, prompt_end, new_id=new_chat_session_id())
                tracker.begin(view, child.id, created=True)
                sessions.append(child)
                seed = None if sampling["seed"] is None else sampling["seed"] + i
                more.append(await send_with_tool_choice(child, [], {**sampling, "seed": seed}, body.tool_choice))
    except BaseException:
        for s in sessions:
            await tracker.finish(view, s, answered=False)
        raise
    decode = engine.tokenizer.decode
    answers = [(r, _checked_calls(request, r, tools, body.tool_choice),
                logprobs_body(r, decode) if body.logprobs else None) for r in [reply, *more]]
    (r0, calls0, lp0), rest = answers[0], answers[1:]
    payload = completion_body(r0, calls0, model, new_completion_id(), lp0, more=rest)
    await tracker.tidy(view)
    return JSONResponse(payload, headers=headers, background=BackgroundTask(_finish_all, tracker, view, sessions))


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | EventStream:
    """A raw prompt (text or token ids) continued without the chat template, in a session of its own (or, with
    ``session_id``, appended to that session's context)."""
    engine: Engine = request.app.state.engine
    settings: ServerSettings = request.app.state.settings
    check_model(settings, body.model)
    view = await engine.for_tenant(request.scope.get("state", {}).get("tenant"))
    created = body.session_id is None
    session = await view.resume(body.session_id) if body.session_id else await view.create_session(
        session_id=new_chat_session_id())
    inflight = request.app.state.inflight
    inflight.check(view.tenant, session.id)
    tracker: StatelessSessions = request.app.state.stateless
    tracker.begin(view, session.id, created=created)
    default = settings.sampling_defaults()  # the model's generation config (max_tokens stays OpenAI's 16)
    sampling: dict[str, Any] = {
        "max_tokens": body.max_tokens or 16,
        "temperature": default["temperature"] if body.temperature is None else body.temperature,
        "top_p": default["top_p"] if body.top_p is None else body.top_p, "seed": body.seed, "stop": body.stop,
        "logprobs": body.logprobs is not None, "ignore_eos": body.ignore_eos, "top_k": body.top_k or 0,
    }
    try:
        with inflight.claim(view.tenant, session.id):
            prompt = body.prompt
            if prompt:
                await session.append(prompt)  # type: ignore[arg-type]
            reply = await session.generate(**sampling)
    except BaseException:
        await tracker.finish(view, session, answered=False)
        raise
    payload = text_completion_body(reply, body.model or settings.model_name, new_completion_id("cmpl-"),
                                   body.logprobs is not None, engine.tokenizer.decode)
    headers = {"X-Session-Id": session.id}
    await tracker.tidy(view)
    background = BackgroundTask(_finish_all, tracker, view, [session])
    if not body.stream:
        return JSONResponse(payload, headers=headers, background=background)
    # generated as a whole, then sent as one chunk: streaming clients work, nothing arrives early
    usage = payload.pop("usage")
    chunks = [sse_data(payload)]
    if body.stream_options is not None and body.stream_options.include_usage:
        chunks.append(sse_data({**payload, "choices": [], "usage": usage}))
    chunks.append(sse_data("[DONE]"))
    return EventStream(_iterate(chunks), headers=headers, on_close=functools.partial(_finish_all, tracker, view, [session]))


async def _iterate(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


async def _finish_all(tracker: StatelessSessions, view: TenantSessions, sessions: list[Session]) -> None:
    for s in sessions:
        await tracker.finish(view, s)


async def open_session(
    engine: Engine | TenantSessions, session_id: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[Session, list[dict[str, Any]]]:
    """(the session to answer in, the messages still to send). Without a session id, the closed part of the
    history becomes a new session started from the longest stored prefix of its tokens."""
    if session_id is not None:
        return await engine.resume(session_id), messages
    prefix, new = split_history(messages)
    return await engine.create_session_from_messages(prefix, tools, session_id=new_chat_session_id()), new


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
    """The reply's valid calls, with ids unique to this reply."""
    calls, problems = check_tool_calls(list(reply.tool_calls), tools, tool_choice)
    for p in problems:
        log.warning("session %s: %s", reply.session_id, p)
    if not tool_choice_met(tool_choice, calls):
        request.app.state.metrics.tool_choice_unmet += 1
        log.warning("session %s: tool_choice %r not met (%s)", reply.session_id, tool_choice, reply.finish_reason)
    return unique_call_ids(calls)


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
    specials = list(request.app.state.engine.tokenizer.special_ids)
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
                for call in unique_call_ids(ok):
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
