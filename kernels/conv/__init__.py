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
    plane: int = 0,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [T, D] packed, weight [D, W], tail [N, W - 1, D] -> (y [T, D], new tail [N, W - 1, D], tails at
    positions [M, W - 1, D] | None). With ``plane`` (dividing D), y is [D // plane, T, plane] (each plane
    contiguous). CUDA tensors go to Triton (which reads x's rows at their stride and writes the planes directly)."""
    if x.is_cuda:
        from .triton_conv import causal_conv_triton

        return causal_conv_triton(x, weight, tail, cu_seqlens, tail_positions, plane)
    # inference on a CPU: shifted multiply-adds in place (no autograd); training keeps the twin
    conv = causal_conv_cpu if not torch.is_grad_enabled() else naive_causal_conv
    y, new_tail, ck = conv(x.contiguous(), weight, tail, cu_seqlens, tail_positions)
    if plane:
        if y.shape[1] % plane:
            raise ValueError(f"plane must divide D={y.shape[1]}, got {plane}")
        y = y.view(y.shape[0], -1, plane).transpose(0, 1).contiguous()
    return y, new_tail, ck


__all__ = ["causal_conv"]
