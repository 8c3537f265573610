"""y = x @ w.T for a few rows of x in Triton: one program per BO rows of w, streaming them once.

cuBLAS runs a one-row product over a [12,576, 2,304] weight (KDA's merged input projection) on 128-row tiles:
98 programs for 132 SMs, ~1.7 TB/s. Small row blocks give hundreds of programs, enough loads in flight to stream
the weight near the HBM's rate. The rows of x (N <= 16) ride along as the M side of a tensor-core dot.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ..precision import dot_precision


@triton.jit
def _gemv_kernel(x, w, y, N, O, D, s_x, s_w, s_y, BN: tl.constexpr, BO: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BO + tl.arange(0, BO)
    rn = tl.arange(0, BN)
    mo = rows < O
    mn = rn < N
    acc = tl.zeros([BN, BO], dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        md = cols < D
        wt = tl.load(w + rows[:, None].to(tl.int64) * s_w + cols[None, :], mask=mo[:, None] & md[None, :], other=0.0)
        xt = tl.load(x + rn[:, None] * s_x + cols[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    tl.store(y + rn[:, None] * s_y + rows[None, :], acc.to(y.dtype.element_ty), mask=mn[:, None] & mo[None, :])


def skinny_linear_triton(x: Tensor, w: Tensor, BO: int | None = None, BD: int = 128, num_warps: int = 4,
                         num_stages: int = 4) -> Tensor:
    """x [N, D] (unit column stride), w [O, D] contiguous, same dtype -> y [N, O] in x's dtype (float32 sums).
    ``BO`` None: 32 rows a program where that still gives 256 programs, else 16."""
    N, D = x.shape
    O = w.shape[0]
    if BO is None:
        BO = 32 if triton.cdiv(O, 32) >= 256 else 16
    y = x.new_empty(N, O)
    _gemv_kernel[(triton.cdiv(O, BO),)](
        x, w, y, N, O, D, x.stride(0), w.stride(0), y.stride(0),
        BN=max(16, triton.next_power_of_2(N)), BO=BO, BD=BD, num_warps=num_warps, num_stages=num_stages,
        **dot_precision(x.dtype),
    )
    return y


__all__ = ["skinny_linear_triton"]
