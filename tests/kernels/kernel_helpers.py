"""Shared helpers for the kernel tests: relative RMS error and KDA inputs with either gate."""

from __future__ import annotations

import torch

from kda_sessions.kernels.gate.naive import naive_kda_gate


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kda_inputs(B: int, T: int, H: int, K: int, V: int, bounded: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    raw = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 - 2.0
    g = naive_kda_gate(raw, A_log, dt_bias, -5.0 if bounded else None)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta
