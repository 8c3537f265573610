"""The KDA gate (standard and bounded)."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import naive_kda_gate


def kda_gate(raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """raw gate logits [..., H, K] -> float32 log-decays (:mod:`.naive`). CUDA tensors: one Triton pass
    (:mod:`.triton_gate`), unless autograd is to see it; else the twin."""
    if raw.is_cuda and not (torch.is_grad_enabled() and (raw.requires_grad or A_log.requires_grad)):
        from .triton_gate import kda_gate_triton

        return kda_gate_triton(raw, A_log, dt_bias, lower_bound)
    return naive_kda_gate(raw, A_log, dt_bias, lower_bound)


__all__ = ["kda_gate"]
