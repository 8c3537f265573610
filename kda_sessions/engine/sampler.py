"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Every accepted setting gives a finite distribution: values are checked when the request is admitted (a bad
one is a ValueError naming the field, a 400 over HTTP), temperatures below ``MIN_TEMPERATURE`` decode
greedily, and the scaled logits are shifted by their maximum first, so no temperature overflows them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..types import MIN_TEMPERATURE, SEED_RANGE, SamplingParams

__all__ = ["MIN_TEMPERATURE", "SEED_RANGE", "SamplingParams", "draw", "sample", "sample_batch"]


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from logits [vocab] (float32); returns (token id, its log-probability under the model)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(logprobs[tok])
    tok = int(draw(logits, params, generator))
    return tok, float(logprobs[tok])


def draw(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """A non-greedy draw from logits [vocab]: the token id as a 0-d long tensor on the logits' device (drawn
    where the request's generator lives); no host sync unless those devices differ."""
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
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)  # a seeded draw uses the request's own generator, where it lives
    return torch.multinomial(probs, 1, generator=generator)[0].to(logits.device)


def sample_batch(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[tuple[int, float] | Exception]:
    """One token per row of logits [N, vocab]: (token id, its log-probability under the model), or the
    exception that row raised (it fails alone). Every row's token and log-probability reach the host in one copy,
    and nothing before it waits for the device (no index tensors are copied to it). Where no row asks for
    logprobs (``SamplingParams.logprobs``), none is computed and each row's is nan: on a CPU a decode step's
    weights have just evicted the caches, and each op here then costs ~10 us."""
    N = logits.shape[0]
    out: list[tuple[int, float] | Exception] = [ValueError("not sampled")] * N
    if all(p.greedy for p in params):
        toks = torch.argmax(logits, dim=-1)  # the whole batch at once
        ok = list(range(N))
    else:
        picks: list[Tensor] = []
        ok = []
        for i in range(N):
            try:
                picks.append(torch.argmax(logits[i]) if params[i].greedy else draw(logits[i], params[i], generators[i]))
            except Exception as e:  # an unsampleable row fails its own request only
                out[i] = e
            else:
                ok.append(i)
        if not ok:
            return out
        toks = torch.stack(picks)
    if not any(p.logprobs for p in params):
        for i, tok in zip(ok, toks.tolist()):  # the one device-to-host copy
            out[i] = (int(tok), math.nan)
        return out
    rows = logits if len(ok) == N else torch.stack([logits[i] for i in ok])
    lps = torch.log_softmax(rows.float(), dim=-1).gather(1, toks[:, None])[:, 0]
    host = torch.stack([toks.double(), lps.double()]).cpu().tolist()  # the one device-to-host copy
    for j, i in enumerate(ok):
        out[i] = (int(host[0][j]), float(host[1][j]))
    return out
