"""What callers get back: replies, usage, stream events, session and checkpoint info."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..tokenizer import ToolCall


class Usage(BaseModel):
    prompt_tokens: int = 0
    """Context tokens before generation (history + new input)."""
    cached_tokens: int = 0
    """Context tokens reused without recompute."""
    prefill_tokens: int = 0
    """Tokens actually run through the model for this call's prompt."""
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class Reply(BaseModel):
    session_id: str
    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float] | None = None


class TokenDelta(BaseModel):
    type: Literal["delta"] = "delta"
    text: str
    token_ids: list[int]


class ToolCallEvent(BaseModel):
    type: Literal["tool_call"] = "tool_call"
    tool_call: ToolCall


class Done(BaseModel):
    type: Literal["done"] = "done"
    reply: Reply


StreamEvent = TokenDelta | ToolCallEvent | Done


class CheckpointInfo(BaseModel):
    session_id: str
    name: str
    position: int


class SessionInfo(BaseModel):
    session_id: str
    num_tokens: int
    checkpoints: list[str]
    active: bool
    """True when the session's state is in this engine's pools; False when it is only in the store."""
    saved: bool
    parent: str | None = None
