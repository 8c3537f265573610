"""RMSNorm over the last dimension: one kernel per call on CUDA (instead of ~6 elementwise and reduction
kernels), the plain-torch twin on the CPU."""

from __future__ import annotations

from torch import Tensor

from .naive import naive_rms_norm


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype: ``x / sqrt(mean(x^2) + eps) * weight`` in float32."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [D] with D = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    if x.is_cuda:
        from .triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return naive_rms_norm(x, weight, eps)


__all__ = ["rms_norm"]
