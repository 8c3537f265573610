"""Plain-torch twin of the fused MoE: a loop over the experts that received tokens (one host sync per call).

Notation: T tokens, k experts per token, E experts, D model width, F expert width. A *pair* is one (token,
chosen expert) entry of ``chosen [T, k]``, numbered ``p = t * k + j``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_fused_moe(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
    """x [T, D], w13 [E, 2F, D] (w1 rows then w3 rows), w2 [E, D, F], chosen [T, k] int, weights [T, k]
    -> [T, D] in x's dtype: ``sum_j weights[t, j] * w2[e] @ (silu(w1[e] @ x_t) * (w3[e] @ x_t))``, e = chosen[t, j]."""
    Fw = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        h = x[rows] @ w13[e].t()  # [n, 2F]
        y = (F.silu(h[:, :Fw]) * h[:, Fw:]) @ w2[e].t()  # [n, D]
        out.index_add_(0, rows, y * weights[rows, slot, None].to(x.dtype))
    return out


def naive_moe_route(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float,
    always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """x [T, D], gate [E, D] (the router's weight), bias [E] (``e_score_correction_bias``) -> (chosen [T, k]
    int64: the top k of ``sigmoid(x @ gate.T) + bias`` (in float32), best first; weights [T, k] in x's dtype: the
    chosen plain sigmoid scores, divided by their sum when ``renormalize``, times ``scale``). With ``always_on``
    both get a last column k: that expert id with weight 1 (an expert every token runs, such as a shared one)."""
    scores = torch.sigmoid(x.float() @ gate.float().t())  # [T, E]
    bias = bias.float()
    _, chosen = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, chosen)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = (weights * scale).to(x.dtype)
    if always_on is not None:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], 1), always_on)], dim=1)
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], 1)], dim=1)
    return chosen, weights


__all__ = ["naive_fused_moe", "naive_moe_route"]
