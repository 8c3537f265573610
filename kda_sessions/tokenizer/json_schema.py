"""A small validator for the JSON-schema subset that tool parameter schemas use.

Supported: type (one or a list of object, string, number, integer, boolean, array, null), properties,
required, enum, const, items, additionalProperties (false or a schema), anyOf. Other keywords are ignored.
"""

from __future__ import annotations

import json
from typing import Any

_TYPE_NAMES = ("object", "string", "number", "integer", "boolean", "array", "null")


def validate_arguments(arguments_json: str, parameters_schema: dict[str, Any]) -> list[str]:
    """Errors of `arguments_json` against a tool's `parameters` schema; [] when it is valid.

    Each error names the path (`$.files[2].path`) and the expectation.
    """
    try:
        value = json.loads(arguments_json)
    except json.JSONDecodeError as e:
        return [f"$: not valid JSON ({e.msg} at position {e.pos})"]
    return validate_value(value, parameters_schema)


def validate_value(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Errors of an already parsed JSON value against `schema`."""
    if not isinstance(schema, dict):
        return [f"{path}: schema must be an object, got {schema!r}"]
    errors: list[str] = []

    expected = schema.get("type")
    if expected is not None:
        types = [expected] if isinstance(expected, str) else list(expected)
        unknown = [t for t in types if t not in _TYPE_NAMES]
        if unknown:
            return [f"{path}: schema has unknown type {unknown}"]
        if not any(_is_type(value, t) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {_type_of(value)}"]

    if "const" in schema and not _json_equal(value, schema["const"]):
        errors.append(f"{path}: expected {json.dumps(schema['const'])}, got {_short(value)}")
    if "enum" in schema and not any(_json_equal(value, v) for v in schema["enum"]):
        errors.append(f"{path}: expected one of {json.dumps(schema['enum'])}, got {_short(value)}")

    if "anyOf" in schema:
        branches = [validate_value(value, sub, path) for sub in schema["anyOf"]]
        if all(branches):
            errors.append(f"{path}: matches none of anyOf ({'; '.join(b[0] for b in branches)})")

    if isinstance(value, dict):
        errors += _validate_object(value, schema, path)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += validate_value(item, schema["items"], f"{path}[{i}]")
    return errors


def _validate_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    errors: list[str] = []
    properties = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in value:
            errors.append(f"{path}: missing required property {name!r}")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        sub_path = f"{path}.{name}"
        if name in properties:
            errors += validate_value(item, properties[name], sub_path)
        elif extra is False:
            errors.append(f"{path}: unexpected property {name!r} (allowed: {sorted(properties)})")
        elif isinstance(extra, dict):
            errors += validate_value(item, extra, sub_path)
    return errors


def _is_type(value: Any, name: str) -> bool:
    # bool is an int in Python but never a JSON number; 1.0 is a JSON integer.
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool):
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, (int, float))  # number


def _type_of(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, name):
            return name
    return type(value).__name__


def _json_equal(a: Any, b: Any) -> bool:
    # True == 1 in Python, not in JSON.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
