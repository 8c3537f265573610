"""Decode batches of a CPU model without a tensor made per step.

A CPU decode step streams more weights than the caches hold, so the host work around it runs cache-cold: there
``torch.tensor`` costs tens of microseconds a call, and a batch needs five (token ids, slots, page table, cache
rows, cu_seqlens). Here one ``ForwardBatch`` per batch shape is made once, its tensors views of buffers allocated
once, and each step refills them through numpy views of the same memory (no torch call at all).
"""

from __future__ import annotations

import torch

from ..model import ForwardBatch
from .sequence import Sequence


class CpuDecodeBatches:
    """``batch(seqs, ids)``: the ``ForwardBatch`` of one decode step, each sequence feeding its token of ``ids``.

    The batch and its tensors are valid until the next call (the next step refills them): the model reads them within
    its step and keeps none. Buffers grow (doubling) to the largest batch and page table seen."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._alloc(1, 16)

    def _alloc(self, rows: int, width: int) -> None:
        self._longs = torch.zeros(3, rows, dtype=torch.long)  # token ids | slots | new cache rows
        self._table = torch.zeros(rows, width, dtype=torch.int32)
        self._np_longs, self._np_table = self._longs.numpy(), self._table.numpy()
        self._batches: dict[tuple[int, int], ForwardBatch] = {}
        self._written: list[list[int] | None] = [None] * rows  # the page list each table row holds

    def batch(self, seqs: list[Sequence], ids: list[int]) -> ForwardBatch:
        N, P = len(seqs), self.page_size
        width = max(len(s.pages) for s in seqs)
        rows, cap = self._table.shape
        if rows < N or width > cap:
            self._alloc(max(N, 2 * rows) if rows < N else rows, max(width, 2 * cap) if width > cap else cap)
        start = [s.num_cached for s in seqs]
        self._np_longs[:, :N] = [ids, [s.slot for s in seqs], [s.pages[n // P] * P + n % P for s, n in zip(seqs, start)]]
        written = self._written
        for i, s in enumerate(seqs):
            if written[i] != s.pages:  # a new page, or another sequence in this row
                row = self._np_table[i]
                row[: len(s.pages)] = s.pages
                row[len(s.pages) :] = 0
                written[i] = list(s.pages)
        batch = self._batches.get((N, width))
        if batch is None:
            longs = self._longs
            batch = self._batches[N, width] = ForwardBatch(
                input_ids=longs[0, :N], num_new=[1] * N, start=start, slots=longs[1, :N],
                page_table=self._table[:N, :width], kv_rows=longs[2, :N])
        batch.start = start
        return batch
