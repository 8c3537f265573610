"""The twin of the matvec: a plain float32 matmul, rounded once to x's dtype."""

from __future__ import annotations

from torch import Tensor


def naive_linear(x: Tensor, w: Tensor) -> Tensor:
    """x [N, I] @ w [O, I]^T -> [N, O] in x's dtype, every product and sum in float32."""
    return (x.float() @ w.float().t()).to(x.dtype)


def naive_head_linear(x: Tensor, w: Tensor) -> Tensor:
    """Per head: x [N, H, I], w [H, O, I] -> [N, H, O] = x[:, h] @ w[h]^T in x's dtype, every product and sum in
    float32."""
    return (x.float().transpose(0, 1) @ w.float().transpose(1, 2)).transpose(0, 1).to(x.dtype)


__all__ = ["naive_head_linear", "naive_linear"]
