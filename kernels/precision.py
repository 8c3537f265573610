"""Launch options for a Triton kernel's dots by the dtype the caller asked for.

Triton's dot on CUDA defaults to tf32 for float32 inputs (a 10-bit mantissa): a float32 model, the reference
its bf16 twin is checked against, would then compute in less than float32. Float32 inputs therefore get IEEE
dots; half inputs keep the default (tensor cores, nothing to choose). The interpreter ignores the option (its
dots are float32 already).
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> dict[str, str]:
    """Keyword arguments for ``kernel[grid](..., **dot_precision(dtype))``: IEEE dots for float32."""
    return {"default_dot_input_precision": "ieee"} if dtype == torch.float32 else {}


__all__ = ["dot_precision"]
