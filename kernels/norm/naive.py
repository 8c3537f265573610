"""Plain-torch twins of the norm kernels."""

from __future__ import annotations

import torch
from torch import Tensor


def naive_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype: ``x / sqrt(mean(x^2) + eps) * weight``, in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def naive_add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x, h [..., D], weight [D] -> (s = x + h in x's dtype, rms_norm(s) in x's dtype)."""
    s = x + h
    return s, naive_rms_norm(s, weight, eps)


def naive_gated_rms_norm(o: Tensor, weight: Tensor, gate: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """o [..., V], weight [V], gate [..., V] (logits) -> [..., V] in ``dtype``:
    ``rms_norm(o) * sigmoid(gate)``, in float32."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (of * torch.sigmoid(gate.float())).to(dtype)


__all__ = ["naive_add_rms_norm", "naive_gated_rms_norm", "naive_rms_norm"]
