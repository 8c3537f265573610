"""Depthwise causal short convolution with SiLU, and its tail as state.

x [T_total, D] (sequences packed; ``cu_seqlens`` int [N + 1]), weight [D, W], tail [N, W - 1, D]: the last W - 1
pre-conv rows before each sequence's first token (zeros for a fresh sequence). Returns y [T_total, D] and the
new tails [N, W - 1, D]. ``tail_positions`` optionally asks, per sequence, for the tail after p tokens
(flattened [M, W - 1, D]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_causal_conv(
    x: Tensor,
    weight: Tensor,
    tail: Tensor,
    cu_seqlens: Tensor,
    tail_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    D, W = weight.shape
    N = cu_seqlens.numel() - 1
    if x.shape[-1] != D or tuple(tail.shape) != (N, W - 1, D):
        raise ValueError(f"x must be [T, D={D}] and tail [N={N}, {W - 1}, {D}], got {tuple(x.shape)}, {tuple(tail.shape)}")
    bounds = cu_seqlens.tolist()
    if tail_positions is None and x.shape[0] == N and bounds == list(range(N + 1)):
        # decode: one new token per sequence, all sequences at once (the loop below costs a conv call each)
        seq = torch.cat([tail.to(x.dtype), x[:, None, :]], dim=1)  # [N, W, D]
        y = torch.einsum("nwd,dw->nd", seq.float(), weight.float())  # y = sum_w weight[:, w] * seq[w]
        return F.silu(y).to(x.dtype), seq[:, 1:], None
    ys: list[Tensor] = []
    tails: list[Tensor] = []
    at: list[Tensor] = []
    for n in range(N):
        seq = torch.cat([tail[n].to(x.dtype), x[bounds[n] : bounds[n + 1]]])  # [W - 1 + T_n, D]
        if seq.shape[0] >= W:  # a sequence with no new token has no output and keeps its tail
            # conv1d is a cross-correlation: y_t = sum_w weight[:, w] * seq[t + w]
            y = F.conv1d(seq.t().unsqueeze(0).float(), weight.float().unsqueeze(1), groups=D)[0].t()
            ys.append(F.silu(y).to(x.dtype))
        tails.append(seq[seq.shape[0] - (W - 1) :])
        if tail_positions is not None:
            at.extend(seq[p : p + W - 1] for p in tail_positions[n])
    new_tail = torch.stack(tails) if tails else tail.clone()
    ck = torch.stack(at) if at else (x.new_zeros(0, W - 1, D) if tail_positions is not None else None)
    return torch.cat(ys) if ys else x.new_zeros(0, D), new_tail, ck
