"""Norms in Triton, one program per row, float32 inside: RMSNorm, RMSNorm after a residual add (both results
stored), and the KDA output's gated per-head RMSNorm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(x, w, y, stride_x, stride_y, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    v = tl.load(x + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    wv = tl.load(w + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + d, (v * r * wv).to(y.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(x, h, w, s, y, stride_x, stride_h, stride_s, stride_y, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    a = tl.load(x + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    b = tl.load(h + row * stride_h + d, mask=m, other=0.0).to(tl.float32)
    # the sum rounded to the stored dtype first: the norm sees what the residual stream holds
    v = (a + b).to(s.dtype.element_ty)
    tl.store(s + row * stride_s + d, v, mask=m)
    v = v.to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    wv = tl.load(w + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + d, (v * r * wv).to(y.dtype.element_ty), mask=m)


@triton.jit
def _gated_rms_norm_kernel(o, g, w, y, R, V, eps, BR: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BV)
    m = (r < R)[:, None] & (d < V)[None, :]
    off = r[:, None].to(tl.int64) * V + d[None, :]  # [BR, BV]
    v = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    z = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, axis=1) / V + eps)  # [BR]
    wv = tl.load(w + d, mask=d < V, other=0.0).to(tl.float32)
    out = v * inv[:, None] * wv[None, :] * tl.sigmoid(z)
    tl.store(y + off, out.to(y.dtype.element_ty), mask=m)


def _rows(x: Tensor) -> Tensor:
    """x [..., D] -> [M, D] with a contiguous last dimension (a view for the model's activations)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _warps(BD: int) -> int:
    return min(16, max(1, BD // 256))


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] (last dimension contiguous or made so), weight [D] -> [..., D] in x's dtype."""
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M:
        BD = triton.next_power_of_2(D)
        _rms_norm_kernel[(M,)](x2, weight, y, x2.stride(0), y.stride(0), D, eps, BD=BD, num_warps=_warps(BD))
    return y.view(x.shape)


def add_rms_norm_triton(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, h [..., D], weight [D] -> (x + h, rms_norm(x + h)), both in x's dtype."""
    D = x.shape[-1]
    x2, h2 = _rows(x), _rows(h)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(s)
    M = x2.shape[0]
    if M:
        BD = triton.next_power_of_2(D)
        _add_rms_norm_kernel[(M,)](x2, h2, weight, s, y, x2.stride(0), h2.stride(0), s.stride(0), y.stride(0), D,
                                   eps, BD=BD, num_warps=_warps(BD))
    return s.view(x.shape), y.view(x.shape)


def gated_rms_norm_triton(o: Tensor, weight: Tensor, gate: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """o [..., V], weight [V], gate [..., V] -> [..., V] in ``dtype`` (see ``naive_gated_rms_norm``)."""
    V = o.shape[-1]
    o2, g2 = o.reshape(-1, V).contiguous(), gate.reshape(-1, V).contiguous()  # [R, V]
    y = torch.empty(o2.shape, dtype=dtype, device=o.device)
    R = o2.shape[0]
    if R:
        BV = triton.next_power_of_2(V)
        BR = max(1, min(16, 2048 // BV))
        _gated_rms_norm_kernel[(triton.cdiv(R, BR),)](o2, g2, weight, y, R, V, eps, BR=BR, BV=BV, num_warps=4)
    return y.view(o.shape)


__all__ = ["add_rms_norm_triton", "gated_rms_norm_triton", "rms_norm_triton"]
