"""Which bytes may come next in a JSON document that must validate against a (tool parameter) schema.

``json_prefix(buf, schema)`` parses ``buf`` and answers ("bad" | "incomplete" | "complete", allowed next
bytes). It drives constrained decoding of tool-call arguments: the model may only pick tokens that keep the
arguments a valid prefix. Supported schema subset: type (object, array, string, number, integer, boolean,
null, or a list of them), properties, required, additionalProperties, items, enum of strings; other keywords
are not enforced while decoding (the finished call is still validated). Outside strings the only whitespace
allowed is one optional space after a ``:`` or a ``,``: compact JSON and ``json.dumps``'s default separators both
pass (models learn one or the other), and the model cannot pad forever.

``check_schema(schema, where)`` is the admission check: it refuses (ValueError naming the keyword's path) a
schema outside that subset's shapes, or one with a part that admits no value (an empty or unknown type, an
empty enum, a required property that additionalProperties forbids), because decoding would reach a point where
no byte is allowed. A schema it accepts never leaves the decoder without a next byte.
"""

from __future__ import annotations

import json
from typing import Any

_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_FIRST = {
    "object": b"{",
    "array": b"[",
    "string": b'"',
    "number": b"-0123456789",
    "integer": b"-0123456789",
    "boolean": b"tf",
    "null": b"n",
}


class _Eof(Exception):
    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed


class _Bad(Exception):
    pass


MAX_SCHEMA_DEPTH = 32
"""Nesting accepted in a tool schema (the decoder's parser recurses once per level)."""


def check_schema(schema: Any, where: str = "parameters", depth: int = 0) -> None:
    """ValueError naming ``where.keyword`` if ``schema`` is not one the decoder can always finish (module doc)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    t = schema.get("type")
    if t is not None:
        names = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if names is None or not names or not all(isinstance(x, str) for x in names):
            raise ValueError(f"{where}.type must be a type name or a non-empty list of them, got {t!r}")
        unknown = [x for x in names if x not in _FIRST]
        if unknown:
            raise ValueError(f"{where}.type: unknown type {unknown[0]!r}; known: {sorted(_FIRST)}")
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not enum:
            raise ValueError(f"{where}.enum must be a non-empty list, got {enum!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}.properties must be an object, got {type(props).__name__}")
    for name, sub in props.items():
        check_schema(sub, f"{where}.properties.{name}", depth + 1)
    extra = _extra(schema)
    if isinstance(extra, dict):
        check_schema(extra, f"{where}.additionalProperties", depth + 1)
    elif not isinstance(extra, bool):
        raise ValueError(f"{where}.additionalProperties must be a boolean or a schema, got {extra!r}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of property names, got {required!r}")
    if "object" in _types(schema):
        barred = [r for r in required if r not in props and extra is False]
        if barred:
            raise ValueError(f"{where}.required names {barred[0]!r}, which additionalProperties false forbids: "
                             "no object satisfies this schema")
    items = schema.get("items")
    if isinstance(items, dict):
        check_schema(items, f"{where}.items", depth + 1)
    elif items is not None and not isinstance(items, (list, bool)):
        raise ValueError(f"{where}.items must be a schema, got {items!r}")


def check_top_level(schema: Any, where: str) -> None:
    """``check_schema`` for a whole document: nothing follows a top-level number, so it could never be seen
    to end; a schema that allows one is refused."""
    check_schema(schema, where)
    numeric = sorted({"number", "integer"} & set(_types(schema)))
    if numeric:
        raise ValueError(f"{where} allows a bare {numeric[0]} at the top level, which constrained decoding cannot "
                         "end; declare an object (or an array) around it")


def _extra(schema: dict[str, Any]) -> Any:
    """additionalProperties; unset, extra keys are allowed only where no properties are declared or a required
    name is not among them (compact output: a model given named properties writes those)."""
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    return schema.get("additionalProperties", not props or any(r not in props for r in required))


def _types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t] if t in _FIRST else []
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str) and x in _FIRST]
    if "properties" in schema:
        return ["object"]
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return ["string"]
    return list(_FIRST)


class _Parser:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.i = 0

    def peek(self, allowed: set[int] | frozenset[int]) -> int:
        if self.i >= len(self.buf):
            raise _Eof(set(allowed))
        return self.buf[self.i]

    def take(self, allowed: set[int] | frozenset[int]) -> int:
        c = self.peek(allowed)
        if c not in allowed:
            raise _Bad
        self.i += 1
        return c

    def space(self, then: set[int] | frozenset[int]) -> None:
        """One optional space (after a separator), then a byte of ``then``."""
        if self.peek(set(then) | {ord(" ")}) == ord(" "):
            self.i += 1

    def value(self, schema: dict[str, Any], follow: set[int]) -> None:
        types = _types(schema)
        first = {b for t in types for b in _FIRST[t]}
        c = self.peek(first)
        if c not in first:
            raise _Bad
        if c == ord("{"):
            self.obj(schema)
        elif c == ord("["):
            self.array(schema)
        elif c == ord('"'):
            enum = schema.get("enum")
            self.string([json.dumps(v, ensure_ascii=False)[1:-1].encode() for v in enum] if enum else None)
        elif c in b"tfn":
            lit = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}[c]
            for b in lit:
                self.take({b})
        else:
            self.number("number" in types, follow)

    def obj(self, schema: dict[str, Any]) -> None:
        self.take({ord("{")})
        props: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        extra = _extra(schema)
        seen: set[str] = set()
        while True:
            left = [k for k in props if k not in seen]
            can_key = bool(left) or extra is not False
            can_close = required <= seen
            allowed = ({ord('"')} if can_key else set()) | ({ord("}")} if can_close else set())
            c = self.take(allowed)
            if c == ord("}"):
                return
            self.i -= 1
            key = self.string([json.dumps(k, ensure_ascii=False)[1:-1].encode() for k in left] if extra is False else None,
                              exclude=seen)
            if key in seen:
                raise _Bad
            seen.add(key)
            self.take({ord(":")})
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            self.space({b for t in _types(sub) for b in _FIRST[t]})
            more = bool([k for k in props if k not in seen]) or extra is not False
            follow = ({ord(",")} if more else set()) | ({ord("}")} if required <= seen else set())
            self.value(sub, follow)
            c = self.take(follow)
            if c == ord("}"):
                return
            self.space({ord('"')})
            self.peek({ord('"')})

    def array(self, schema: dict[str, Any]) -> None:
        self.take({ord("[")})
        raw = schema.get("items")
        items: dict[str, Any] = raw if isinstance(raw, dict) else {}
        first = {b for t in _types(items) for b in _FIRST[t]}
        c = self.peek(first | {ord("]")})
        if c == ord("]"):
            self.i += 1
            return
        while True:
            self.value(items, {ord(","), ord("]")})
            if self.take({ord(","), ord("]")}) == ord("]"):
                return
            self.space(first)

    def string(self, options: list[bytes] | None, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """A string, returned decoded; with ``options`` (JSON-encoded enum values or property names) its raw bytes
        must spell one of them exactly; it may not end as one of ``exclude`` (keys already in the object)."""
        self.take({ord('"')})
        start = self.i
        if options is not None:
            while True:
                got = self.buf[start : self.i]
                live = [o for o in options if o.startswith(got)]
                allowed = {o[len(got)] for o in live if len(o) > len(got)}
                if got in live:  # JSON encodings never hold a bare quote, so a quote here ends the string
                    allowed.add(ord('"'))
                if self.take(allowed) == ord('"') and got in live:
                    return str(json.loads(self.buf[start - 1 : self.i]))
        need = 0  # UTF-8 continuation bytes still expected
        lo, hi = 0x80, 0xBF  # the range of the next continuation byte (narrower right after some lead bytes)
        while True:
            if need:
                self.take(set(range(lo, hi + 1)))
                need -= 1
                lo, hi = 0x80, 0xBF
                continue
            allowed = set(range(0x20, 0x80)) | set(range(0xC2, 0xF5))
            if exclude and _decoded(self.buf[start : self.i]) in exclude:
                allowed.discard(ord('"'))  # a duplicate key would leave no valid next byte
            c = self.take(allowed)
            if c == ord('"'):  # decoded, so an escaped key is checked against the property it names
                return str(json.loads(self.buf[start - 1 : self.i]))
            if c == ord("\\"):
                if self.take(_ESCAPES) == ord("u"):
                    for _ in range(4):
                        self.take(_HEX)
            elif c >= 0xC2:
                need = 1 if c < 0xE0 else 2 if c < 0xF0 else 3
                # exclude overlong forms, UTF-16 surrogates and code points past U+10FFFF
                lo, hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(c, (0x80, 0xBF))

    def number(self, fraction: bool, follow: set[int]) -> None:
        if self.peek(_DIGITS | {ord("-")}) == ord("-"):
            self.i += 1
        if self.take(_DIGITS) != ord("0"):
            self._digits(follow | ({ord("."), ord("e"), ord("E")} if fraction else set()))
        if not fraction:
            self.peek(follow)
            return
        c = self.peek(follow | {ord("."), ord("e"), ord("E")})
        if c == ord("."):
            self.i += 1
            self.take(_DIGITS)
            self._digits(follow | {ord("e"), ord("E")})
            c = self.peek(follow | {ord("e"), ord("E")})
        if c in (ord("e"), ord("E")):
            self.i += 1
            if self.peek(_DIGITS | {ord("+"), ord("-")}) in (ord("+"), ord("-")):
                self.i += 1
            self.take(_DIGITS)
            self._digits(follow)

    def _digits(self, after: set[int]) -> None:
        while self.peek(_DIGITS | after) in _DIGITS:
            self.i += 1


def _decoded(raw: bytes) -> str | None:
    try:
        return str(json.loads(b'"' + raw + b'"'))
    except ValueError:
        return None


def decoding_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema constrained decoding follows: ``schema`` narrowed so that the shortest way to close every object
    meets its ``required`` (each required name is a declared property, and an object with required names takes no
    other keys). Every value it admits is valid against ``schema``."""
    out = dict(schema)
    props = {k: decoding_schema(v) if isinstance(v, dict) else v for k, v in (schema.get("properties") or {}).items()}
    extra = _extra(schema)
    if isinstance(extra, dict):
        out["additionalProperties"] = extra = decoding_schema(extra)
    required = [r for r in schema.get("required") or [] if isinstance(r, str)]
    for r in required:
        props.setdefault(r, extra if isinstance(extra, dict) else {})
    if props or "properties" in schema:
        out["properties"] = props
    if required:
        out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = decoding_schema(schema["items"])
    return out


def json_prefix(buf: bytes, schema: dict[str, Any]) -> tuple[str, set[int]]:
    """("bad", {}) | ("incomplete", allowed next bytes) | ("complete", {}) for a JSON value of ``schema``."""
    p = _Parser(buf)
    try:
        p.value(schema, set())
    except _Eof as e:
        return ("incomplete", e.allowed) if e.allowed else ("bad", set())
    except _Bad:
        return "bad", set()
    return ("complete", set()) if p.i == len(buf) else ("bad", set())
