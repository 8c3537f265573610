"""Constrained decoding for ``response_format``: the reply is one compact JSON value that stays a valid prefix
of a schema at every token (``{"type": "object"}`` for OpenAI's ``json_object``), then end of turn.

It is the tool-call constraint's ``args`` step without the envelope: the same JSON prefix automaton picks the
tokens, and near the end of the token budget the value is steered to its shortest close, so a reply that is not
cut by ``max_tokens`` always parses.
"""

from __future__ import annotations

from typing import Any

from ..tokenizer import Tokenizer
from .tool_choice import END_OF_TURN, ToolChoiceConstraint

MAX_REPLY_BYTES = 1 << 20


def response_schema(response_format: Any) -> dict[str, Any] | None:
    """The schema a ``response_format`` asks for (OpenAI's shapes), None for plain text; ValueError otherwise."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return schema
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


class JsonReplyConstraint(ToolChoiceConstraint):
    """The reply is a JSON value valid against ``schema``, then ``<|im_end|>``."""

    def __init__(self, tokenizer: Tokenizer, schema: dict[str, Any]) -> None:
        super().__init__(tokenizer, None, "required")
        self.schemas = {b"": schema}
        self.name = b""
        self.script = [("args", None), ("force", tokenizer.token_to_id(END_OF_TURN))]
        self.max_arg_bytes = MAX_REPLY_BYTES
