"""A checkpoint takes a state and pages, and gives them back: the two operations every owner of checkpoints
(the step's postprocess, the session manager) goes through."""

from __future__ import annotations

from .pool import PendingState, Pools, State, pages_needed
from .sequence import Checkpoint, Sequence


def capture(s: Sequence, c: Checkpoint, state_pos: int, state: State, pools: Pools) -> None:
    """Make ``c`` hold ``state`` (host copies of the KDA and conv state at ``state_pos``, or copies under way:
    ``Pools.read_slot_async``) and share the pages
    covering ``state_pos`` tokens of ``s``; ``c`` becomes ``s``'s checkpoint of that name (any other of the same
    name is released). Caller holds ``pools.mutex``."""
    release(c, pools)
    old = s.checkpoints.get(c.name)
    if old is not None and old is not c:
        release(old, pools)
    c.pages = s.pages[: pages_needed(state_pos, pools.page_size)]
    pools.pages.incref(c.pages)
    c.state_id = pools.host.put(state) if isinstance(state, PendingState) else pools.host.put(*state)
    c.state_pos = state_pos
    c.state_blob, c.page_blobs = None, None
    s.checkpoints[c.name] = c


def release(c: Checkpoint, pools: Pools, keep_state: bool = False) -> None:
    """Give back the checkpoint's pages (and its host state unless ``keep_state``). Caller holds ``pools.mutex``."""
    if c.pages:
        pools.pages.decref(c.pages)
        c.pages = []
    if not keep_state and c.state_id is not None:
        pools.host.free(c.state_id)
        c.state_id = None
