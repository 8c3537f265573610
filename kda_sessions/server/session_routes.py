"""``/v1/sessions``: the Python session API over HTTP (what ``ks.Client`` speaks)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..engine.types import CheckpointInfo, Reply, SessionInfo, Usage
from ..errors import SessionNotFound
from ..sessions.session import Session
from ..sessions.tenancy import TenantSessions
from .errors import ApiError, to_api_error
from .openai_routes import send_with_tool_choice
from .schemas import Append, CreateCheckpoint, CreateSession, Fork, Sampling, SendMessages
from .sse import EventStream, sse_data

router = APIRouter(prefix="/v1/sessions")


def session_info(s: Session, saved: bool | None = None) -> SessionInfo:
    st = s.state
    named = sorted(n for n in st.checkpoints if not n.startswith("__"))  # "__" names are the engine's own
    return SessionInfo(session_id=s.id, num_tokens=st.num_tokens, checkpoints=named,
                       active=st.resident, saved=st.generation > 0 if saved is None else saved, parent=st.parent)


async def _engine(request: Request) -> TenantSessions:
    """The engine's session API for the caller's tenant: other tenants' sessions do not exist for it."""
    return await request.app.state.engine.for_tenant(request.scope.get("state", {}).get("tenant"))


async def _session(request: Request, session_id: str, *, idle: bool = False) -> Session:
    """The session (loaded from the store if this engine does not hold it). ``idle``: refuse with 409
    instead of queueing behind a request in progress (see server/inflight.py; claim it with ``_claim``)."""
    s = await (await _engine(request)).resume(session_id)
    if idle:
        request.app.state.inflight.check(s.state.tenant, session_id)
    return s


def _claim(request: Request, s: Session) -> AbstractContextManager[None]:
    return request.app.state.inflight.claim(s.state.tenant, s.id)  # type: ignore[no-any-return]


def _created(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=201, headers={"X-Session-Id": model.session_id})


@router.post("", status_code=201, response_model=SessionInfo)
async def create_session(body: CreateSession, request: Request) -> JSONResponse:
    engine = (await _engine(request))
    if body.session_id is not None and (body.session_id in engine.sessions or await _stored(engine, body.session_id)):
        raise ApiError(409, f"session {body.session_id!r} already exists", "session_exists")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    s = await engine.create_session(system=body.system, tools=tools, session_id=body.session_id)
    return _created(session_info(s, saved=False))


async def _stored(engine: TenantSessions, session_id: str) -> bool:
    return any(i.session_id == session_id for i in await engine.list_sessions())


@router.get("")
async def list_sessions(request: Request) -> dict[str, Any]:
    infos = await (await _engine(request)).list_sessions()
    return {"object": "list", "data": [i.model_dump(mode="json") for i in infos]}


@router.get("/{session_id}", response_model=SessionInfo)
async def get_session(session_id: str, request: Request) -> SessionInfo:
    for info in await (await _engine(request)).list_sessions():
        if info.session_id == session_id:
            return info
    raise SessionNotFound(f"no session {session_id!r}")


@router.get("/{session_id}/messages")
async def get_messages(session_id: str, request: Request) -> dict[str, Any]:
    """The session's chat messages and context length (what ``Session.messages`` / ``num_tokens`` give)."""
    s = await _session(request, session_id)
    return {"object": "list", "session_id": s.id, "num_tokens": s.num_tokens, "data": s.messages}


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
    await (await _engine(request)).delete_session(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/resume", response_model=SessionInfo)
async def resume_session(session_id: str, request: Request) -> SessionInfo:
    return session_info(await _session(request, session_id))


@router.post("/{session_id}/messages", response_model=Reply)
async def send_messages(session_id: str, body: SendMessages, request: Request) -> Any:
    s = await _session(request, session_id, idle=True)
    messages, sampling = body.new_messages(), body.sampling()
    if body.stream:
        events = request.app.state.inflight.claimed_stream(s.state.tenant, s.id, _events(s, messages, sampling))
        return EventStream(events, headers={"X-Session-Id": s.id})
    with _claim(request, s):
        return await send_with_tool_choice(s, messages, sampling, body.tool_choice)


async def _events(s: Session, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> AsyncIterator[bytes]:
    gen = s.stream(messages, **sampling)
    try:
        async for ev in gen:
            yield sse_data(ev.model_dump(mode="json"), event=ev.type)
    except Exception as e:
        yield sse_data(to_api_error(e).body(), event="error")
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


@router.post("/{session_id}/generate", response_model=Reply)
async def generate(session_id: str, body: Sampling, request: Request) -> Reply:
    s = await _session(request, session_id, idle=True)
    with _claim(request, s):
        return await s.generate(**body.sampling())


@router.post("/{session_id}/append", response_model=Usage)
async def append(session_id: str, body: Append, request: Request) -> Usage:
    s = await _session(request, session_id, idle=True)
    with _claim(request, s):
        return await s.append(body.tokens)


@router.post("/{session_id}/checkpoints", status_code=201, response_model=CheckpointInfo)
async def checkpoint(session_id: str, body: CreateCheckpoint, request: Request) -> CheckpointInfo:
    s = await _session(request, session_id)
    return await s.checkpoint(body.name)


@router.post("/{session_id}/fork", status_code=201, response_model=SessionInfo)
async def fork(session_id: str, body: Fork, request: Request) -> JSONResponse:
    engine = (await _engine(request))
    if body.session_id is not None and body.session_id in engine.sessions:
        raise ApiError(409, f"session {body.session_id!r} already exists", "session_exists")
    child = await engine.fork(session_id, body.checkpoint, new_id=body.session_id)
    return _created(session_info(child, saved=False))


@router.post("/{session_id}/save")
async def save(session_id: str, request: Request) -> dict[str, Any]:
    s = await _session(request, session_id)
    result = await s.save()
    return {"session_id": s.id, **dataclasses.asdict(result)}
