"""Causal short convolution for CPU inference: the twin's math as W shifted multiply-adds over [T, D] rows.

``naive_causal_conv`` runs ``F.conv1d`` on a [1, D, T] copy of each sequence (a transpose in and one out); here
each sequence's output is ``sum_w weight[:, w] * seq[t + w]`` over its rows as they lie, in W in-place ops.
Same contract and shapes as :func:`.naive.naive_causal_conv` (float32 sums, output in ``x.dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import naive_causal_conv


def causal_conv_cpu(
    x: Tensor,
    weight: Tensor,
    tail: Tensor,
    cu_seqlens: Tensor,
    tail_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [T, D] packed, weight [D, W], tail [N, W - 1, D] -> (y [T, D], new tails [N, W - 1, D], tails at
    ``tail_positions`` [M, W - 1, D] | None)."""
    D, W = weight.shape
    N = cu_seqlens.numel() - 1
    bounds = cu_seqlens.tolist()
    if x.shape[0] == N and tail_positions is None:  # decode: the twin's one einsum over all sequences
        return naive_causal_conv(x, weight, tail, cu_seqlens)
    if x.shape[-1] != D or tuple(tail.shape) != (N, W - 1, D):
        raise ValueError(f"x must be [T, D={D}] and tail [N={N}, {W - 1}, {D}], got {tuple(x.shape)}, {tuple(tail.shape)}")
    wt = weight.float().t().contiguous()  # [W, D]: tap w's weight for every channel
    y = x.new_empty(x.shape)
    tails: list[Tensor] = []
    at: list[Tensor] = []
    for n in range(N):
        T = bounds[n + 1] - bounds[n]
        seq = torch.cat([tail[n].to(x.dtype), x[bounds[n] : bounds[n + 1]]])  # [W - 1 + T, D]
        if T:
            acc = seq[:T].float() * wt[0]  # [T, D]
            for w in range(1, W):
                acc.addcmul_(seq[w : w + T].float(), wt[w])
            y[bounds[n] : bounds[n + 1]] = F.silu(acc, inplace=True).to(x.dtype)
        tails.append(seq[seq.shape[0] - (W - 1) :])
        if tail_positions is not None:
            at.extend(seq[p : p + W - 1] for p in tail_positions[n])
    new_tail = torch.stack(tails) if tails else tail.clone()
    ck = torch.stack(at) if at else (x.new_zeros(0, W - 1, D) if tail_positions is not None else None)
    return y, new_tail, ck


__all__ = ["causal_conv_cpu"]
