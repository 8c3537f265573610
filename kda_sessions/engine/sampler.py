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

from ..types import MIN_TEMPERATURE, SEED_RANGE, SamplingParams

__all__ = [
    "MIN_TEMPERATURE", "SEED_RANGE", "PendingSample", "SamplingParams", "draw", "sample", "sample_batch",
    "sample_batch_async",
]


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
    return sample_batch_async(logits, params, generators).result()


@dataclass
class PendingSample:
    """A batch's draws queued on the device (``sample_batch_async``): ``tokens`` [len(ok)] int64 stays on the
    device for whoever feeds them on (a decode step ahead, ``model.graphs.Feed``); ``result`` waits for the one
    copy to the host."""

    out: list[tuple[int, float] | Exception]
    """Per row: the exception of a row that failed when its draw was queued, else a placeholder."""
    ok: list[int]
    """The rows drawn, in the order of ``tokens``."""
    tokens: Tensor | None
    host: Tensor | None
    """Pinned on CUDA: [len(ok)] int64 tokens, or [2, len(ok)] float64 (tokens, logprobs) when logprobs were asked."""
    copied: torch.cuda.Event | None = None

    def result(self) -> list[tuple[int, float] | Exception]:
        """Each row's (token, logprob) (nan where no row asked for logprobs) or its exception."""
        if self.host is None:
            return self.out
        if self.copied is not None:
            self.copied.synchronize()
        out = list(self.out)
        if self.host.dim() == 1:
            for i, tok in zip(self.ok, self.host.tolist()):
                out[i] = (int(tok), math.nan)
        else:
            toks, lps = self.host.tolist()
            for j, i in enumerate(self.ok):
                out[i] = (int(toks[j]), float(lps[j]))
        return out


def sample_batch_async(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> PendingSample:
    """``sample_batch``'s draws queued without waiting for the device: the tokens (and logprobs) are copied to the
    host asynchronously; a row whose draw raises fails alone (its exception is in ``out`` at once)."""
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
            return PendingSample(out, ok, None, None)
        toks = torch.stack(picks)
    if any(p.logprobs for p in params):
        rows = logits if len(ok) == N else torch.stack([logits[i] for i in ok])
        lps = torch.log_softmax(rows.float(), dim=-1).gather(1, toks[:, None])[:, 0]
        dev = torch.stack([toks.double(), lps.double()])
    else:
        dev = toks
    if not toks.is_cuda:
        return PendingSample(out, ok, toks, dev)
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host.copy_(dev, non_blocking=True)  # the one device-to-host copy
    copied = torch.cuda.Event()
    copied.record()
    return PendingSample(out, ok, toks, host, copied)
