"""A real uvicorn server on a free loopback port, in a background thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from kda_sessions.server import ServerSettings, build_app

API_KEY = "test-key-0123456789"
# a chat request's system message and one tool, shared by the OpenAI-protocol tests
SYSTEM = {"role": "system", "content": "You are a coding agent."}
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


class ServerThread:
    def __init__(self, settings: ServerSettings) -> None:
        self.app = build_app(None, settings)
        config = uvicorn.Config(self.app, host=settings.host, port=0, lifespan="on", log_level="warning",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server(**overrides) -> ServerThread:
    settings = ServerSettings(**{"model": "tiny-random", "store": "memory:", **overrides})
    return ServerThread(settings).start()


