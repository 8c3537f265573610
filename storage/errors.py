"""Typed errors of the snapshot store, defined with every other public error in ``kda_sessions.errors``.

All derive from `KdaSessionsError`; storage failures from `StoreError`, a lost writer race from `SessionBusy`.
"""

from __future__ import annotations

from ..errors import (
    BlobNotFound,
    IncompatibleSnapshot,
    IntegrityError,
    KdaSessionsError,
    ManifestNotFound,
    SessionBusy,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "BlobNotFound",
    "IncompatibleSnapshot",
    "IntegrityError",
    "KdaSessionsError",
    "ManifestNotFound",
    "SessionBusy",
    "SnapshotConflict",
    "StoreError",
    "StoreUnavailable",
]
