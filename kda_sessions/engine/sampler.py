"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Every accepted setting gives a finite distribution: values are checked when the request is admitted (a bad
one is a ValueError naming the field, a 400 over HTTP), temperatures below ``MIN_TEMPERATURE`` decode
greedily, and the scaled logits are shifted by their maximum first, so no temperature overflows them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..types import MIN_TEMPERATURE, SEED_RANGE, SamplingParams

__all__ = ["MIN_TEMPERATURE", "SEED_RANGE", "SamplingParams", "sample"]


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
