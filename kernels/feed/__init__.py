"""The decode feed: a decode step's input ids taken on the device from an earlier step's sampled tokens, and the
rows whose token stops their request turned into dummies (``model.graphs.Feed``). CUDA tensors go to one Triton
program, CPU tensors to the plain twin."""

from __future__ import annotations

from torch import Tensor

from .naive import naive_feed_decode_rows


def feed_decode_rows(
    tokens: Tensor, rows: Tensor, can_stop: Tensor, stop_ids: Tensor, ids: Tensor, slots: Tensor, seq_lens: Tensor,
    kv_rows: Tensor, table: Tensor, scratch_slot: int, scratch_page: int, page_size: int,
) -> None:
    """In place, for the M fed rows i: ids[i] = tokens[rows[i]]; where can_stop[i] and that token is in stop_ids,
    or where it is negative (a row the sampler found no distribution in: ``engine.sampler``), row i becomes a dummy:
    ids[i] = 0 if negative, slots[i] = scratch_slot, seq_lens[i] = 1, kv_rows[i] = scratch_page * page_size,
    table[i, 0] = scratch_page.

    tokens [K] int64, rows [M] int32 (indices into tokens), can_stop [M] int32 (0 or 1), stop_ids [S] int64 (S >= 1);
    ids, slots, seq_lens [M] int32, kv_rows [M] int64, table [M, W] int32 (rows strided, columns contiguous)."""
    M = rows.shape[0]
    if not (can_stop.shape == ids.shape == slots.shape == seq_lens.shape == kv_rows.shape == (M,)) \
            or table.dim() != 2 or table.shape[0] != M or stop_ids.dim() != 1 or stop_ids.shape[0] < 1:
        raise ValueError(f"feed_decode_rows: rows [M]={M}, can_stop, ids, slots, seq_lens, kv_rows [M], table [M, W] "
                         f"and stop_ids [S >= 1]; got can_stop {tuple(can_stop.shape)}, ids {tuple(ids.shape)}, "
                         f"slots {tuple(slots.shape)}, seq_lens {tuple(seq_lens.shape)}, kv_rows "
                         f"{tuple(kv_rows.shape)}, table {tuple(table.shape)}, stop_ids {tuple(stop_ids.shape)}")
    if tokens.is_cuda:
        from .triton_feed import feed_decode_rows_triton

        feed_decode_rows_triton(tokens, rows, can_stop, stop_ids, ids, slots, seq_lens, kv_rows, table,
                                scratch_slot, scratch_page, page_size)
        return
    naive_feed_decode_rows(tokens, rows, can_stop, stop_ids, ids, slots, seq_lens, kv_rows, table, scratch_slot,
                           scratch_page, page_size)


__all__ = ["feed_decode_rows"]
