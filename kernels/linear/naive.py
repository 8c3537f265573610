"""The twin of the matvec: a plain float32 matmul, rounded once to x's dtype."""

from __future__ import annotations

from torch import Tensor


def naive_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [N, I] @ w [O, I]^T -> [N, O] in x's dtype, every product and sum in float32."""
    return (x.float() @ w.float().t()).to(x.dtype)


__all__ = ["naive_linear"]
