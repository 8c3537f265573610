"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Every accepted setting gives a finite distribution: values are checked when the request is admitted (a bad
one is a ValueError naming the field, a 400 over HTTP), temperatures below ``MIN_TEMPERATURE`` decode
greedily, and the scaled logits are shifted by their maximum first, so no temperature overflows them.

A decode batch draws all its rows at once (``draw_rows``) and nothing in a draw waits for the device, so a step
queued ahead (``EngineConfig.decode_ahead``) keeps the GPU busy whatever the rows' settings. Logits that hold no
distribution (nan or inf: a fault upstream) draw -1, which the host turns into that request's ``NoDistribution``
error and the device feed into a dummy row (``kernels.feed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..types import MIN_TEMPERATURE, SEED_RANGE, SamplingParams

__all__ = [
    "MIN_TEMPERATURE", "SEED_RANGE", "NoDistribution", "PendingSample", "SamplingParams", "draw", "draw_rows", "sample",
    "sample_batch", "sample_batch_async", "sample_batch_top", "token_logprobs", "top_logprobs",
]


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from logits [vocab] (float32); returns (token id, its log-probability under the model). Raises a
    ValueError where the logits hold no distribution (nan, or no finite value)."""
    if params.greedy:
        tok = int(torch.argmax(logits))
    else:
        tok = int(draw(logits, params, generator))
        if tok < 0:
            raise NoDistribution()
    return tok, float(token_logprobs(logits[None], torch.tensor([tok], device=logits.device))[0])


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[i, tokens[i]] for logits [N, vocab] and tokens [N] (a negative token reads id 0), float32,
    from whole-row passes: torch's log_softmax runs a row in one block (40 us a row of 163,840 on an H100)."""
    return _logprobs(logits, tokens, 0)[0]


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens of each row of logits [N, vocab] and their log-probabilities: ([N, k] long,
    [N, k] float32), most likely first, as ``torch.topk(torch.log_softmax(logits.float(), -1), k)`` gives them."""
    _, ids, lps = _logprobs(logits, logits.new_zeros(logits.shape[0], dtype=torch.long), k)
    return ids, lps


def _logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """``token_logprobs`` and (with k > 0) ``top_logprobs`` from one normalisation of the rows."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    log_sum = (x - m).exp_().sum(-1, keepdim=True).log_()
    lp = ((x.gather(1, tokens.clamp(min=0)[:, None]) - m) - log_sum)[:, 0]
    if not k:
        return lp, x.new_empty(x.shape[0], 0, dtype=torch.long), x.new_empty(x.shape[0], 0)
    top = torch.topk(x, k, dim=-1)
    return lp, top.indices, (top.values - m) - log_sum


class NoDistribution(ValueError):
    """A row's logits hold no distribution to sample from (a nan, an inf, or nothing finite)."""

    def __init__(self) -> None:
        super().__init__("the logits hold no distribution to sample from (nan or inf)")


def draw(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """A non-greedy draw from logits [vocab]: ``draw_rows`` of one row, a 0-d long tensor on the logits' device
    (-1 where the logits hold no distribution)."""
    return draw_rows(logits[None], [params], [generator])[0]


def draw_rows(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of logits [N, vocab], every row's setting at once: [N] long on the logits' device, -1 in a
    row whose logits hold no distribution (a nan or an inf, or nothing finite: its maximum is not finite), the argmax
    in a greedy row.

    Nothing here waits for the device (a decode step queued ahead keeps the GPU busy while the host draws): the
    rows' settings reach it in one pinned copy, top-p keeps its tokens by a threshold (no boolean indexing, which
    waits for the count), and the draw is the exponential race torch.multinomial runs for one sample (argmax of p /
    q, q ~ Exp(1)), without multinomial's checks of the probabilities, which wait for the device. A seeded row's q
    comes from its own generator, drawn as multinomial draws it: the same tokens as ``torch.multinomial(p, 1,
    generator)``. Unseeded rows share one draw from the default generator.

    Top-p keeps the fewest most likely tokens whose mass reaches ``top_p`` and every token as likely as the least of
    them (a tie at the edge is kept whole, not split by the sort's order); top-k likewise keeps ties with its k-th.
    Every operation spans the whole batch and, but for the sort, the whole row: torch's softmax and scan run a row
    in one block, 40 us and 27 us a row of 163,840 on an H100, where an elementwise pass takes ~3."""
    N, vocab = logits.shape
    dev, cuda = logits.device, logits.device.type == "cuda"
    tiny = torch.finfo(torch.float32).tiny
    settings = torch.tensor([[1.0 if p.greedy else p.temperature for p in params], [p.top_k for p in params],
                             [max(p.top_p, tiny) if p.top_p < 1 else math.inf for p in params],
                             [p.greedy for p in params]], dtype=torch.float32, pin_memory=cuda)
    temperature, top_k, top_p, greedy = settings.to(dev, non_blocking=True)
    x = logits.float()
    m = x.amax(-1, keepdim=True)  # nan where the row holds a nan, inf where an inf, -inf where nothing is finite
    w = (x - m).div_(temperature[:, None])  # scaled logits, max 0: no overflow at any temperature
    ks = [p.top_k for p in params if p.top_k > 0 and not p.greedy]
    if ks:
        kmax = min(max(ks), vocab)
        kth = torch.topk(w, kmax, dim=-1).values.gather(1, (top_k.long().clamp(1, kmax) - 1)[:, None])
        w.masked_fill_(w < torch.where(top_k[:, None] > 0, kth, float("-inf")), float("-inf"))
    w.exp_()  # the distribution up to its sum (the most likely token 1)
    if any(p.top_p < 1 and not p.greedy for p in params):
        # a row without a distribution (nan weights) scans as zeros: the one scan spans the rows after it too
        sorted_w = torch.sort(w, dim=-1, descending=True).values.nan_to_num_(nan=0.0)
        # one scan over every row at once, in float64 so the rows ahead cost no precision (torch scans a row at a
        # time in one block: 0.22 ms for 8 rows of 163,840 on an H100)
        ahead = sorted_w.double().view(-1).cumsum(0).view(N, vocab)
        last = ahead[:, -1:].clone()
        ahead.sub_(sorted_w)  # the mass ahead of each token, the rows before it included
        base = ahead[:, :1]
        bound = base + top_p[:, None] * (last - base)  # where the row's mass ahead reaches top_p of its sum
        count = (ahead < bound).sum(-1, keepdim=True)  # the nucleus, a prefix of the sorted row (1 at least)
        least = sorted_w.gather(1, (count - 1).clamp_(min=0))  # its least likely token (a nan row: any)
        w.masked_fill_(w < least, 0)  # every token at least as likely as that one (ties with it too)
    q = torch.empty_like(w)
    if any(g is None for g in generators):
        q.exponential_()
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device == q.device:
            q[i].exponential_(generator=g)
        else:  # the request's generator lives elsewhere: its draw is made there (this row waits for the copy)
            q[i].copy_(torch.empty(vocab, device=g.device).exponential_(generator=g))
    if not cuda:
        q.clamp_min_(tiny)  # the CPU's exponential may give 0 (about once in 2**53); CUDA's never does
    tok = torch.where(torch.isfinite(m[:, 0]), w.div_(q).argmax(-1), -1)
    if any(p.greedy for p in params):  # as an all-greedy batch draws them (a nan row too)
        tok = torch.where(greedy > 0, torch.argmax(logits, dim=-1), tok)
    return tok


def sample_batch(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[tuple[int, float] | Exception]:
    """One token per row of logits [N, vocab]: (token id, its log-probability under the model), or the
    exception that row raised (it fails alone). Every row's token and log-probability reach the host in one copy,
    and nothing before it waits for the device (no index tensors are copied to it). Where no row asks for
    logprobs (``SamplingParams.logprobs``), none is computed and each row's is nan: on a CPU a decode step's
    weights have just evicted the caches, and each op here then costs ~10 us."""
    return sample_batch_async(logits, params, generators).result()


def sample_batch_top(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[tuple[int, float, list[tuple[int, float]]] | Exception]:
    """``sample_batch`` with each row's top logprobs (``SamplingParams.top_logprobs`` of them, as ``top_logprobs``
    gives them; none where it asked for none), from the same copy."""
    return sample_batch_async(logits, params, generators).result_with_top()


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
    """Pinned on CUDA: [len(ok)] int64 tokens, or, when logprobs or top logprobs were asked, [len(ok), 2 + 2 k]
    float64: token, logprob, then the k most likely tokens' ids and their logprobs (``top_logprobs``)."""
    copied: torch.cuda.Event | None = None
    top: list[int] = field(default_factory=list)
    """Per row of ``ok``: how many of the most likely tokens it asked for (``SamplingParams.top_logprobs``)."""

    def result(self) -> list[tuple[int, float] | Exception]:
        """Each row's (token, logprob) (nan where no row asked for logprobs) or its exception."""
        return [r if isinstance(r, Exception) else r[:2] for r in self.result_with_top()]

    def result_with_top(self) -> list[tuple[int, float, list[tuple[int, float]]] | Exception]:
        """Each row's (token, logprob, its top logprobs: (token, logprob) of the most likely tokens, as many as it
        asked for) or its exception."""
        out: list[tuple[int, float, list[tuple[int, float]]] | Exception] = [
            e if isinstance(e, Exception) else (e[0], e[1], []) for e in self.out]
        if self.host is None:
            return out
        if self.copied is not None:
            self.copied.synchronize()
        if self.host.dim() == 1:
            rows = [[tok, math.nan] for tok in self.host.tolist()]
        else:
            rows = self.host.tolist()
        k = (len(rows[0]) - 2) // 2 if rows else 0
        for j, (i, row) in enumerate(zip(self.ok, rows)):
            tok = int(row[0])
            n = self.top[j] if self.top else 0
            top = [(int(t), float(lp)) for t, lp in zip(row[2 : 2 + n], row[2 + k : 2 + k + n])]
            out[i] = (tok, float(row[1]), top) if tok >= 0 else NoDistribution()
        return out


def sample_batch_async(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> PendingSample:
    """``sample_batch``'s draws queued without waiting for the device: the tokens (and logprobs) are copied to the
    host asynchronously; a row whose draw raises fails alone (its exception is in ``out`` at once)."""
    N = logits.shape[0]
    out: list[tuple[int, float] | Exception] = [ValueError("not sampled")] * N
    ok = list(range(N))
    greedy = all(p.greedy for p in params)
    states = [] if greedy else [g.get_state() if isinstance(g, torch.Generator) else None for g in generators]
    try:
        toks = torch.argmax(logits, dim=-1) if greedy else draw_rows(logits, params, generators)
    except Exception:  # a row the batch cannot draw (its generator, say): each row alone, a failing one fails alone
        for g, state in zip(generators, states):
            if state is not None:
                g.set_state(state)  # type: ignore[union-attr]  # as before the batch drew on it
        picks: list[Tensor] = []
        ok = []
        for i in range(N):
            try:
                picks.append(draw_rows(logits[i : i + 1], params[i : i + 1], generators[i : i + 1])[0])
            except Exception as e:
                out[i] = e
            else:
                ok.append(i)
        if not ok:
            return PendingSample(out, ok, None, None)
        toks = torch.stack(picks)
    top = [params[i].top_logprobs for i in ok]
    if any(p.logprobs for p in params) or any(top):
        rows = logits if len(ok) == N else torch.stack([logits[i] for i in ok])
        lps, top_ids, top_lps = _logprobs(rows, toks, min(max(top), rows.shape[-1]))
        dev = torch.cat([toks.double()[:, None], lps.double()[:, None], top_ids.double(), top_lps.double()], dim=1)
    else:
        dev = toks
    if not toks.is_cuda:
        return PendingSample(out, ok, toks, dev, top=top)
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host.copy_(dev, non_blocking=True)  # the one device-to-host copy
    copied = torch.cuda.Event()
    copied.record()
    return PendingSample(out, ok, toks, host, copied, top)
