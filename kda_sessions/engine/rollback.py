"""Rolling a sequence back after a model call that failed half-way through a step.

The pools are updated in place, layer by layer, so a model call that raises leaves every row of its batch with
some layers advanced and others not. ``roll_back`` restores the invariant the rest of the engine relies on: the
sequence's pool state equals a fresh prefill of ``tokens[:num_cached]``.
"""

from __future__ import annotations

from ..errors import OutOfPages
from .pool import Pools, pages_needed
from .sequence import Sequence


def roll_back(s: Sequence, pools: Pools) -> None:
    """Bring ``s`` back to its newest exact checkpoint state (else the empty state) and set ``num_cached`` to that
    position. KV pages past it leave the sequence; one it shares (with a fork or a checkpoint) is never written
    again: the partial page is copied first. Caller holds ``pools.mutex``."""
    assert s.slot is not None
    P = pools.page_size
    exact = [c for c in s.checkpoints.values() if c.state_id is not None and 0 <= c.state_pos <= s.num_cached]
    cp = max(exact, key=lambda c: c.state_pos, default=None)
    if cp is None or cp.state_id is None:
        start_over(s, pools)
        return
    pos = cp.state_pos
    keep = pages_needed(pos, P)
    rows = pos - (keep - 1) * P
    pools.restore(cp.state_id, s.slot)
    if s.pages[keep:]:
        pools.pages.decref(s.pages[keep:])
        del s.pages[keep:]
    if keep and rows < P:  # the partial page is written again from row `rows` on
        if pools.pages.refs[s.pages[keep - 1]] > 1:
            try:
                (page,) = pools.pages.alloc(1)
            except OutOfPages:  # no page to copy into
                start_over(s, pools)
                return
            pools.copy_rows(s.pages[keep - 1], page, rows)
            pools.pages.decref([s.pages[keep - 1]])
            s.pages[keep - 1] = page
        pools.pages.digests.pop(s.pages[keep - 1], None)
    s.num_cached = pos


def start_over(s: Sequence, pools: Pools) -> None:
    """The empty state: the next call prefills the whole sequence again. Caller holds ``pools.mutex``."""
    assert s.slot is not None
    pools.zero_slot(s.slot)
    pools.pages.decref(s.pages)
    s.pages = []
    s.num_cached = 0
