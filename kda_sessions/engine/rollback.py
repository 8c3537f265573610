"""Rolling a session back after a model call that failed half-way through a step.

The pools are updated in place, layer by layer, so a model call that raises leaves every row of its batch with
some layers advanced and others not. ``roll_back`` restores the invariant the rest of the engine relies on: the
session's pool state equals a fresh prefill of ``tokens[:num_cached]``.
"""

from __future__ import annotations

from ..model import StatePools
from ..sessions.state import SessionState
from .pool import OutOfPages, PageAllocator
from .scheduler import pages_needed


def roll_back(s: SessionState, pools: StatePools, pages: PageAllocator) -> None:
    """Bring ``s`` back to its newest exact checkpoint state (else the empty state) and set ``num_cached`` to that
    position. KV pages past it leave the session; one it shares (with a fork or a checkpoint) is never written
    again: the partial page is copied first. Caller holds the pools' mutex."""
    assert s.slot is not None
    P = pools.page_size
    exact = [c for c in s.checkpoints.values()
             if c.kda is not None and c.conv is not None and 0 <= c.state_pos <= s.num_cached]
    cp = max(exact, key=lambda c: c.state_pos, default=None)
    if cp is None:
        _start_over(s, pools, pages)
        return
    assert cp.kda is not None and cp.conv is not None
    for i, (st, cv) in enumerate(zip(pools.kda, pools.conv)):
        st[s.slot] = cp.kda[i].to(st.device)
        cv[s.slot] = cp.conv[i].to(cv.device)
    pos = cp.state_pos
    keep = pages_needed(pos, P)
    if s.pages[keep:]:
        pages.decref(s.pages[keep:])
        del s.pages[keep:]
    rows = pos - (keep - 1) * P
    if keep and rows < P:  # the partial page is written again from row `rows` on
        last = s.pages[keep - 1]
        if pages.refs[last] > 1:
            try:
                (page,) = pages.alloc(1)
            except OutOfPages:  # no page to copy into
                _start_over(s, pools, pages)
                return
            for kv in pools.kv:
                kv[page, :rows] = kv[last, :rows]
            pages.decref([last])
            s.pages[keep - 1] = page
        pages.digests.pop(s.pages[keep - 1], None)
    s.num_cached = pos


def _start_over(s: SessionState, pools: StatePools, pages: PageAllocator) -> None:
    """The empty state: the next call prefills the whole session again."""
    assert s.slot is not None
    for st, cv in zip(pools.kda, pools.conv):
        st[s.slot].zero_()
        cv[s.slot].zero_()
    pages.decref(s.pages)
    s.pages = []
    s.num_cached = 0
