"""The session manifest: the one small JSON document that names every blob of a snapshot.

Writing the manifest is the commit point of a save (blobs first, manifest last). Everything that comes from
the store is validated here: digests are 64 lowercase hex characters and session ids match
`[A-Za-z0-9_-]{1,128}`, so both are safe to use in file paths and Redis keys.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import IncompatibleSnapshot, IntegrityError

FORMAT_VERSION = 1
_CHECKSUM_FIELD = b',"checksum":"'
"""What `SessionManifest.dumps` writes before the checksum, the last field."""
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"

Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]


class _Strict(BaseModel):
    # Unknown fields are refused: a manifest this version does not fully understand must not be trusted.
    model_config = ConfigDict(extra="forbid")


class ModelFingerprint(_Strict):
    """What a snapshot's tensors depend on; a snapshot loads only into an equal fingerprint."""

    model_id: str
    config_hash: str
    dtype: str
    page_size: Annotated[int, Field(gt=0)]


class CheckpointRecord(_Strict):
    """The prefix of `position` tokens, with the model state after `state_position` of them.

    `state_position <= position` (None means equal): the few tokens in between are fed again by whoever
    continues from here (a reply's last token, say, whose state did not exist yet when it was recorded).
    `state_blob` is the digest of the tensor bundle of KDA states + conv tails at `state_position`; `pages` are
    the digests of the MLA KV page blobs covering tokens [0, state_position): full pages, then possibly one
    partial last page, so `len(pages) == ceil(state_position / page_size)`. `num_messages` and `turn_open`
    describe the chat at that point (messages[:num_messages]; whether an assistant turn is still open).
    """

    name: str
    position: Annotated[int, Field(ge=0)]
    state_position: Annotated[int, Field(ge=0)] | None = None
    state_blob: Digest
    pages: list[Digest]
    created_at: float
    num_messages: Annotated[int, Field(ge=0)] = 0
    turn_open: bool = False

    @model_validator(mode="after")
    def _state_within_prefix(self) -> CheckpointRecord:
        if self.state_position is None:
            self.state_position = self.position
        if self.state_position > self.position:
            raise ValueError(f"checkpoint {self.name!r}: state_position {self.state_position} > position {self.position}")
        return self

    @property
    def state_pos(self) -> int:
        assert self.state_position is not None
        return self.state_position


class SessionManifest(_Strict):
    """A saved session: token history, the head state, named checkpoints and free-form chat metadata."""

    format_version: int = FORMAT_VERSION
    session_id: SessionId
    fingerprint: ModelFingerprint
    tokens_blob: Digest
    """Digest of the int32 token-id tensor `[num_tokens]` (encode_tensor format)."""
    num_tokens: Annotated[int, Field(ge=0)]
    head: CheckpointRecord
    checkpoints: list[CheckpointRecord] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)
    """JSON-serializable chat state: system prompt, tools, messages."""
    parent: SessionId | None = None
    generation: Annotated[int, Field(ge=0)] = 0
    """Incremented on each save; the basis of a later compare-and-set."""
    saved_at: float
    checksum: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(default=None, exclude=True)
    """sha256 of the manifest's canonical JSON without this field; written by `dumps`, verified and cleared by
    `loads`. The schema alone cannot notice a flipped bit in a timestamp or a message; this does."""

    @model_validator(mode="after")
    def _check_positions(self) -> SessionManifest:
        if self.head.position != self.num_tokens:
            raise ValueError(
                f"head.position must equal num_tokens={self.num_tokens}, got {self.head.position}"
            )
        page_size = self.fingerprint.page_size
        for cp in (self.head, *self.checkpoints):
            if cp.position > self.num_tokens:
                raise ValueError(
                    f"checkpoint {cp.name!r} at {cp.position} is past num_tokens={self.num_tokens}"
                )
            need = math.ceil(cp.state_pos / page_size)
            if len(cp.pages) != need:
                raise ValueError(
                    f"checkpoint {cp.name!r} with state at {cp.state_pos} needs {need} pages of {page_size} tokens, "
                    f"has {len(cp.pages)}"
                )
        return self

    def blob_digests(self) -> set[str]:
        """Every blob digest this manifest references."""
        out = {self.tokens_blob}
        for cp in (self.head, *self.checkpoints):
            out.add(cp.state_blob)
            out.update(cp.pages)
        return out

    def checkpoint(self, name: str) -> CheckpointRecord:
        """The checkpoint called `name` (the head answers to "head"); KeyError naming it if absent."""
        if name == "head":
            return self.head
        for cp in self.checkpoints:
            if cp.name == name:
                return cp
        raise KeyError(f"session {self.session_id!r} has no checkpoint {name!r}")

    def check_compatible(self, expected: ModelFingerprint) -> None:
        """Raise IncompatibleSnapshot naming the first field that differs from `expected`."""
        if self.format_version != FORMAT_VERSION:
            raise IncompatibleSnapshot(
                f"session {self.session_id!r}: format_version {self.format_version}, expected {FORMAT_VERSION}"
            )
        for field in ModelFingerprint.model_fields:
            got, want = getattr(self.fingerprint, field), getattr(expected, field)
            if got != want:
                raise IncompatibleSnapshot(
                    f"session {self.session_id!r} was saved with {field}={got!r}, this engine has {want!r}"
                )

    @classmethod
    def _loads_as_written(cls, data: bytes | str) -> SessionManifest | None:
        """The manifest of bytes exactly as `dumps` writes them (the body, then as the last field a checksum that
        matches it), validated once: without the JSON pre-parse and the re-serialisation that the general path
        needs to check a checksum (at 1M tokens a manifest is ~36 MB of page digests: ~0.2 s of the ~0.4 s a
        parse takes). None for anything else: the general path then parses it and says what is wrong."""
        n = len(_CHECKSUM_FIELD) + 66  # ,"checksum":" + 64 hex digits + "}
        if not isinstance(data, bytes) or len(data) <= n or data[-n:-66] != _CHECKSUM_FIELD or data[-2:] != b'"}':
            return None
        body = hashlib.sha256(memoryview(data)[:-n])
        body.update(b"}")
        if body.hexdigest().encode() != data[-66:-2]:
            return None
        try:
            m = cls.model_validate_json(data, strict=True)
        except ValidationError:
            return None
        if m.format_version != FORMAT_VERSION:
            return None
        m.checksum = None
        return m

    def dumps(self) -> bytes:
        """The manifest as compact UTF-8 JSON, its checksum as the last field."""
        body = self.model_dump_json().encode()  # `checksum` is excluded from dumps
        return body[:-1] + _CHECKSUM_FIELD + hashlib.sha256(body).hexdigest().encode() + b'"}'


    @classmethod
    def loads(cls, data: bytes | str) -> SessionManifest:
        """Parse and validate a manifest.

        IntegrityError on bad JSON or a schema violation; IncompatibleSnapshot on another format_version.
        """
        written = cls._loads_as_written(data)
        if written is not None:
            return written
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IntegrityError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise IntegrityError(f"manifest must be a JSON object, got {type(raw).__name__}")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise IncompatibleSnapshot(
                f"manifest of session {raw.get('session_id')!r:.140} has format_version {version!r:.20}, "
                f"expected {FORMAT_VERSION}"
            )
        try:
            # strict: stored JSON must already have the right types ("3" is not a page size).
            m = cls.model_validate_json(data, strict=True)
        except ValidationError as e:
            raise IntegrityError(f"manifest of session {raw.get('session_id')!r:.140} is invalid: {e}") from e
        if m.checksum is not None:
            actual = hashlib.sha256(m.model_dump_json().encode()).hexdigest()
            if actual != m.checksum:
                raise IntegrityError(
                    f"manifest of session {m.session_id!r}: content has sha256 {actual}, its checksum says "
                    f"{m.checksum}; corrupt"
                )
            m.checksum = None
        return m
