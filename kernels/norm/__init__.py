"""Norms: RMSNorm, RMSNorm after a residual add, and the gated per-head RMSNorm of KDA's output. CUDA tensors go
to one Triton kernel per call (instead of ~6 elementwise and reduction kernels), CPU tensors to torch (RMSNorm
through ``F.rms_norm``, one fused op) or the plain twins."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import naive_gated_rms_norm, naive_rms_norm


def _check(x: Tensor, weight: Tensor) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [D] with D = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")


def _cpu_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if hasattr(F, "rms_norm") and weight.dtype == x.dtype:  # its fused kernel takes one dtype
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # float32 inside for half inputs, like the twin
    return naive_rms_norm(x, weight, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype: ``x / sqrt(mean(x^2) + eps) * weight`` in float32."""
    _check(x, weight)
    if x.is_cuda:
        from .triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return _cpu_rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add and the next norm in one pass. x, h [..., D] (same shape), weight [D] -> (s = x + h,
    rms_norm(s, weight, eps)), both in x's dtype; the norm reads s as stored (rounded to x's dtype)."""
    _check(x, weight)
    if h.shape != x.shape:
        raise ValueError(f"h must have x's shape {tuple(x.shape)}, got {tuple(h.shape)}")
    if x.is_cuda:
        from .triton_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, h, weight, eps)
    s = x + h if h.dtype == x.dtype else (x + h).to(x.dtype)  # x's dtype, as the CUDA kernel stores it
    return s, _cpu_rms_norm(s, weight, eps)


def gated_rms_norm(o: Tensor, weight: Tensor, gate: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """KDA's output norm: o [..., V] (each head's values), weight [V], gate [..., V] (output-gate logits, o's
    shape) -> ``rms_norm(o) * sigmoid(gate)`` [..., V] in ``dtype``, computed in float32."""
    _check(o, weight)
    if gate.shape != o.shape:
        raise ValueError(f"gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if o.is_cuda:
        from .triton_norm import gated_rms_norm_triton

        return gated_rms_norm_triton(o, weight, gate, eps, dtype)
    return naive_gated_rms_norm(o, weight, gate, eps, dtype)


__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]
