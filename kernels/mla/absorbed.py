"""MLA prefill of a short chunk with kv_b_proj absorbed, as decode runs it: attention on the latent rows.

The decompressed flash kernel (prefill.py) turns every cached row into per-head keys and values once per chunk:
2 r H (dn + dv) flops a cached row whatever the chunk's length, 4.4 TFLOP for 4 MLA layers after 128K cached
tokens, and ~2 GB of decompressed keys and values written and read back a layer. A chunk of T queries absorbed costs
2 T H (2 r + dr) flops a cached row instead, and reads each row once: fewer flops below T ~ 170 (at r 512, dr 64,
dn = dv 128), and no decompressed rows at all. An agent's tool output appended to a long conversation is such a
chunk.

The T queries of positions start .. start + T - 1 attend over two parts, merged by their log-sum-exps:
  cached  rows [0, start): the paged decode kernel (paged_decode.py, "tokens" form) with the T queries as the T x H
          heads of one sequence, so every cached row is read once for all of them (a split's head blocks run side
          by side: the row is read from L2 after the first);
  new     rows [start, start + T) (written to the pages before the attention), causal: [T, H, T] scores in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import TRITON_HEAD_BLOCK, absorbed_splits, served_head_block
from .paged_decode import _LOG2E, _launch
from .paged_decode_gluon import gluon_split_ok


def mla_prefill_absorbed(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float
) -> Tensor:
    """``mla_prefill_paged``'s arguments and result (q [T, H, dn + dr]; kv_pages [num_pages, P, r + dr]; pages
    [max_pages] int; w_kv_b [H * (dn + dv), r]) -> o [T, H, dv] in q's dtype, absorbed (see the module docstring).
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. No host sync."""
    T, H, dk = q.shape
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dn = dk - dr
    P = kv_pages.shape[1]
    w = w_kv_b.view(H, dn + dv, r)
    q_lat = torch.einsum("thd,hdr->thr", q[..., :dn], w[:, :dn])  # [T, H, r]
    pos = torch.arange(start, start + T, device=q.device)
    new = kv_pages[pages[pos // P].long(), pos % P]  # [T, r + dr]: the new rows, already in the pages
    o, lse = _new_rows(q_lat[None], q[None, ..., dn:], new[None], scale)
    if start > 0:
        sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = absorbed_splits(T, H, start, sm, served_head_block(kv_pages, r))
        starts = torch.full((1,), start, device=q.device, dtype=torch.int32)
        o = _merge(o, lse, *_cached_rows(q_lat[None], q[None, ..., dn:], kv_pages, pages[None, :], starts, scale,
                                         splits, kernel=True))
    return torch.einsum("thr,hvr->thv", o[0].to(q.dtype), w[:, dn:])


def mla_prefill_absorbed_padded(
    q: Tensor, new: Tensor, kv_pages: Tensor, page_table: Tensor, starts: Tensor, w_kv_b: Tensor, dv: int,
    scale: float, num_splits: int, kernel: bool | None = None, head_block: int | None = None,
) -> Tensor:
    """N sequences' chunks padded to Tb tokens each, absorbed, with no value read on the host (fixed shapes: a CUDA
    graph captures it): q [N, Tb, H, dn + dr], the queries of positions starts[n] .. starts[n] + Tb - 1 (rows past a
    sequence's real chunk are padding: they attend, and nothing real attends to them); new [N, Tb, r + dr] their
    latent rows as the pages keep them; kv_pages [num_pages, P, r + dr]; page_table [N, max_pages] int32 covering
    each sequence's cached rows; starts [N] int32 >= 1, the cached rows of each; num_splits: the cached rows'
    splits (``absorbed_splits`` at the longest context served). Returns o [N, Tb, H, dv] in q's dtype.

    ``kernel`` (default: q on CUDA): the cached rows through the paged decode kernel (CPU tensors then need
    ``TRITON_INTERPRET=1``), ``head_block`` query rows (token, head) a program; False, through torch over every page
    of the table (its twin, for CPU tests)."""
    N, Tb, H, dk = q.shape
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dn = dk - dr
    if tuple(new.shape) != (N, Tb, r + dr) or tuple(starts.shape) != (N,) or page_table.shape[0] != N:
        raise ValueError(f"new must be [N, Tb, r + dr]={N, Tb, r + dr}, starts [N] and page_table [N, max_pages], "
                         f"got {tuple(new.shape)}, {tuple(starts.shape)}, {tuple(page_table.shape)}")
    w = w_kv_b.view(H, dn + dv, r)
    q_lat = torch.einsum("nthd,hdr->nthr", q[..., :dn], w[:, :dn])  # [N, Tb, H, r]
    q_pe = q[..., dn:]
    o, lse = _new_rows(q_lat, q_pe, new, scale)
    o = _merge(o, lse, *_cached_rows(q_lat, q_pe, kv_pages, page_table, starts, scale, num_splits,
                                     kernel=q.is_cuda if kernel is None else kernel, head_block=head_block))
    return torch.einsum("nthr,hvr->nthv", o.to(q.dtype), w[:, dn:])


def _new_rows(q_lat: Tensor, q_pe: Tensor, new: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The chunk's queries over its own rows, causal, in float32: q_lat [N, T, H, r], q_pe [N, T, H, dr], new
    [N, T, r + dr] -> (o [N, T, H, r], lse [N, T, H], natural log)."""
    T, r = q_lat.shape[1], q_lat.shape[-1]
    new = new.float()
    s = (torch.einsum("nthr,njr->nthj", q_lat.float(), new[..., :r])
         + torch.einsum("nthd,njd->nthj", q_pe.float(), new[..., r:])) * scale
    causal = torch.arange(T, device=s.device)[None, :] > torch.arange(T, device=s.device)[:, None]  # [T, j]
    s.masked_fill_(causal[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("nthj,njr->nthr", (s - lse[..., None]).exp_(), new[..., :r]), lse


def _cached_rows(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, starts: Tensor, scale: float, splits: int,
    kernel: bool, head_block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The queries over each sequence's first starts[n] (>= 1) cached rows: (o [N, T, H, r] float32, lse [N, T, H],
    natural log). With ``kernel``, the paged decode kernel with the T x H queries as the heads of their sequence
    (every cached row read once for all of them); else torch over every page of the table."""
    N, T, H, r = q_lat.shape
    dr = q_pe.shape[-1]
    if kernel:
        lse = torch.empty(N, T * H, device=q_lat.device, dtype=torch.float32)
        q_rows = q_lat.reshape(N, T * H, r).contiguous()
        bh = served_head_block(kv_pages, r, head_block)
        if bh > TRITON_HEAD_BLOCK and not gluon_split_ok(q_rows, kv_pages, r, dr, kv_pages.shape[1], 64, bh):
            bh = TRITON_HEAD_BLOCK
        o = _launch(q_rows, q_pe.reshape(N, T * H, dr).to(q_lat.dtype).contiguous(),
                    kv_pages.contiguous(), page_table.to(torch.int32).contiguous(), starts.to(torch.int32), float(scale),
                    num_splits=splits, BH=bh, form="tokens", lse_out=lse)
        return o.view(N, T, H, r).float(), lse.view(N, T, H) / _LOG2E  # base 2 -> natural
    lat = kv_pages[page_table.long()].flatten(1, 2).float()  # [N, L, r + dr], every page of the table
    s = (torch.einsum("nthr,nlr->nthl", q_lat.float(), lat[..., :r])
         + torch.einsum("nthd,nld->nthl", q_pe.float(), lat[..., r:])) * scale
    past = torch.arange(lat.shape[1], device=s.device)[None, :] >= starts[:, None]  # [N, L]
    s.masked_fill_(past[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("nthl,nlr->nthr", (s - lse[..., None]).exp_(), lat[..., :r]), lse


def _merge(o: Tensor, lse: Tensor, o_c: Tensor, lse_c: Tensor) -> Tensor:
    """Two attentions of the same queries over disjoint rows merged by their log-sum-exps (natural log)."""
    both = torch.logaddexp(lse, lse_c)
    return o * (lse - both).exp_()[..., None] + o_c * (lse_c - both).exp_()[..., None]
