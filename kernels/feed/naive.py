"""The decode feed in plain torch: the twin of ``triton_feed`` and the CPU path."""

from __future__ import annotations

from torch import Tensor


def naive_feed_decode_rows(
    tokens: Tensor, rows: Tensor, can_stop: Tensor, stop_ids: Tensor, ids: Tensor, slots: Tensor, seq_lens: Tensor,
    kv_rows: Tensor, table: Tensor, scratch_slot: int, scratch_page: int, page_size: int,
) -> None:
    """``feed_decode_rows`` (same arguments and shapes) in plain torch ops."""
    tok = tokens.index_select(0, rows.long())  # [M]
    ids.copy_(tok.clamp(min=0))
    stop = ((tok[:, None] == stop_ids[None, :]).any(1) & (can_stop != 0)) | (tok < 0)  # [M]
    slots.masked_fill_(stop, scratch_slot)
    seq_lens.masked_fill_(stop, 1)
    kv_rows.masked_fill_(stop, scratch_page * page_size)
    table[:, 0].masked_fill_(stop, scratch_page)
