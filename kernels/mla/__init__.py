"""MLA attention over the latent cache: prefill (decompressed, flash) and paged decode (absorbed)."""

from __future__ import annotations

from torch import Tensor

from .naive import (
    gather_latent,
    naive_mla_decode_paged,
    naive_mla_decode_prep,
    naive_mla_prefill,
    naive_mla_prefill_paged,
)
from .prefill_cpu import mla_prefill_cpu

HEAD_BLOCK = 64
"""Query rows (token, head) a split program of the absorbed prefill takes (absorbed.py) where the Gluon split
kernel serves (the queries on wgmma's M on two warpgroups: ``paged_decode_gluon.QUERIES_ON_M``); the Triton kernel
takes at most ``TRITON_HEAD_BLOCK``. Against 32, one layer's call replayed (H100, `bench/mla_prefill.py
--padded`): 1M cached rows, 16 / 128 tokens 2.51 / 20.1 ms against 3.46 / 27.1; 128K 0.43 / 2.68 against 0.55 /
3.68."""

TRITON_HEAD_BLOCK = 32
"""The most query rows a program of the Triton split kernel takes: its accumulators for 64 spill."""


def head_block_or_default(head_block: int | None) -> int:
    """``head_block``, or ``HEAD_BLOCK`` as the module holds it at the call (a bench may set it)."""
    return HEAD_BLOCK if head_block is None else head_block


def served_head_block(kv_pages: Tensor, r: int, head_block: int | None = None) -> int:
    """Query rows a program of the absorbed prefill's split kernel takes over ``kv_pages`` [num_pages, P, r + dr]:
    ``head_block`` (default ``HEAD_BLOCK``), at most ``TRITON_HEAD_BLOCK`` where the Gluon kernel does not serve
    (the Triton kernel runs then). ``absorbed_splits`` sizes a call's splits for it."""
    bh = head_block_or_default(head_block)
    if bh <= TRITON_HEAD_BLOCK:
        return bh
    from .paged_decode_gluon import gluon_split_serves

    P, width = kv_pages.shape[1], kv_pages.shape[2]
    return bh if gluon_split_serves(kv_pages.device, kv_pages.dtype, r, width - r, P, 64, bh) else TRITON_HEAD_BLOCK


def absorbed_splits(T: int, H: int, context: int, sm: int, head_block: int | None = None) -> int:
    """Splits of the cached rows in the absorbed prefill (absorbed.py) for about two waves of (head block, split)
    programs at T tokens of H heads over ``context`` rows, ``head_block`` query rows a program (``served_head_block``):
    more would only add partials to merge (their traffic grows with T x H), fewer leave multiprocessors idle."""
    blocks = -(-(T * H) // head_block_or_default(head_block))
    return max(1, min(-(-context // 256), 2 * sm // blocks))

def mla_decode_paged(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr], page_table [N, max_pages] int32,
    seq_lens [N] -> attention-weighted latent [N, H, r]. CUDA tensors go to Triton."""
    if q_lat.is_cuda:
        from .paged_decode import mla_decode_paged_triton

        return mla_decode_paged_triton(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)
    return naive_mla_decode_paged(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)


def mla_decode_prep(
    y: Tensor, w_kv_b: Tensor, norm_w: Tensor, eps: float, kv_pages: Tensor, kv_rows: Tensor, H: int, dn: int
) -> tuple[Tensor, Tensor]:
    """Between a decode step's input projection and its attention: writes each new token's cache row and
    returns the absorbed query.

    y [N, H * (dn + dr) + r + dr] (unit column stride): per head q_nope [dn] | q_pe [dr], then kv_a's latent c [r]
    and k_pe [dr]; w_kv_b [H * (dn + dv), r] contiguous (kv_b_proj's weight); norm_w [r] (kv_a_layernorm's);
    kv_pages [num_pages, P, r + dr] contiguous; kv_rows [N] int, the flat cache row of each new token, which
    receives [rms_norm(c) * norm_w, k_pe]. Returns (q_lat [N, H, r] = q_nope @ W_uk per head, q_pe [N, H, dr]),
    contiguous, in y's dtype. CUDA tensors go to one Triton launch (no host sync: CUDA-graph safe)."""
    N = y.shape[0]
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    if kv_pages.dim() != 3 or dr <= 0 or y.dim() != 2 or y.shape[1] != H * (dn + dr) + r + dr or y.stride(1) != 1:
        raise ValueError(f"y must be [N, H * (dn + dr) + r + dr]={N, H * (dn + dr) + r + dr} with unit column stride "
                         f"and kv_pages [num_pages, P, r + dr], got {tuple(y.shape)} {y.stride()}, "
                         f"{tuple(kv_pages.shape)}")
    if not kv_pages.is_contiguous():
        raise ValueError("kv_pages must be contiguous: the new rows are written into it in place")
    if w_kv_b.shape[0] % H or w_kv_b.shape[0] // H <= dn or tuple(norm_w.shape) != (r,) or kv_rows.shape != (N,):
        raise ValueError(f"w_kv_b must be [H * (dn + dv), r], norm_w [r]={r,} and kv_rows [N]={N,}, got "
                         f"{tuple(w_kv_b.shape)}, {tuple(norm_w.shape)}, {tuple(kv_rows.shape)}")
    if y.is_cuda:
        from .decode_prep import mla_decode_prep_triton

        return mla_decode_prep_triton(y, w_kv_b.contiguous(), norm_w, eps, kv_pages, kv_rows, H, dn)
    return naive_mla_decode_prep(y, w_kv_b, norm_w, eps, kv_pages, kv_rows, H, dn)


def mla_prefill_paged(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's T new queries over its paged latent cache, K and V decompressed.

    q [T, H, dn + dr], the queries of positions start .. start + T - 1, whose latent rows are already written;
    kv_pages [num_pages, P, r + dr]; pages [max_pages] int, the sequence's page ids (covering start + T tokens);
    w_kv_b [H * (dn + dv), r], kv_b_proj's weight. Returns o [T, H, dv] in q's dtype. Memory stays
    O(T x tile), never O(T x context): CUDA tensors go to the Triton flash kernel (prefill.py), CPU tensors to
    torch's CPU flash kernel tile by tile (prefill_cpu.py); the tiled twin ``naive_mla_prefill_paged`` checks both."""
    T, H, dk = q.shape
    r = w_kv_b.shape[1]
    if kv_pages.dim() != 3 or kv_pages.shape[-1] <= r or dk <= kv_pages.shape[-1] - r:
        raise ValueError(f"kv_pages must be [num_pages, P, r + dr] with r={r} < width < r + dk={r + dk}, "
                         f"got {tuple(kv_pages.shape)}")
    if w_kv_b.shape[0] != H * (dk - (kv_pages.shape[-1] - r) + dv):
        raise ValueError(f"w_kv_b must be [H * (dn + dv), r] with H={H}, dv={dv}, got {tuple(w_kv_b.shape)}")
    if pages.numel() * kv_pages.shape[1] < start + T:
        raise ValueError(f"pages must cover start + T = {start + T} tokens, got {pages.numel()} pages")
    if q.is_cuda:
        from .prefill import mla_prefill_triton

        return mla_prefill_triton(q, kv_pages, pages, start, w_kv_b, dv, scale)
    return mla_prefill_cpu(q, kv_pages, pages, start, w_kv_b, dv, scale)


def mla_prefill_absorbed(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float
) -> Tensor:
    """``mla_prefill_paged``'s arguments and result, kv_b_proj absorbed: for short chunks over a long cache
    (absorbed.py). CUDA tensors (CPU tensors under TRITON_INTERPRET=1)."""
    from .absorbed import mla_prefill_absorbed as absorbed

    return absorbed(q, kv_pages, pages, start, w_kv_b, dv, scale)


def mla_prefill_absorbed_padded(
    q: Tensor, new: Tensor, kv_pages: Tensor, page_table: Tensor, starts: Tensor, w_kv_b: Tensor, dv: int,
    scale: float, num_splits: int, kernel: bool | None = None, head_block: int | None = None,
) -> Tensor:
    """N sequences' chunks padded to one length, absorbed, with fixed shapes and no host sync (what a CUDA graph of a
    short prefill captures): see ``absorbed.mla_prefill_absorbed_padded``. CUDA tensors go to the paged decode
    kernel for the cached rows, CPU tensors to its torch twin (or to the kernel under TRITON_INTERPRET=1 with
    ``kernel=True``)."""
    from .absorbed import mla_prefill_absorbed_padded as padded

    return padded(q, new, kv_pages, page_table, starts, w_kv_b, dv, scale, num_splits, kernel, head_block)


__all__ = [
    "HEAD_BLOCK",
    "TRITON_HEAD_BLOCK",
    "absorbed_splits",
    "gather_latent",
    "head_block_or_default",
    "mla_decode_paged",
    "mla_decode_prep",
    "mla_prefill_absorbed",
    "mla_prefill_absorbed_padded",
    "mla_prefill_paged",
    "naive_mla_prefill",
    "naive_mla_prefill_paged",
    "served_head_block",
]
