"""hypothesis on json_prefix, the byte-level JSON-schema guide of constrained tool-call decoding: any bytes give
an answer, never an exception; "complete" documents parse and validate; every prefix of a valid compact document
is "incomplete" with its next byte allowed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_sessions.constrain.json_prefix import json_prefix
from kda_sessions.tokenizer import validate_arguments

# a short run per test: examples are drawn afresh on every run (not derandomized), so runs add up
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Tool parameter schemas within the supported subset (always an object at the top, as tool arguments are).
SCHEMAS: dict[str, dict[str, Any]] = {
    "read_file": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                  "required": ["path"], "additionalProperties": False},
    "open_object": {"type": "object"},
    "nested": {"type": "object", "properties": {
        "files": {"type": "array", "items": {"type": "object", "properties": {
            "path": {"type": "string"}, "mode": {"type": "string", "enum": ["r", "w", "a+", "é"]}},
            "required": ["path", "mode"], "additionalProperties": False}},
        "dry_run": {"type": "boolean"}, "scale": {"type": "number"}, "note": {"type": ["string", "null"]}},
        "required": ["files"], "additionalProperties": False},
    "extra_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                     "additionalProperties": {"type": "array", "items": {"type": "number"}}},
    "extra_allowed": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
                      "additionalProperties": True},
    "no_props_enum": {"type": "object", "properties": {"level": {"enum": ["low", "high"]},
                                                       "tags": {"type": "array", "items": {"type": "string"}}},
                      "additionalProperties": False},
}

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), text),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6)


def value_of(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for ``schema`` (the subset above)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([value_of({**schema, "type": x}) for x in t])
    if t == "string":
        return text
    if t == "integer":
        return st.integers(min_value=-(10**12), max_value=10**12)
    if t == "number":
        return st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(value_of(schema.get("items") or {}), max_size=3)
    if t == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        extra = schema.get("additionalProperties", not props)
        fixed = st.fixed_dictionaries({k: value_of(v) for k, v in props.items() if k in required},
                                      optional={k: value_of(v) for k, v in props.items() if k not in required})
        if extra is False:
            return fixed
        extra_values = value_of(extra) if isinstance(extra, dict) else any_json
        more = st.dictionaries(text.filter(lambda k: k not in props), extra_values, max_size=2)
        return st.tuples(more, fixed).map(lambda pair: {**pair[0], **pair[1]})
    return any_json


def compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@st.composite
def valid_document(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(SCHEMAS)))
    return name, compact(draw(value_of(SCHEMAS[name])))


@FUZZ
@given(case=valid_document())
def test_fuzz_json_prefix_accepts_every_prefix_of_a_valid_document(case: tuple[str, bytes]) -> None:
    name, doc = case
    schema = SCHEMAS[name]
    assert validate_arguments(doc.decode(), schema) == []
    for i in range(len(doc)):
        verdict, allowed = json_prefix(doc[:i], schema)
        assert verdict == "incomplete", (name, doc[:i])
        assert doc[i] in allowed, (name, doc[:i], bytes([doc[i]]), sorted(allowed))
    assert json_prefix(doc, schema) == ("complete", set())


def _utf8(buf: bytes) -> bool:
    try:
        buf.decode()
    except UnicodeDecodeError:
        return False
    return True


def _check_verdict(buf: bytes, schema: dict[str, Any]) -> None:
    verdict, allowed = json_prefix(buf, schema)
    assert verdict in ("bad", "incomplete", "complete")
    if verdict == "complete" and not _utf8(buf):
        return  # a known gap, asserted by test_fuzz_json_prefix_rejects_invalid_utf8
    if verdict == "complete":
        value = json.loads(buf)
        assert validate_arguments(buf.decode(), schema) == [], (buf, value)
    elif verdict == "incomplete":
        assert allowed and all(0 <= b <= 255 for b in allowed)
    else:
        assert not allowed


@FUZZ
@given(name=st.sampled_from(sorted(SCHEMAS)), buf=st.binary(max_size=48))
def test_fuzz_json_prefix_any_bytes(name: str, buf: bytes) -> None:
    _check_verdict(buf, SCHEMAS[name])


@FUZZ
@given(case=valid_document(), edits=st.lists(st.tuples(st.integers(min_value=0), st.sampled_from(["ins", "del", "set"]),
                                                         st.sampled_from(list(b'{}[]",:\\-.0123456789eEtfnuxa \x80\xc3\xa9'))),
                                               min_size=1, max_size=3))
def test_fuzz_json_prefix_mutated_documents(case: tuple[str, bytes], edits: list[tuple[int, str, int]]) -> None:
    name, doc = case
    buf = bytearray(doc)
    for pos, op, byte in edits:
        i = pos % (len(buf) + 1)
        if op == "ins":
            buf.insert(i, byte)
        elif buf and op == "del":
            del buf[min(i, len(buf) - 1)]
        elif buf:
            buf[min(i, len(buf) - 1)] = byte
    _check_verdict(bytes(buf), SCHEMAS[name])


@FUZZ
@given(name=st.sampled_from(sorted(SCHEMAS)), seed=st.randoms(use_true_random=False))
def test_fuzz_json_prefix_walk_allowed_bytes(name: str, seed: Any) -> None:
    """Constrained decoding's view: always picking an allowed byte never reaches "bad"."""
    schema = SCHEMAS[name]
    buf = b""
    for _ in range(64):
        verdict, allowed = json_prefix(buf, schema)
        assert verdict != "bad", buf
        if verdict == "complete":
            _check_verdict(buf, schema)
            return
        # lead bytes whose second byte has a narrower range are a known gap (see the invalid UTF-8 test)
        buf += bytes([seed.choice(sorted(allowed - {0xE0, 0xED, 0xF0, 0xF4}))])


@pytest.mark.parametrize("name", ["extra_allowed", "extra_schema"])
def test_fuzz_json_prefix_escaped_key_is_checked_against_its_property(name: str) -> None:
    schema = SCHEMAS[name]
    buf = b'{"flag":true,"\\u0066lag":"yes"}' if name == "extra_allowed" else b'{"\\u006e":[1.5]}'
    _check_verdict(buf, schema)


@pytest.mark.parametrize("bad_utf8", [b"\xe0\x80\x80", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xed\xa0\x80"],
                         ids=["overlong-3", "overlong-4", "above-U+10FFFF", "surrogate"])
def test_fuzz_json_prefix_rejects_invalid_utf8(bad_utf8: bytes) -> None:
    buf = b'{"a":"' + bad_utf8 + b'"}'
    assert json_prefix(buf, SCHEMAS["open_object"])[0] == "bad"
    # and it is never offered: after the lead byte, the bad continuation is not allowed
    verdict, allowed = json_prefix(b'{"a":"' + bad_utf8[:1], SCHEMAS["open_object"])
    assert verdict == "incomplete" and bad_utf8[1] not in allowed


def test_fuzz_json_prefix_enum_escape_allows_only_enum_continuations() -> None:
    schema = {"type": "object", "properties": {"m": {"enum": ["a\n"]}}, "additionalProperties": False}
    verdict, allowed = json_prefix(b'{"m":"a\\', schema)
    assert verdict == "incomplete"
    assert allowed == {ord("n")}
