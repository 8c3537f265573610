"""The public types under their older import path; they are defined in ``kda_sessions.types``."""

from __future__ import annotations

from ..types import (
    CheckpointInfo,
    Done,
    FinishReason,
    Reply,
    SessionInfo,
    StreamEvent,
    TokenDelta,
    ToolCallEvent,
    Usage,
)

__all__ = [
    "CheckpointInfo",
    "Done",
    "FinishReason",
    "Reply",
    "SessionInfo",
    "StreamEvent",
    "TokenDelta",
    "ToolCallEvent",
    "Usage",
]
