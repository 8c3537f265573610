import pytest

from kda_sessions.tokenizer import validate_arguments

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"type": "string", "enum": ["r", "w"]},
        "limit": {"type": "integer"},
        "ratio": {"type": "number"},
        "recursive": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "opt": {"type": ["string", "null"]},
        "nested": {
            "type": "object",
            "properties": {"depth": {"type": "integer"}},
            "required": ["depth"],
            "additionalProperties": False,
        },
    },
    "required": ["path"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "arguments",
    [
        '{"path": "a"}',
        '{"path": "a", "mode": "w", "limit": 3, "ratio": 0.5, "recursive": true, "tags": ["x"], "opt": null}',
        '{"path": "a", "limit": 3.0, "ratio": 2, "nested": {"depth": 1}}',
    ],
    ids=["minimal", "all", "int-like-float"],
)
def test_valid(arguments):
    assert validate_arguments(arguments, SCHEMA) == []


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ("{oops", "$: not valid JSON"),
        ("[]", "$: expected object, got array"),
        ("{}", "$: missing required property 'path'"),
        ('{"path": 1}', "$.path: expected string, got integer"),
        ('{"path": "a", "mode": "x"}', '$.mode: expected one of ["r", "w"], got "x"'),
        ('{"path": "a", "limit": 1.5}', "$.limit: expected integer, got number"),
        ('{"path": "a", "limit": true}', "$.limit: expected integer, got boolean"),
        ('{"path": "a", "ratio": "1"}', "$.ratio: expected number, got string"),
        ('{"path": "a", "recursive": 1}', "$.recursive: expected boolean, got integer"),
        ('{"path": "a", "tags": ["x", 2]}', "$.tags[1]: expected string, got integer"),
        ('{"path": "a", "opt": 3}', "$.opt: expected string or null, got integer"),
        ('{"path": "a", "extra": 1}', "$: unexpected property 'extra'"),
        ('{"path": "a", "nested": {}}', "$.nested: missing required property 'depth'"),
        ('{"path": "a", "nested": {"depth": 1, "x": 0}}', "$.nested: unexpected property 'x'"),
    ],
    ids=lambda v: v if len(v) < 30 else v[:30],
)
def test_invalid(arguments, expected):
    errors = validate_arguments(arguments, SCHEMA)
    assert any(e.startswith(expected) for e in errors), errors


def test_several_errors_are_all_reported():
    errors = validate_arguments('{"path": 1, "limit": "x", "extra": 0}', SCHEMA)
    assert len(errors) == 3


def test_open_schemas_and_extra_keywords():
    assert validate_arguments('{"anything": [1, {"b": null}]}', {"type": "object"}) == []
    assert validate_arguments('{"a": 1}', {"type": "object", "additionalProperties": {"type": "string"}}) == [
        "$.a: expected string, got integer"
    ]
    assert validate_arguments('{"a": true}', {"properties": {"a": {"const": 1}}}) != []
    any_of = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    assert validate_arguments("3", any_of) == [] and validate_arguments("null", any_of) != []
    assert validate_arguments("1", {"type": "nope"}) == ["$: schema has unknown type ['nope']"]
