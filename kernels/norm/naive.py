"""Plain-torch twin of the RMSNorm kernel."""

from __future__ import annotations

import torch
from torch import Tensor


def naive_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype: ``x / sqrt(mean(x^2) + eps) * weight``, in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


__all__ = ["naive_rms_norm"]
