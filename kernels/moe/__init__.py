"""Fused MoE: the routed experts of a layer from their stacked weights in place, tokens grouped by expert.
CUDA tensors go to Triton (no host sync, fixed launch shapes: CUDA-graph safe), CPU tensors to the naive twin."""

from __future__ import annotations

from torch import Tensor

from .naive import naive_fused_moe


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
    """Routed experts of one MoE layer.

    x [T, D]; w13 [E, 2F, D] (each expert's w1 rows, then its w3 rows) and w2 [E, D, F], in x's dtype;
    chosen [T, k] int (expert ids); weights [T, k] (routing weights). Returns [T, D] in x's dtype:
    ``out_t = sum_j weights[t, j] * w2[e] @ (silu(w1[e] @ x_t) * (w3[e] @ x_t))`` with ``e = chosen[t, j]``.
    """
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
    if x.is_cuda:
        from .fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, chosen, weights)
    return naive_fused_moe(x, w13, w2, chosen, weights)


__all__ = ["fused_moe"]
