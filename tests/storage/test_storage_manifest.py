"""Manifest schema: round trip, validation, version and fingerprint checks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from storage_helpers import FINGERPRINT, make_snapshot

from kda_sessions.storage.errors import IncompatibleSnapshot, IntegrityError
from kda_sessions.storage.manifest import FORMAT_VERSION, ModelFingerprint, SessionManifest


def test_round_trip_and_blob_digests() -> None:
    m, blobs = make_snapshot("s1", num_tokens=10)
    again = SessionManifest.loads(m.dumps())
    assert again == m
    assert again.blob_digests() == set(blobs)
    assert again.checkpoint("head") is again.head
    assert again.checkpoint("cp0").position == 4


def test_bad_json_is_integrity_error() -> None:
    with pytest.raises(IntegrityError, match="JSON"):
        SessionManifest.loads(b"{not json")
    with pytest.raises(IntegrityError):
        SessionManifest.loads(b"[]")


def _mutated(**changes: object) -> bytes:
    raw = json.loads(make_snapshot("s1", num_tokens=10)[0].dumps())
    raw.update(changes)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "changes",
    [
        {"tokens_blob": "ab" * 31},
        {"tokens_blob": "AB" * 32},
        {"session_id": "../etc/passwd"},
        {"session_id": ""},
        {"num_tokens": "10"},
        {"num_tokens": 11},  # head.position no longer matches
        {"unknown_field": 1},
        {"fingerprint": {"model_id": "m"}},
    ],
    ids=[
        "short-digest",
        "uppercase-digest",
        "path-session-id",
        "empty-session-id",
        "string-int",
        "head-not-at-end",
        "unknown-field",
        "partial-fingerprint",
    ],
)
def test_schema_violations_are_integrity_errors(changes: dict[str, object]) -> None:
    with pytest.raises(IntegrityError, match="invalid"):
        SessionManifest.loads(_mutated(**changes))


def test_page_count_must_cover_position() -> None:
    m, _ = make_snapshot("s1", num_tokens=10)
    raw = json.loads(m.dumps())
    raw["head"]["pages"] = raw["head"]["pages"][:-1]
    with pytest.raises(IntegrityError, match="pages"):
        SessionManifest.loads(json.dumps(raw))


def test_other_format_version_is_incompatible() -> None:
    with pytest.raises(IncompatibleSnapshot, match=f"expected {FORMAT_VERSION}"):
        SessionManifest.loads(_mutated(format_version=FORMAT_VERSION + 1))


@pytest.mark.parametrize("field", ["model_id", "config_hash", "dtype", "page_size"])
def test_check_compatible_names_the_field(field: str) -> None:
    m, _ = make_snapshot("s1", num_tokens=3)
    m.check_compatible(FINGERPRINT)
    other = FINGERPRINT.model_copy(update={field: 999 if field == "page_size" else "other"})
    with pytest.raises(IncompatibleSnapshot, match=field):
        m.check_compatible(other)


def test_constructor_validates_ids() -> None:
    with pytest.raises(ValidationError):
        ModelFingerprint(model_id="m", config_hash="h", dtype="float32", page_size=0)
    m, _ = make_snapshot("s1", num_tokens=3)
    with pytest.raises(ValidationError):
        SessionManifest.model_validate({**m.model_dump(), "session_id": "a/b"})


def test_bytes_as_dumps_wrote_them_parse_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dumps`'s own bytes load without the general path's JSON pre-parse (`_loads_as_written`); a flipped byte
    in them, or the same content written otherwise, goes the general way and is checked as before."""
    from kda_sessions.storage import manifest as manifest_module

    m, _ = make_snapshot("s1", num_tokens=10)
    data = m.dumps()
    real_loads = json.loads
    calls: list[int] = []
    monkeypatch.setattr(manifest_module.json, "loads", lambda s: calls.append(1) or real_loads(s))
    assert SessionManifest.loads(data) == m and calls == []
    i = data.index(m.tokens_blob.encode())
    flipped = data[:i] + (b"0" if data[i : i + 1] != b"0" else b"1") + data[i + 1 :]
    with pytest.raises(IntegrityError, match="checksum"):
        SessionManifest.loads(flipped)
    assert calls == [1]
    spaced = json.dumps(real_loads(data)).encode()  # the same fields and checksum, other whitespace
    assert SessionManifest.loads(spaced) == m and calls == [1, 1]
    newer = data.replace(b'"format_version":1', b'"format_version":2')
    with pytest.raises(IncompatibleSnapshot):
        SessionManifest.loads(newer)
