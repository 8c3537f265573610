"""Every error kda_sessions raises on purpose, in one place; all derive from ``KdaSessionsError``.

This module imports nothing of the package, so every layer (storage included) can raise these. The modules
that defined them before (``storage.errors``, ``engine.pool``, ``engine.scheduler``, ``config``,
``model.loader``, ``client``) re-export them, so older imports keep working. Each keeps the builtin base it
had (``ValueError``, ``RuntimeError``, ``KeyError``, ...), so ``except ValueError`` still catches a
``ConfigError``. Importing this module does not import torch.
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


class SessionNotFound(KdaSessionsError, KeyError):
    """No session with that id in this engine or its store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "session not found"


class CheckpointNotFound(KdaSessionsError, KeyError):
    """The session has no checkpoint of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "checkpoint not found"


class ConfigError(KdaSessionsError, ValueError):
    """A model config that is malformed or does not add up; the message names the field."""


class CheckpointError(KdaSessionsError, ValueError):
    """Model weights with missing, unexpected or mis-shaped tensors, or unreadable files; the message lists the names."""


class EngineBusy(KdaSessionsError, RuntimeError):
    """Too many requests are queued; retry later (HTTP 429/503)."""


class OutOfSlots(KdaSessionsError, RuntimeError):
    """No free KDA state slot; the engine answers busy or evicts an idle session."""


class OutOfPages(KdaSessionsError, RuntimeError):
    """No free KV page; the engine answers busy or evicts an idle session."""


class AuthenticationError(KdaSessionsError, PermissionError):
    """The server refused the API key (HTTP 401)."""


class ServerError(KdaSessionsError):
    """The server failed (HTTP 5xx other than 503) or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnreachable(KdaSessionsError, ConnectionError):
    """No connection to the server (after retries, for idempotent calls)."""


class TokenizerNotFound(KdaSessionsError, ValueError):
    """Neither a built-in name nor a directory with a tokenizer file."""

    def __init__(
        self, path_or_name: str, looked_for: tuple[str, ...], builtin_names: tuple[str, ...] = ()
    ) -> None:
        self.path_or_name = path_or_name
        self.looked_for = looked_for
        super().__init__(
            f"no tokenizer for {path_or_name!r}: not a built-in name {list(builtin_names)} and no "
            f"{' or '.join(looked_for)} in that directory"
        )


class ChatTemplateError(KdaSessionsError, ValueError):
    """Messages the template cannot render, or a template that cannot render incrementally."""


class ToolCallParseError(KdaSessionsError, ValueError):
    """A malformed tool-call envelope: returned in a list, not raised. `raw` is the offending text."""

    def __init__(self, reason: str, raw: str = "") -> None:
        self.reason = reason
        self.raw = raw
        super().__init__(f"{reason}: {raw!r}" if raw else reason)


class ToolError(KdaSessionsError, ValueError):
    """A tool call that cannot run (unknown tool, bad arguments, path outside the root)."""


class InsecureBindError(KdaSessionsError, RuntimeError):
    """The server would listen beyond this machine with no API key."""


__all__ = [
    "AuthenticationError",
    "BlobNotFound",
    "ChatTemplateError",
    "CheckpointError",
    "CheckpointNotFound",
    "ConfigError",
    "EngineBusy",
    "IncompatibleSnapshot",
    "InsecureBindError",
    "IntegrityError",
    "KdaSessionsError",
    "ManifestNotFound",
    "OutOfPages",
    "OutOfSlots",
    "ServerError",
    "ServerUnreachable",
    "SessionBusy",
    "SessionNotFound",
    "SnapshotConflict",
    "StoreError",
    "StoreUnavailable",
    "TokenizerNotFound",
    "ToolCallParseError",
    "ToolError",
]
