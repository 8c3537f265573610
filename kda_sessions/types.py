"""The public types, importable without torch: replies, usage, stream events, session and checkpoint info,
sampling parameters and save results. ``ks.Engine`` and ``ks.Client`` both return these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from .tokenizer import ToolCall

MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
"""Temperatures below this sample as greedy: at such a temperature the distribution is the argmax anyway."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What torch.Generator.manual_seed takes."""


@dataclass
class SamplingParams:
    """How one call samples; every field is checked on construction (a ValueError names it)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    """Keep generating past end-of-turn tokens (benchmarks, raw continuation)."""
    top_logprobs: int = 0
    """With ``logprobs``: also the ``top_logprobs`` most likely tokens at each position (0-20), as in OpenAI."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if (isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int)
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(x, str) for x in self.stop):
                raise ValueError(f"stop must be strings, got {self.stop!r}")
            self.stop = [x for x in self.stop if x] or None  # an empty stop string would end every reply at once

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class SaveResult:
    """What one save wrote: blobs new to the store vs. ones it already had (dedup)."""

    blobs_written: int
    bytes_written: int
    blobs_reused: int
    manifest_bytes: int
    generation: int = 0
    """The generation now stored (the manifest's, unless an earlier uncertain commit had landed)."""


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


class TopLogprob(BaseModel):
    token_id: int
    logprob: float


class Reply(BaseModel):
    session_id: str
    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float] | None = None
    """With ``logprobs``: the log-probability of each generated token under the model."""
    top_logprobs: list[list[TopLogprob]] | None = None
    """With ``top_logprobs`` N: the N most likely tokens at each generated position, most likely first."""


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


__all__ = [
    "MIN_TEMPERATURE",
    "SEED_RANGE",
    "CheckpointInfo",
    "Done",
    "FinishReason",
    "Reply",
    "SamplingParams",
    "SaveResult",
    "SessionInfo",
    "StreamEvent",
    "TokenDelta",
    "ToolCall",
    "ToolCallEvent",
    "Usage",
]
