"""The KDA gate: raw per-channel logits -> log-decay g (<= 0), float32.

raw [..., H, K] (f_b_proj(f_a_proj(x)) viewed per head), A_log [H], dt_bias [H, K].
Standard (Kimi Linear): ``g = -exp(A_log[h]) * softplus(raw + dt_bias)``.
Bounded (K3, ``lower_bound`` lb < 0): ``g = lb * sigmoid(exp(A_log[h]) * (raw + dt_bias))``, so g lies in [lb, 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_kda_gate(raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    H, K = raw.shape[-2:]
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"A_log must hold H={H} and dt_bias H*K={H * K} values, got {A_log.numel()}, {dt_bias.numel()}")
    x = raw.float() + dt_bias.float().view(H, K)
    a = A_log.float().view(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * x)


def gate_params(
    H: int, K: int, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None
) -> tuple[Tensor, Tensor, float | None]:
    """The gate's parameters as the fused kernels take them: (A_log [H] float32, dt_bias [H * K] float32,
    lower_bound). As in fla, A_log may be None only with a lower bound (then exp(A_log) = 1); dt_bias None is 0."""
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be < 0, got {lower_bound}")
    if A_log is None and lower_bound is None:
        raise ValueError("the standard gate needs A_log (only the bounded gate may leave it out)")
    if A_log is not None and A_log.numel() != H:
        raise ValueError(f"A_log must hold H={H} values, got {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must hold H*K={H * K} values, got {tuple(dt_bias.shape)}")
    ref = A_log if A_log is not None else dt_bias
    dev = ref.device if ref is not None else None
    a = A_log.float().reshape(H).contiguous() if A_log is not None else torch.zeros(H, device=dev)
    d = dt_bias.float().reshape(H * K).contiguous() if dt_bias is not None else torch.zeros(H * K, device=dev)
    return a, d, lower_bound
