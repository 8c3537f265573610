"""MLA prefill on the CPU: torch's CPU flash-attention kernel over the paged latent cache, one tile of cached
tokens at a time, the tiles' partial results merged by their log-sum-exp.

The same computation as the twin ``naive_mla_prefill_paged`` (and the Triton kernel), about 3x faster than the
twin's explicit scores on a CPU: per tile of ``tile`` keys (aligned to absolute positions), the keys the chunk's
queries all see attend without a mask, and the chunk's own new keys attend as a square causal block (top-left
aligned, which torch's ``is_causal`` means) for the queries inside the tile and without a mask for those after it.
Memory is one tile's decompressed K and V plus O(T x H x (dn + dr)) for the output and its partials.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import latent_rows

TILE = 4096
"""Cached tokens per tile: each tile's decompressed K and V take TILE x H x 2 (dn + dr) floats."""


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [H, t, d], k and v [H, n, d] -> (o [H, t, d], natural log-sum-exp [H, t]) from torch's CPU flash kernel
    (4-D inputs of one head size; it materialises no score matrix)."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale
    )
    return o[0], lse[0]


def _merge(acc: Tensor, lse: Tensor, rows: slice, o: Tensor, l_o: Tensor) -> None:
    """Fold (o [H, t, d], l_o [H, t]) into the running (acc [H, T, d], lse [H, T]) at ``rows`` (in place)."""
    la = lse[:, rows]
    m = torch.maximum(la, l_o)  # finite: every call sees at least one key per query
    wa, wb = torch.exp(la - m), torch.exp(l_o - m)
    den = wa + wb
    acc[:, rows] = (acc[:, rows] * (wa / den)[..., None]) + o * (wb / den)[..., None]
    lse[:, rows] = m + torch.log(den)


def mla_prefill_cpu(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float, tile: int | None = None
) -> Tensor:
    """See ``kda_sessions.kernels.mla.mla_prefill_paged``: q [T, H, dn + dr] -> o [T, H, dv] in q's dtype;
    ``tile`` defaults to ``TILE``."""
    tile = tile or TILE
    T, H, dk = q.shape
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dn = dk - dr
    L = start + T
    qh = q.transpose(0, 1).float()  # [H, T, dk]
    acc = torch.zeros(H, T, dk, device=q.device)  # v is zero-padded to dk: the flash kernel takes one head size
    lse = torch.full((H, T), float("-inf"), device=q.device)
    w = w_kv_b.float()
    for b0 in range(0, L, tile):
        b1 = min(L, b0 + tile)
        lat = latent_rows(kv_pages, pages, b0, b1).float()  # [n, r + dr]
        n = b1 - b0
        kv = (lat[:, :r] @ w.t()).view(n, H, dn + dv)  # decompress the tile
        k = torch.cat([kv[..., :dn], lat[:, None, r:].expand(n, H, dr)], dim=-1).transpose(0, 1)  # [H, n, dk]
        v = F.pad(kv[..., dn:], (0, dk - dv)).transpose(0, 1)  # [H, n, dk]
        c = max(b0, start)  # keys before c are cached: every query of the chunk sees them
        if c > b0:
            o, l_o = _flash(qh, k[:, : c - b0], v[:, : c - b0], False, scale)
            _merge(acc, lse, slice(0, T), o, l_o)
        if b1 > c:  # the chunk's own keys c .. b1 - 1
            rows = slice(c - start, b1 - start)  # the queries at those positions: a square causal block
            o, l_o = _flash(qh[:, rows], k[:, c - b0 :], v[:, c - b0 :], True, scale)
            _merge(acc, lse, rows, o, l_o)
            if b1 - start < T:  # the queries after the tile see all of it
                rows = slice(b1 - start, T)
                o, l_o = _flash(qh[:, rows], k[:, c - b0 :], v[:, c - b0 :], False, scale)
                _merge(acc, lse, rows, o, l_o)
    return acc[..., :dv].transpose(0, 1).to(q.dtype)
