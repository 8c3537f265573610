"""Fused MoE: the routed experts of a layer from their stacked weights in place, tokens grouped by expert.
CUDA tensors go to Triton (no host sync, fixed launch shapes: CUDA-graph safe), CPU tensors to the naive twin."""

from __future__ import annotations

from torch import Tensor

from ..norm import add_rms_norm
from .naive import naive_fused_moe, naive_moe_route

ROUTE_DECODE_MAX_TOKENS = 16
"""Up to this many tokens ``moe_route`` uses the one-launch decode kernel (``route.moe_route_decode``)."""


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
    """Routed experts of one MoE layer.

    x [T, D]; w13 [E, 2F, D] (each expert's w1 rows, then its w3 rows) and w2 [E, D, F], in x's dtype;
    chosen [T, k] int (expert ids); weights [T, k] (routing weights). Returns [T, D] in x's dtype:
    ``out_t = sum_j weights[t, j] * w2[e] @ (silu(w1[e] @ x_t) * (w3[e] @ x_t))`` with ``e = chosen[t, j]``.
    """
    _check_moe(x, w13, w2, chosen, weights)
    if x.is_cuda:
        from .triton_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, chosen, weights)
    return naive_fused_moe(x, w13, w2, chosen, weights)


def _check_moe(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w13.shape[2] != x.shape[1] or w13.shape[1] % 2:
        raise ValueError(f"x must be [T, D] and w13 [E, 2F, D], got {tuple(x.shape)}, {tuple(w13.shape)}")
    T, D = x.shape
    E, F2, _ = w13.shape
    if tuple(w2.shape) != (E, D, F2 // 2):
        raise ValueError(f"w2 must be [E, D, F]={(E, D, F2 // 2)}, got {tuple(w2.shape)}")
    if chosen.dim() != 2 or chosen.shape[0] != T or tuple(weights.shape) != tuple(chosen.shape):
        raise ValueError(f"chosen and weights must be [T, k] with T={T}, got {tuple(chosen.shape)}, "
                         f"{tuple(weights.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 and w2 must be in x's dtype {x.dtype}, got {w13.dtype}, {w2.dtype}")


def moe_route(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float,
    always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The sigmoid router. x [T, D], gate [E, D] (the router's weight, x's dtype), bias [E]
    (``e_score_correction_bias``) -> (chosen [T, k] int64: the top k of ``sigmoid(x @ gate.T) + bias``, the
    logits in float32, best first; weights [T, k] in x's dtype: the chosen plain sigmoid scores, divided by their
    sum when ``renormalize``, times ``scale``). With ``always_on`` (an expert id, e.g. E for a shared expert stacked
    after the routed ones) both are [T, k + 1], the last column that id with weight 1. CUDA tensors (k a power of
    two) go to Triton: one launch up to ``route.ROUTE_DECODE_MAX_TOKENS`` tokens, else two kernels (their float32
    sums run in another order, so a near-tie between two experts may resolve the other way)."""
    if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != x.shape[1] or bias.shape != (gate.shape[0],):
        raise ValueError(f"x must be [T, D], gate [E, D] and bias [E], got {tuple(x.shape)}, {tuple(gate.shape)}, "
                         f"{tuple(bias.shape)}")
    if not 0 < top_k <= gate.shape[0]:
        raise ValueError(f"top_k must be in [1, E={gate.shape[0]}], got {top_k}")
    if x.is_cuda and top_k & (top_k - 1) == 0 and gate.dtype == x.dtype and gate.stride(1) == 1:
        from .route import moe_route_decode, moe_route_triton

        if 0 < x.shape[0] <= ROUTE_DECODE_MAX_TOKENS:
            return moe_route_decode(x, gate, bias, top_k, renormalize, scale, always_on)
        return moe_route_triton(x, gate, bias, top_k, renormalize, scale, always_on)
    return naive_moe_route(x, gate, bias, top_k, renormalize, scale, always_on)


def fused_moe_add_norm(
    x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, res: Tensor, norm_weight: Tensor,
    eps: float, always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``fused_moe`` and the residual add and RMSNorm after it: res [T, D] (the residual stream), norm_weight [D]
    -> (s = res + fused_moe(x, ...), h = rms_norm(s) * norm_weight), both [T, D] in x's dtype as
    ``kernels.norm.add_rms_norm`` gives them. On CUDA up to ``triton_moe.ADD_NORM_MAX_TOKENS`` tokens the add and
    norm run in the direct down kernel's launch; otherwise the two calls. ``always_on``: the expert id that every
    row of chosen holds last (``moe_route``'s ``always_on``; the caller's promise, not checked on the device: the
    kernels may use the id in place of that column); the up kernel can then read its weights early."""
    if res.shape != x.shape or norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"res must be x's shape {tuple(x.shape)} and norm_weight [D], got {tuple(res.shape)}, "
                         f"{tuple(norm_weight.shape)}")
    if always_on is not None and not 0 <= always_on < w13.shape[0]:
        raise ValueError(f"always_on must be an expert id in [0, {w13.shape[0]}), got {always_on}")
    if x.is_cuda and x.shape[0] > 0:
        from .triton_moe import ADD_NORM_MAX_TOKENS, fused_moe_direct_add_norm

        if x.shape[0] <= ADD_NORM_MAX_TOKENS:
            _check_moe(x, w13, w2, chosen, weights)
            return fused_moe_direct_add_norm(x, w13, w2, chosen, weights, res, norm_weight, eps,
                                             always_on=always_on)
    # the MoE's output first: the sum in x's dtype (the same bits as res + out where res is x's dtype)
    return add_rms_norm(fused_moe(x, w13, w2, chosen, weights), res, norm_weight, eps)


def add_norm_route(
    x: Tensor, res: Tensor, norm_weight: Tensor, eps: float, gate: Tensor, bias: Tensor, top_k: int,
    renormalize: bool, scale: float, always_on: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The residual add and RMSNorm before a MoE layer, then its router: x, res [T, D], norm_weight [D] ->
    (s = x + res, h = rms_norm(s) * norm_weight, both [T, D] in x's dtype as ``kernels.norm.add_rms_norm`` gives
    them, chosen, weights = ``moe_route(h, ...)``). On CUDA, up to ``route.ROUTE_DECODE_MAX_TOKENS`` tokens (k a
    power of two), all of it in the decode router's one launch; otherwise the two calls."""
    if res.shape != x.shape or x.dim() != 2 or norm_weight.shape != (x.shape[1],):
        raise ValueError(f"x and res must be [T, D] and norm_weight [D], got {tuple(x.shape)}, {tuple(res.shape)}, "
                         f"{tuple(norm_weight.shape)}")
    if x.is_cuda and x.shape[0] > 0 and top_k & (top_k - 1) == 0 and gate.dtype == x.dtype and gate.stride(1) == 1:
        from .route import add_norm_route_decode

        if x.shape[0] <= ROUTE_DECODE_MAX_TOKENS and 0 < top_k <= gate.shape[0] and gate.shape[1] == x.shape[1]:
            return add_norm_route_decode(x, res, norm_weight, eps, gate, bias, top_k, renormalize, scale, always_on)
    s, h = add_rms_norm(x, res, norm_weight, eps)
    chosen, weights = moe_route(h, gate, bias, top_k, renormalize, scale, always_on)
    return s, h, chosen, weights


__all__ = ["ROUTE_DECODE_MAX_TOKENS", "add_norm_route", "fused_moe", "fused_moe_add_norm", "moe_route"]
