"""MLA attention over the latent cache: prefill (decompressed, flash) and paged decode (absorbed)."""

from __future__ import annotations

from torch import Tensor

from .naive import gather_latent, naive_mla_decode_paged, naive_mla_prefill, naive_mla_prefill_paged
from .prefill_cpu import mla_prefill_cpu


def mla_decode_paged(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr], page_table [N, max_pages] int32,
    seq_lens [N] -> attention-weighted latent [N, H, r]. CUDA tensors go to Triton."""
    if q_lat.is_cuda:
        from .paged_decode import mla_decode_paged_triton

        return mla_decode_paged_triton(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)
    return naive_mla_decode_paged(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)


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


__all__ = ["gather_latent", "mla_decode_paged", "mla_prefill_paged", "naive_mla_prefill", "naive_mla_prefill_paged"]
