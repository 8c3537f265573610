"""Typed errors users catch. Storage errors come from ``kda_sessions.storage.errors`` and share the root."""

from __future__ import annotations

from .storage.errors import (
    IncompatibleSnapshot,
    IntegrityError,
    KdaSessionsError,
    SessionBusy,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)


class SessionNotFound(KdaSessionsError, KeyError):
    """No session with that id in this engine or its store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class CheckpointNotFound(KdaSessionsError, KeyError):
    """The session has no checkpoint of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "checkpoint not found"


__all__ = [
    "CheckpointNotFound",
    "IncompatibleSnapshot",
    "IntegrityError",
    "KdaSessionsError",
    "SessionBusy",
    "SessionNotFound",
    "SnapshotConflict",
    "StoreError",
    "StoreUnavailable",
]
