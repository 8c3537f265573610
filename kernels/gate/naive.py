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
