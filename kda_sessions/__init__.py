"""kda_sessions: durable, resumable, forkable sessions for coding agents on a hybrid KDA + MLA model.

The client, the public types and the errors import without torch; the engine and the model (which need torch)
load on first use of ``ks.Engine``, ``ks.Session``, ``ks.HybridModel``, ``ks.load_model`` or ``ks.save_model``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .client import Client
from .config import ModelConfig
from .engine.config import EngineConfig
from .errors import (
    CheckpointError,
    CheckpointNotFound,
    ConfigError,
    EngineBusy,
    IncompatibleSnapshot,
    IntegrityError,
    KdaSessionsError,
    OutOfPages,
    OutOfSlots,
    SessionBusy,
    SessionNotFound,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)
from .types import (
    CheckpointInfo,
    Done,
    Reply,
    SamplingParams,
    SaveResult,
    SessionInfo,
    StreamEvent,
    TokenDelta,
    ToolCallEvent,
    Usage,
)

if TYPE_CHECKING:
    from .api import Engine
    from .model import HybridModel, load_model, save_model
    from .sessions.session import Session

_LAZY = {
    "Engine": "kda_sessions.api",
    "HybridModel": "kda_sessions.model",
    "Session": "kda_sessions.sessions.session",
    "load_model": "kda_sessions.model",
    "save_model": "kda_sessions.model",
}


def __getattr__(name: str) -> Any:
    """Import the torch-backed names on first use, so ``import kda_sessions.client`` stays torch-free."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFound",
    "Client",
    "ConfigError",
    "Done",
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "HybridModel",
    "IncompatibleSnapshot",
    "IntegrityError",
    "KdaSessionsError",
    "ModelConfig",
    "OutOfPages",
    "OutOfSlots",
    "Reply",
    "SamplingParams",
    "SaveResult",
    "Session",
    "SessionBusy",
    "SessionInfo",
    "SessionNotFound",
    "SnapshotConflict",
    "StoreError",
    "StoreUnavailable",
    "StreamEvent",
    "TokenDelta",
    "ToolCallEvent",
    "Usage",
    "load_model",
    "save_model",
]
