"""Typed errors of the snapshot store.

`KdaSessionsError` is the root of every error the project raises on purpose; the engine re-exports it and
derives its own errors (`SessionNotFound`, ...) from it. Storage errors derive from `StoreError`.
"""

from __future__ import annotations


class KdaSessionsError(Exception):
    """Root of every error kda_sessions raises deliberately."""


class StoreError(KdaSessionsError):
    """Something about stored snapshots went wrong."""


class IntegrityError(StoreError):
    """Stored bytes are not what they claim to be.

    A blob whose sha256 does not match its digest, a truncated blob, a tensor header that does not
    describe its payload, or a manifest that is not valid JSON / does not match the schema.
    """


class IncompatibleSnapshot(StoreError):
    """A snapshot made by another model, dtype, page size or format version."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached or failed an IO operation; `__cause__` holds the original error."""


class SessionBusy(KdaSessionsError):
    """Another writer holds the session (its lease in the store is held by another engine and not expired)."""


class SnapshotConflict(SessionBusy):
    """A save lost a compare-and-set: the stored manifest is not the generation this writer last saw.

    Another engine saved (or deleted) the session since; nothing was written. A subclass of SessionBusy, so
    callers that handle "someone else is writing this session" handle both.
    """


class BlobNotFound(StoreError, KeyError):
    """No blob with this digest is stored."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"blob {digest} not found in the store")
        self.digest = digest

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message; keep it readable.
        return str(self.args[0])


class ManifestNotFound(StoreError, KeyError):
    """No manifest is stored for this session id."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no manifest stored for session {session_id!r}")
        self.session_id = session_id

    def __str__(self) -> str:
        return str(self.args[0])
