"""The decode feed in one Triton program (a decode step's M <= 64 rows): what ``naive.naive_feed_decode_rows``
does in ~10 small kernels."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _feed_kernel(
    tokens, rows, can_stop, stop_ids, ids, slots, seq_lens, kv_rows, table, stride_table, M, S, scratch_slot,
    scratch_page, page_size, BM: tl.constexpr, BS: tl.constexpr,
):
    i = tl.arange(0, BM)
    ok = i < M
    r = tl.load(rows + i, mask=ok, other=0)
    tok = tl.load(tokens + r, mask=ok, other=0)
    tl.store(ids + i, tl.maximum(tok, 0).to(ids.dtype.element_ty), mask=ok)
    s = tl.arange(0, BS)
    sid = tl.load(stop_ids + s, mask=s < S, other=-1)
    hit = tl.sum(((tok[:, None] == sid[None, :]) & (s < S)[None, :]).to(tl.int32), axis=1) > 0  # [BM]
    stop = ((hit & (tl.load(can_stop + i, mask=ok, other=0) != 0)) | (tok < 0)) & ok
    tl.store(slots + i, tl.zeros([BM], dtype=slots.dtype.element_ty) + scratch_slot, mask=stop)
    tl.store(seq_lens + i, tl.full([BM], 1, dtype=seq_lens.dtype.element_ty), mask=stop)
    row = (tl.zeros([BM], dtype=tl.int64) + scratch_page) * page_size  # int64 before the product
    tl.store(kv_rows + i, row.to(kv_rows.dtype.element_ty), mask=stop)
    tl.store(table + i.to(tl.int64) * stride_table, tl.zeros([BM], dtype=table.dtype.element_ty) + scratch_page,
             mask=stop)


def feed_decode_rows_triton(
    tokens: Tensor, rows: Tensor, can_stop: Tensor, stop_ids: Tensor, ids: Tensor, slots: Tensor, seq_lens: Tensor,
    kv_rows: Tensor, table: Tensor, scratch_slot: int, scratch_page: int, page_size: int,
) -> None:
    """``naive_feed_decode_rows`` (same arguments) in one launch."""
    M, S = rows.shape[0], stop_ids.shape[0]
    _feed_kernel[(1,)](
        tokens, rows, can_stop, stop_ids, ids, slots, seq_lens, kv_rows, table, table.stride(0), M, S, scratch_slot,
        scratch_page, page_size, BM=max(16, triton.next_power_of_2(M)), BS=max(16, triton.next_power_of_2(S)),
    )
