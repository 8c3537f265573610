"""The HTTP surface: OpenAI-compatible chat completions, the ``/v1/sessions`` routes, health and metrics."""

from .app import build_app, run_server, serve
from .auth import InsecureBindError
from .settings import ServerSettings

__all__ = ["InsecureBindError", "ServerSettings", "build_app", "run_server", "serve"]
