"""Short causal convolution with SiLU and its tail state."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .cpu import causal_conv_cpu
from .naive import naive_causal_conv


def causal_conv(
    x: Tensor,
    weight: Tensor,
    tail: Tensor,
    cu_seqlens: Tensor,
    tail_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [T, D] packed, weight [D, W], tail [N, W - 1, D] -> (y [T, D], new tail [N, W - 1, D], tails at
    positions [M, W - 1, D] | None). CUDA tensors go to Triton."""
    if x.is_cuda:
        from .triton_conv import causal_conv_triton

        return causal_conv_triton(x, weight, tail, cu_seqlens, tail_positions)
    # inference on a CPU: shifted multiply-adds in place (no autograd); training keeps the twin
    conv = causal_conv_cpu if not torch.is_grad_enabled() else naive_causal_conv
    return conv(x, weight, tail, cu_seqlens, tail_positions)


__all__ = ["causal_conv"]
