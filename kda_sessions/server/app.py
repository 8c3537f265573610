"""The FastAPI app and how to run it on uvicorn. The engine is opened inside the server's event loop
(it captures that loop to deliver results from its step thread) and closed when the server stops."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..api import Engine
from ..dtypes import resolve_dtype
from .auth import check_bind
from .errors import install_error_handlers
from .inflight import InFlight
from .metrics import CONTENT_TYPE, Metrics
from .middleware import GuardMiddleware
from .openai_routes import router as openai_router
from .session_routes import router as session_router
from .settings import ServerSettings
from .stateless import StatelessSessions

log = logging.getLogger(__name__)


def build_app(engine: Engine | None, settings: ServerSettings) -> FastAPI:
    """The app. With ``engine=None`` the app opens one from ``settings`` at startup and closes it at
    shutdown; a given engine must have been opened on the loop the server will run on, and stays open."""
    check_bind(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = engine is None
        eng = engine or await Engine.open(model=settings.model, store=settings.store, device=settings.device,
                                          dtype=resolve_dtype(settings.dtype, settings.device), config=settings.engine)
        app.state.engine = eng
        log.info("serving %s (store %s) on %s:%d", settings.model_name, settings.store, settings.host, settings.port)
        try:
            yield
        finally:
            if owned:
                await eng.close()

    app = FastAPI(title="kda-sessions", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics = Metrics()
    app.state.started = int(time.time())
    app.state.inflight = InFlight()
    app.state.stateless = StatelessSessions(settings.stateless_session_ttl_s, settings.max_stateless_sessions,
                                            save=settings.save_chat_sessions, retention_s=settings.chat_session_retention_s)
    if engine is not None:
        app.state.engine = engine
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(session_router)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        eng = getattr(request.app.state, "engine", None)
        ok = eng is not None and not eng.closed
        return {"status": "ok" if ok else "starting", "model": settings.model_name}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus(request: Request) -> PlainTextResponse:
        eng: Engine = request.app.state.engine
        return PlainTextResponse(metrics.render(eng.stats(), list(eng.resume_seconds)), media_type=CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return request.app.state.engine.stats()

    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    return app


def uvicorn_config(app: FastAPI, settings: ServerSettings) -> Any:
    import uvicorn

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          lifespan="on", timeout_graceful_shutdown=5)


async def serve(settings: ServerSettings) -> None:
    """Run the server in the current event loop until it is stopped (Ctrl-C / SIGTERM)."""
    import uvicorn

    check_bind(settings)
    await uvicorn.Server(uvicorn_config(build_app(None, settings), settings)).serve()


def run_server(settings: ServerSettings) -> None:
    """Blocking entry point for the CLI."""
    import anyio

    anyio.run(serve, settings)
