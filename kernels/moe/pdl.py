"""Programmatic dependent launch (PDL) of the MoE decode kernels on Hopper and later GPUs.

A decode step's MoE block is three short launches (router, up, down: ~5-25 us each at the 48B shape), so the gap
between two launches and each one's ramp-up are a large part of it. Launched with PDL, a kernel's programs start
while the launch before it finishes and run their prologue: loads that do not depend on that launch (the router's
weight, the down kernel's first expert tiles, whose ids the router wrote two launches back), then wait for it
(``gdc_wait``) before reading what it writes. Every program waits before it ends, so a chain of PDL launches still
sees each earlier launch complete, and no prologue writes memory. Stream capture keeps these edges in a CUDA
graph. Each launch stays correct without PDL, where ``gdc_wait`` returns at once. On the H200 at the 48B shape
(``bench/decode_48b.py --moe-chain 1``) a one-token MoE block takes 41.0 us a layer with PDL, 42.8 without.
"""

from __future__ import annotations

import functools

import torch

ENABLED = True
"""The knob: False launches every decode kernel that uses PDL without it (the MoE's, and those of
``kernels.linear``'s matvecs, ``kernels.kda``'s decode and ``kernels.mla``'s decode prep, which follow the same
rules; ``bench/decode_48b.py --modes fused,fused-nopdl`` compares both)."""


def use_pdl(device: torch.device) -> bool:
    """Whether the decode kernels launch with PDL on ``device``: ``ENABLED``, a CUDA device of compute
    capability 9.0 or more, and a Triton that takes ``launch_pdl``."""
    return ENABLED and device.type == "cuda" and _supported(device.index)


@functools.cache
def _supported(index: int | None) -> bool:
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


__all__ = ["ENABLED", "use_pdl"]
