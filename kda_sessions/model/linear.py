"""Linear layers of the decode step on the skinny kernel (``kernels.linear``): a decode step multiplies each
dense weight by a handful of rows, and a kernel built for that reads the weight closer to the HBM rate than the
general GEMMs do at some shapes (``bench/decode_48b.py --gemv``).

``use_skinny_linears(model, True)`` switches every ``nn.Linear`` of a model to ``SkinnyLinear`` (same parameters,
same state dict; only ``forward`` differs, and only for CUDA inputs of at most ``MAX_ROWS`` rows, so prefill is
unchanged); ``False`` switches them back.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.linear import MAX_ROWS, skinny_linear


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` (no bias) whose few-row CUDA calls run the skinny kernel."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, skinny=True)


def linear(x: Tensor, w: Tensor, skinny: bool) -> Tensor:
    """x [..., D], w [N, D] -> [..., N]: the skinny kernel when ``skinny`` and the call suits it, else F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if skinny and x.is_cuda and 0 < rows <= MAX_ROWS and x.dtype == w.dtype:
        return skinny_linear(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def is_skinny(m: nn.Module) -> bool:
    return isinstance(m, SkinnyLinear)


def use_skinny_linears(model: nn.Module, enabled: bool = True) -> int:
    """Switch the bias-free linear layers of ``model`` to (or back from) ``SkinnyLinear``; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) in (nn.Linear, SkinnyLinear) and m.bias is None:
            m.__class__ = SkinnyLinear if enabled else nn.Linear  # forward only: parameters and names stay
            n += 1
    return n


__all__ = ["SkinnyLinear", "is_skinny", "linear", "use_skinny_linears"]
