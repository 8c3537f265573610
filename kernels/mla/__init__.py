"""MLA attention over the latent cache: prefill (decompressed) and paged decode (absorbed)."""

from __future__ import annotations

import torch
from torch import Tensor

from .naive import gather_latent, naive_mla_decode_paged, naive_mla_prefill


def mla_decode_paged(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    barrier: Tensor | None = None,
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr], page_table [N, max_pages] int32,
    seq_lens [N] -> attention-weighted latent [N, H, r]. CUDA tensors go to Triton.

    ``barrier``: an int64 CUDA tensor of one element, zeroed once by the caller and used only by calls that run in
    stream order (one per attention layer, say). With it, on an sm_90 GPU, calls whose grid fits on the GPU at
    once (below 8 sequences) merge the splits inside the split kernel behind a grid barrier instead of a second
    launch; it is ignored elsewhere. The kernel leaves it ready for the next call."""
    if barrier is not None and (barrier.dtype != torch.int64 or barrier.numel() != 1
                                or barrier.device != q_lat.device):
        raise ValueError(f"barrier must be one int64 element on {q_lat.device}, got {barrier.dtype} "
                         f"{tuple(barrier.shape)} on {barrier.device}")
    if q_lat.is_cuda:
        from .paged_decode import mla_decode_paged_triton

        return mla_decode_paged_triton(q_lat, q_pe, kv_pages, page_table, seq_lens, scale, barrier=barrier)
    return naive_mla_decode_paged(q_lat, q_pe, kv_pages, page_table, seq_lens, scale)


__all__ = ["gather_latent", "mla_decode_paged", "naive_mla_prefill"]
