"""Admission of one call on a session: everything a request can get wrong is refused here (a ValueError naming
the field, a 400 over HTTP), before the session or the pools change."""

from __future__ import annotations

from typing import Any

import torch

from ..constrain.json_prefix import check_top_level, decoding_schema
from ..constrain.json_reply import JsonReplyConstraint, response_schema
from ..constrain.tool_choice import ToolChoiceConstraint, parse_tool_choice
from ..engine.core import EngineCore
from ..engine.sampler import SamplingParams
from ..engine.scheduler import Constraint, Work
from ..tokenizer import Tokenizer
from .state import SessionState


def check_request(s: SessionState, tool_choice: Any, response_format: Any) -> None:
    """Raise ValueError for a tool_choice or response_format the session cannot honour."""
    choice = parse_tool_choice(tool_choice, s.tools)
    schema = response_schema(response_format)
    if schema is not None and choice not in (None, "none"):
        raise ValueError("response_format cannot be combined with a tool_choice that forces a tool call")
    if schema is not None:
        check_top_level(schema, "response_format.json_schema.schema")


def work_for(
    s: SessionState, params: SamplingParams, core: EngineCore, tokenizer: Tokenizer, *, prefill_only: bool,
    tool_choice: Any, response_format: Any,
) -> Work:
    """A work for the session's pending tokens (its prompt, checkpoints and callbacks are set by the caller);
    ``response_format`` (OpenAI's shape) constrains the reply to JSON, ``tool_choice`` to a tool call."""
    cfg = core.config
    capacity = cfg.num_pages * cfg.page_size
    if s.num_tokens + (0 if prefill_only else params.max_tokens) > capacity:
        raise ValueError(
            f"max_tokens={params.max_tokens} after a context of {s.num_tokens} tokens exceeds this engine's KV "
            f"capacity of {capacity} tokens"
        )
    check_request(s, tool_choice, response_format)
    schema = response_schema(response_format)
    choice = parse_tool_choice(tool_choice, s.tools)
    constraint: Constraint | None = None
    if schema is not None:
        constraint = JsonReplyConstraint(tokenizer, decoding_schema(schema))
    elif choice is not None:
        constraint = ToolChoiceConstraint(tokenizer, s.tools, choice)
    if s.num_tokens <= s.num_cached and not prefill_only:
        raise ValueError(f"session {s.id!r} has no tokens to continue from; append some first")
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return Work(session=s, prompt=[], params=params, prefill_only=prefill_only, generator=generator,
                constraint=constraint)
