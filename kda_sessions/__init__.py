"""kda_sessions: durable, resumable, forkable sessions for coding agents on a hybrid KDA + MLA model."""

from .client import Client
from .config import ConfigError, ModelConfig
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.pool import OutOfPages, OutOfSlots
from .engine.sampler import SamplingParams
from .engine.scheduler import EngineBusy
from .engine.types import (
    CheckpointInfo,
    Done,
    Reply,
    SessionInfo,
    StreamEvent,
    TokenDelta,
    ToolCallEvent,
    Usage,
)
from .errors import (
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
from .model import CheckpointError, HybridModel, load_model, save_model
from .sessions.session import Session

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
