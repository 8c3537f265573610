"""MLA attention over the latent cache: prefill (decompressed) and paged decode (absorbed)."""

from __future__ import annotations

from torch import Tensor

from .naive import gather_latent, naive_mla_decode_paged, naive_mla_prefill


def mla_decode_paged(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr], page_table [N, max_pages] int32,
    seq_lens [N] -> attention-weighted latent [N, H, r]. CUDA tensors go to Triton."""
    if q_lat.is_cuda:
        from .paged_decode import mla_decode_paged_triton

        return mla_decode_paged_triton(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)
    return naive_mla_decode_paged(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)


__all__ = ["gather_latent", "mla_decode_paged", "naive_mla_prefill"]
