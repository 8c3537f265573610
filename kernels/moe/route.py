"""The sigmoid router in two Triton kernels: the logits GEMM x @ gate.T with float32 accumulation (the whole
width in one pass, 16 experts per program), then the selection: scores, biased top-k, renormalisation and
scale (one program per token), in place of ~12 small torch kernels per MoE layer (among them a float32 copy of
the gate and a float32 GEMV that cuBLAS runs on 4 thread blocks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _logits_kernel(x, w, out, T, E, D, stride_x, stride_w, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr):
    """out[t, e] = sum_d x[t, d] w[e, d] in float32 for the BT x BE tile (program_id(0), program_id(1))."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    kk = tl.arange(0, BK)
    t_ok, e_ok = t < T, e < E
    xp = x + t[:, None].to(tl.int64) * stride_x + kk[None, :]  # [BT, BK]
    wp = w + e[None, :].to(tl.int64) * stride_w + kk[:, None]  # [BK, BE]: gate.T
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = kk < D - k0
        a = tl.load(xp, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(wp, mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK
    tl.store(out + t[:, None].to(tl.int64) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _route_kernel(
    logits, bias, chosen, weights, E, scale, always_on,
    K: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, EXTRA: tl.constexpr,
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
    KO: tl.constexpr = K + EXTRA  # the row width of chosen and weights
    tl.store(chosen + t * KO + j, ids.to(tl.int64))
    tl.store(weights + t * KO + j, (w * scale).to(weights.dtype.element_ty))
    if EXTRA:
        tl.store(chosen + t * KO + K, always_on.to(tl.int64))
        tl.store(weights + t * KO + K, tl.full((), 1.0, tl.float32).to(weights.dtype.element_ty))


def router_logits_triton(x: Tensor, gate: Tensor) -> Tensor:
    """x [T, D], gate [E, D] (same dtype, last dimension contiguous) -> logits [T, E] float32."""
    T, D = x.shape
    E = gate.shape[0]
    assert x.stride(1) == 1 and gate.stride(1) == 1
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    BT = 16 if T <= 16 else 64
    BE = 16 if T <= 64 else 64
    if T:
        _logits_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
            x, gate, out, T, E, D, x.stride(0), gate.stride(0), BT=BT, BE=BE, BK=128,
            IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
        )
    return out


def moe_route_triton(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float,
    always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """x [T, D], gate [E, D], bias [E] float32 -> (chosen [T, k'] int64, weights [T, k'] in x's dtype), k' = k,
    or k + 1 with ``always_on``; see ``naive_moe_route``. k must be a power of two."""
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two"
    logits = router_logits_triton(x.contiguous(), gate)  # [T, E] float32
    T, E = logits.shape
    dtype = x.dtype
    extra = int(always_on is not None)
    chosen = torch.empty(T, top_k + extra, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k + extra, dtype=dtype, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias.float(), chosen, weights, E, scale, always_on or 0, K=top_k,
                            EP=triton.next_power_of_2(E), RENORM=renormalize, EXTRA=extra, num_warps=4)
    return chosen, weights


__all__ = ["moe_route_triton", "router_logits_triton"]
