"""Host-side TMA descriptors for the Triton kernels that can read through them (sm_90 on; Triton >= 3.4)."""

from __future__ import annotations

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None


def tma_device(device: torch.device) -> bool:
    """Whether kernels on ``device`` may take TMA descriptors: a CUDA device of compute capability 9 or more, or
    the CPU (Triton's interpreter runs them); never without Triton's descriptors."""
    if TensorDescriptor is None:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


__all__ = ["TensorDescriptor", "tma_device"]
