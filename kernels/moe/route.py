"""The sigmoid router's selection in one Triton kernel: scores, biased top-k, renormalisation and scale (one
program per token) in place of ~9 small torch kernels per MoE layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _route_kernel(
    logits, bias, chosen, weights, E, scale,
    K: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    ok = e < E
    s = tl.sigmoid(tl.load(logits + t * E + e, mask=ok, other=0.0).to(tl.float32))
    sel = tl.where(ok, s + tl.load(bias + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    j = tl.arange(0, K)
    ids = tl.zeros([K], dtype=tl.int32)
    w = tl.zeros([K], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(sel, axis=0)
        # the lowest index among the maxima, as a tie-break
        idx = tl.min(tl.where(sel == best, e, EP), axis=0)
        ids = tl.where(j == i, idx, ids)
        w = tl.where(j == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), w)
        sel = tl.where(e == idx, float("-inf"), sel)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(chosen + t * K + j, ids.to(tl.int64))
    tl.store(weights + t * K + j, (w * scale).to(weights.dtype.element_ty))


def moe_route_triton(
    logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """logits [T, E] float32, bias [E] float32 -> (chosen [T, k] int64, weights [T, k] in ``dtype``); see
    ``naive_moe_route``. k must be a power of two."""
    T, E = logits.shape
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two"
    logits = logits.contiguous()
    chosen = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=dtype, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias, chosen, weights, E, scale, K=top_k, EP=triton.next_power_of_2(E),
                            RENORM=renormalize, num_warps=4)
    return chosen, weights


__all__ = ["moe_route_triton"]
