"""A few rows times a weight matrix in Triton: y [N, O] = x [N, I] @ w [O, I]^T for N of 1 to ``MAX_ROWS``.

A decode step's projections are matvecs: each reads its weight once, so its time is the weight's bytes over the
memory's rate. cuBLAS runs some of these shapes as a split-K GEMV plus a second reduce kernel (o_proj's 2304 x
4096 at ~2 TB/s on the H200). Here one launch: program p takes BO output rows and streams their [BO, I] slab of
the weight in BK-column tiles (the loop over I unrolled, so every tile's load can be in flight at once), keeps
elementwise float32 products per row of x ([NP, BO, BK]) and reduces over BK once at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

MAX_ROWS = 8
"""The most rows of x the kernel takes: its products run on CUDA cores, about N multiply-adds a weight element,
which from ~16 rows up costs more than the read."""


@triton.jit
def _matvec_kernel(x, s_x, w, s_w, y, s_y, N, O, I: tl.constexpr, NP: tl.constexpr, BO: tl.constexpr,
                   BK: tl.constexpr):
    ro = tl.program_id(0) * BO + tl.arange(0, BO)
    mo = ro < O
    rn = tl.arange(0, NP)
    mn = rn < N
    rk = tl.arange(0, BK)
    wrow = w + ro.to(tl.int64)[:, None] * s_w  # [BO, 1]
    xrow = x + rn.to(tl.int64)[:, None] * s_x  # [NP, 1]
    acc = tl.zeros([NP, BO, BK], dtype=tl.float32)
    for k0 in tl.static_range(0, I, BK):
        k = k0 + rk
        mk = k < I
        wt = tl.load(wrow + k[None, :], mask=mo[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [BO, BK]
        xt = tl.load(xrow + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [NP, BK]
        acc += xt[:, None, :] * wt[None, :, :]
    out = tl.sum(acc, axis=2)  # [NP, BO]
    tl.store(y + rn.to(tl.int64)[:, None] * s_y + ro[None, :], out.to(y.dtype.element_ty),
             mask=mn[:, None] & mo[None, :])


def matvec_config(N: int, O: int, I: int) -> tuple[int, int, int]:
    """(BO, BK, num_warps) for x [N, I] and w [O, I]."""
    del O, I
    if N <= 2:
        return 4, 256, 4
    return 4, 128, 4


def matvec_triton(x: Tensor, w: Tensor, config: tuple[int, int, int] | None = None) -> Tensor:
    """x [N, I] (unit column stride, 1 <= N <= MAX_ROWS), w [O, I] (unit column stride) -> y [N, O] in x's dtype.
    ``config``: (BO, BK, num_warps), default ``matvec_config``."""
    N, I = x.shape
    O = w.shape[0]
    y = x.new_empty(N, O)
    BO, BK, warps = config or matvec_config(N, O, I)
    NP = max(1, triton.next_power_of_2(N))
    _matvec_kernel[(triton.cdiv(O, BO),)](x, x.stride(0), w, w.stride(0), y, y.stride(0), N, O, I=I, NP=NP, BO=BO,
                                          BK=BK, num_warps=warps)
    return y


__all__ = ["MAX_ROWS", "matvec_config", "matvec_triton"]
