"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Every accepted setting gives a finite distribution: values are checked when the request is admitted (a bad
one is a ValueError naming the field, a 400 over HTTP), temperatures below ``MIN_TEMPERATURE`` decode
greedily, and the scaled logits are shifted by their maximum first, so no temperature overflows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_TEMPERATURE = 1e-5
"""Temperatures below this sample as greedy: at such a temperature the distribution is the argmax anyway."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What torch.Generator.manual_seed takes."""


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    """Keep generating past end-of-turn tokens (benchmarks, raw continuation)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
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


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from logits [vocab] (float32); returns (token id, its log-probability under the model)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(logprobs[tok])
    scaled = logits.float()
    scaled = (scaled - scaled.max()) / params.temperature  # max 0: no overflow at any temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        keep[0] = True  # the most likely token, even where top_p rounds to 0 in float32
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logprobs[tok])
