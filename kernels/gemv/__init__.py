"""A linear over a few rows (decode's matvecs): ``y = x @ w.T``. CUDA tensors go to Triton, CPU tensors to the
twin."""

from __future__ import annotations

from torch import Tensor

from .naive import naive_skinny_linear

MAX_ROWS = 16
"""The most rows of x the Triton kernel takes (they fill one tensor-core tile); more go to ``F.linear``."""


def skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [N, D] with N <= ``MAX_ROWS`` and unit column stride, w [O, D] contiguous in x's dtype -> y [N, O] in x's
    dtype, float32 sums. No host sync: graph-safe."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [N, D] and w [O, D], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[0] > MAX_ROWS or x.stride(1) != 1 or not w.is_contiguous() or x.dtype != w.dtype:
        raise ValueError(f"x must have at most {MAX_ROWS} rows and unit column stride, w be contiguous, both one "
                         f"dtype; got {tuple(x.shape)} {x.stride()} {x.dtype}, w {w.dtype}")
    if x.is_cuda:
        from .triton_gemv import skinny_linear_triton

        return skinny_linear_triton(x, w)
    return naive_skinny_linear(x, w)


__all__ = ["MAX_ROWS", "skinny_linear"]
