"""A linear layer for few rows (decode) in Triton: each program streams a [BN, D] slab of the weight once and
multiplies it with all (at most 16) rows, float32 accumulation. Memory-bound by design: a decode step's dense
weights are read once per step, and cuBLAS's kernels for one to a few rows read some shapes far below the HBM
rate (bench/decode_48b.py --gemv)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 16
"""Rows of the kernel's one row block (a tensor-core tile): it serves up to that many rows."""


@triton.jit
def _skinny_kernel(x, w, y, T, N, D, stride_x, stride_wn, stride_wk, stride_y,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """y[:, n0:n0 + BN] = x @ w[n0:n0 + BN].T for the column block program_id(0)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.arange(0, BT)
    kk = tl.arange(0, BK)
    n_ok, t_ok = n < N, t < T
    xp = x + t[:, None].to(tl.int64) * stride_x + kk[None, :]  # [BT, BK]
    wp = w + n[None, :].to(tl.int64) * stride_wn + kk[:, None].to(tl.int64) * stride_wk  # [BK, BN]: w.T
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = kk < D - k0
        a = tl.load(xp, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(wp, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK * stride_wk
    yp = y + t[:, None].to(tl.int64) * stride_y + n[None, :]
    tl.store(yp, acc.to(y.dtype.element_ty), mask=t_ok[:, None] & n_ok[None, :])


def launch(N: int, D: int, n_major: bool = False) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages): column blocks small enough for a few waves over the SMs; with the
    weight's N dimension contiguous (``n_major``) wide column blocks, so each row of a tile is one long read."""
    if n_major:
        return 64, 64, 4, 4
    BN = 16 if N <= 4096 else 32 if N <= 32768 else 64
    return BN, 256 if D >= 2048 else 128, 4, 4


def skinny_linear_triton(x: Tensor, w: Tensor, cfg: tuple[int, int, int, int] | None = None) -> Tensor:
    """x [T, D] (T <= ROWS), w [N, D] with either dimension contiguous -> [T, N] in x's dtype."""
    T, D = x.shape
    N = w.shape[0]
    assert T <= ROWS and 1 in w.stride()
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = cfg or launch(N, D, w.stride(0) == 1 and N > 1)
    _skinny_kernel[(triton.cdiv(N, BN),)](
        x, w, y, T, N, D, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        BT=ROWS, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )
    return y


__all__ = ["ROWS", "launch", "skinny_linear_triton"]
