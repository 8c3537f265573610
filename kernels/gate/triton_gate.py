"""The KDA gate in one Triton pass: raw logits (any float dtype, rows may be strided) -> float32 log-decays.

The same arithmetic as :func:`.naive.naive_kda_gate` (``softplus(x) = x`` above 20), one read of the logits and one
write of the result: torch runs it as four float32 passes over [T, H * K].
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .naive import gate_params


@triton.jit
def _gate_kernel(raw, A_log, dt_bias, g, T, stride_r, lower_bound,
                 HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BOUNDED: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (t < T)[:, None] & (c < HK)[None, :]
    x = tl.load(raw + t.to(tl.int64)[:, None] * stride_r + c[None, :], mask=m, other=0.0).to(tl.float32)
    x = x + tl.load(dt_bias + c, mask=c < HK, other=0.0)[None, :]
    a = tl.exp(tl.load(A_log + c // K, mask=c < HK, other=0.0))[None, :]
    if BOUNDED:
        y = lower_bound * tl.sigmoid(a * x)
    else:
        y = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g + t.to(tl.int64)[:, None] * HK + c[None, :], y, mask=m)


def kda_gate_triton(raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """raw [..., H, K] (the last two dimensions contiguous; the rows before them at any stride) -> g float32 of
    raw's shape: ``-exp(A_log[h]) * softplus(raw + dt_bias)``, or with ``lower_bound`` < 0 ``lower_bound *
    sigmoid(exp(A_log[h]) * (raw + dt_bias))``."""
    H, K = raw.shape[-2:]
    a, d, lb = gate_params(H, K, A_log, dt_bias, lower_bound)
    x = raw.reshape(-1, H * K)
    if x.stride(1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    g = x.new_empty(T, H * K, dtype=a.dtype)
    BT, BC = 16, min(1024, triton.next_power_of_2(H * K))
    if T:
        _gate_kernel[(triton.cdiv(T, BT), triton.cdiv(H * K, BC))](
            x, a, d, g, T, x.stride(0), float(lb) if lb is not None else 0.0,
            HK=H * K, K=K, BT=BT, BC=BC, BOUNDED=lb is not None, num_warps=4,
        )
    return g.view(raw.shape)
