"""Plain-torch twin of the skinny linear."""

from __future__ import annotations

from torch import Tensor


def naive_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [T, D], w [N, D] -> x @ w.T [T, N] in x's dtype."""
    return x @ w.t()


__all__ = ["naive_linear"]
