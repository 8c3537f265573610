"""One decode step undone for rows whose end the host finds only after the next step is queued.

With decode ahead (``EngineConfig.decode_ahead``) a step feeds the tokens of the step before it on the device,
before the host has read them. A stop token is seen on the device (the row runs as a dummy), but a ``stop``
string is found by the host, in the detokenized text, once the next step has already moved that row's KDA state
and conv tails past the token that ended it. ``StepUndo`` keeps a copy of those rows' states from before the
step, and puts it back when the host finds the stop: the session then ends with its last token pending, as
without decode ahead. The latent KV row the step wrote needs no undo: it is that token's row at that position,
which the next call writes again, and no row at or past ``num_cached`` is read.

The copy is made on the device, in the stream order of the steps: the 48B shape's state is 42 MB a row (20 layers
of 32 x 128 x 128 float32), 42.5 us a row on an H100 (``bench/undo_copy.py``). Its buffer is allocated on first use,
sized to the rows that need it (a power of two), and kept; where the device has no room for it, those steps do not
run ahead.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..model import StatePools

log = logging.getLogger(__name__)


class StepUndo:
    """Copies of some slots' states (``save``), put back into a slot on demand (``restore``). Where the pools hold
    every layer's states in one tensor (``StatePools.kda_layers``, as ``HybridModel.allocate_pools`` makes them), a
    row is two strided copies (states, conv tails); else two copies a layer."""

    def __init__(self, tensors: StatePools) -> None:
        self.layers = tensors.kda + tensors.conv
        self.stacked = ([tensors.kda_layers, tensors.conv_layers]
                        if tensors.kda_layers is not None and tensors.conv_layers is not None else None)
        self.rows = 0
        """Rows the buffer holds."""
        self._buffer: list[Tensor] = []
        self._slot_views: dict[int, list[Tensor]] = {}
        self._row_views: list[list[Tensor]] = []
        self._warned = False

    @property
    def bytes_per_row(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.layers)

    def reserve(self, n: int) -> bool:
        """Whether the buffer holds ``n`` rows, growing it (to a power of two) if need be; False where the device
        has no room for them (logged once)."""
        if n <= self.rows or not self.layers:
            return True
        rows = 1 << (n - 1).bit_length()
        self._buffer, self._row_views, self.rows = [], [], 0  # the old one goes first: the new holds its rows
        try:
            self._buffer = self._allocate(rows)
        except torch.OutOfMemoryError:
            if not self._warned:
                self._warned = True
                log.warning("no device memory for %d rows of decode-ahead undo state (%.0f MB each): rows with stop "
                            "strings decode without running ahead", rows, self.bytes_per_row / 2**20)
            return False
        if self.stacked is None:
            self._row_views = [[b[r] for b in self._buffer] for r in range(rows)]
        else:  # [L, rows, ...]: row r of every layer
            self._row_views = [[b[:, r] for b in self._buffer] for r in range(rows)]
        self.rows = rows
        return True

    def _allocate(self, rows: int) -> list[Tensor]:
        if self.stacked is not None:
            return [torch.empty((t.shape[0], rows, *t.shape[2:]), dtype=t.dtype, device=t.device) for t in self.stacked]
        return [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in self.layers]

    def _slot(self, slot: int) -> list[Tensor]:
        views = self._slot_views.get(slot)
        if views is None:
            if self.stacked is not None:
                views = [t[:, slot] for t in self.stacked]
            else:
                views = [t[slot] for t in self.layers]
            self._slot_views[slot] = views
        return views

    def _copy(self, dst: list[Tensor], src: list[Tensor]) -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    def save(self, slots: list[int]) -> None:
        """Row i of the buffer = slot ``slots[i]``'s state, queued on the device (``reserve`` first). A model
        without KDA layers has no state to keep."""
        if not self.layers:
            return
        assert len(slots) <= self.rows
        if slots:
            self._copy([v for i in range(len(slots)) for v in self._row_views[i]],
                       [v for s in slots for v in self._slot(s)])

    def restore(self, row: int, slot: int) -> None:
        """Slot ``slot``'s state = row ``row`` of the buffer, queued on the device."""
        if not self.layers:
            return
        self._copy(self._slot(slot), self._row_views[row])
