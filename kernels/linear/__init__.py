"""A linear layer without bias, ``x @ w.T``, for the few rows of a decode step: CUDA inputs of at most
``MAX_ROWS`` rows go to the skinny Triton kernel, everything else to torch (``naive_linear``)."""

from __future__ import annotations

from torch import Tensor

from .naive import naive_linear

MAX_ROWS = 16
"""Rows up to which CUDA inputs take the skinny kernel (its ``ROWS``)."""


def skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [T, D], w [N, D] (same dtype; either dimension contiguous, so ``w_t.t()`` of a [D, N] weight serves)
    -> [T, N] in x's dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [T, D] and w [N, D], got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.is_cuda and x.shape[0] <= MAX_ROWS and 1 in w.stride() and w.dtype == x.dtype:
        from .skinny import skinny_linear_triton

        return skinny_linear_triton(x, w)
    return naive_linear(x, w)


__all__ = ["MAX_ROWS", "skinny_linear"]
