"""The skinny linear's twin: y = x @ w.T with float32 sums, in x's dtype."""

from __future__ import annotations

from torch import Tensor


def naive_skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [N, D], w [O, D] -> y [N, O] in x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


__all__ = ["naive_skinny_linear"]
