"""Linear layers of a decode step: y = x @ w^T for a few rows of x. CUDA tensors of at most
``matvec_triton.MAX_ROWS`` rows go to one Triton matvec launch; more rows, and CPU tensors, to ``F.linear``
(cuBLAS or the CPU's BLAS). ``naive_linear`` is the twin the tests compare with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import naive_head_linear, naive_linear

MATVEC_MAX_ROWS = 1
"""Rows of x up to which a CUDA ``linear`` runs the Triton matvec (its limit, ``matvec_triton.MAX_ROWS``). H200,
bf16, graph replays, us, Triton against cuBLAS: one row, o_proj 2304 x 4096 6.9 / 9.8 (cuBLAS's split-K GEMV and
its reduce), KDA's merged input 12576 x 2304 16.9 / 18.4, MLA's q | kv_a 6720 x 2304 10.4 / 11.5; from two rows
cuBLAS leads on the wider weights (KDA's input 19.8 / 18.5 at two, 30.4 / 18.7 at four). The lm_head (163,840 x
2,304, 755 MB) stays in cuBLAS: as this matvec storing float32 logits it added 197 us to the 48B step against
cuBLAS's 174 plus its cast's 4.6 (a 1 x 1M step 25 us slower)."""


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x [N, I] @ w [O, I]^T -> [N, O] in x's dtype (a linear layer's weight as stored, no bias), float32 sums.
    Either operand may be a row slice of a larger tensor; its columns must be contiguous."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [N, I] and w [O, I] with the same I, got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.is_cuda and 1 <= x.shape[0] <= MATVEC_MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1 \
            and x.dtype == w.dtype:
        from .matvec_triton import matvec_triton

        return matvec_triton(x, w)
    return F.linear(x, w)


def head_linear(x: Tensor, w: Tensor) -> Tensor:
    """Per head h: x[:, h] @ w[h]^T, x [N, H, I], w [H, O, I] -> [N, H, O] in x's dtype (MLA's W_uv after
    attention). CUDA tensors of up to ``MATVEC_MAX_ROWS`` rows: one Triton launch reading w in place (any head
    and row strides, unit column stride); otherwise a batched matmul (cuBLAS's, or the CPU's)."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"x must be [N, H, I] and w [H, O, I] with the same H and I, got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.is_cuda and 1 <= x.shape[0] <= MATVEC_MAX_ROWS and x.stride(2) == 1 and w.stride(2) == 1 \
            and x.dtype == w.dtype:
        from .matvec_triton import head_matvec_triton

        return head_matvec_triton(x, w)
    return torch.einsum("nhi,hoi->nho", x, w)


__all__ = ["MATVEC_MAX_ROWS", "head_linear", "linear", "naive_head_linear", "naive_linear"]
