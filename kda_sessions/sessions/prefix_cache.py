"""The prefix cache's policy: where checkpoints are kept inside long prompts, which checkpoint states stay in host
memory, and starting a session's prefill from the longest indexed prefix of what it is about to run.

Checkpoints every ``checkpoint_interval_pages`` pages (named ``__at-B``: state at token B, a page boundary, for
the prefix ``tokens[:B + 1]``) let a request that resends a long prompt with another tail, or again after a
cancelled prefill, reuse all of it up to the last boundary. Their host states, with every other checkpoint's,
are bounded by ``checkpoint_memory_bytes``: the automatic checkpoints least recently used (captured, or a start
for another session) are dropped first; named checkpoints and conversation heads (system prompt + tools) stay.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from itertools import islice

from ..engine.core import EngineCore
from ..engine.pool import pages_needed
from ..engine.scheduler import Work
from ..errors import KdaSessionsError, SessionNotFound
from .prefix_index import PrefixHit
from .residency import Residency, is_head
from .state import Checkpoint, SessionState
from .store_io import StoreIO

INTERVAL = "__at-"


def is_automatic(name: str) -> bool:
    """Checkpoints the engine makes (message ends, interval boundaries), which the memory policy may drop."""
    return name.startswith(("msg-", INTERVAL))


class PrefixCache:
    """``held`` lists the sessions the manager holds, ``get`` finds one by (tenant, id), ``load_unheld`` reads a
    stored one's bookkeeping without holding it, ``store_of`` gives a tenant's StoreIO (its prefix index);
    ``counters`` are the manager's (prefix_cache_*)."""

    def __init__(
        self,
        core: EngineCore,
        residency: Residency,
        held: Callable[[], Iterable[SessionState]],
        get: Callable[[str | None, str], SessionState | None],
        load_unheld: Callable[[str | None, str], Awaitable[SessionState]],
        store_of: Callable[[str | None], StoreIO],
        counters: dict[str, int],
    ) -> None:
        self.pools = core.pools
        self.config = core.config
        self.residency = residency
        self.held = held
        self.get = get
        self.load_unheld = load_unheld
        self.store_of = store_of
        self.counters = counters
        tensors = core.pools.tensors
        self.state_bytes = sum(t[0].numel() * t.element_size() for t in [*tensors.kda, *tensors.conv])
        """Host bytes of one checkpoint state (KDA states and conv tails of every KDA layer)."""

    @property
    def max_states(self) -> int:
        return self.config.checkpoint_memory_bytes // max(1, self.state_bytes)

    # -- where checkpoints are kept --------------------------------------------------------------------------

    def interval_checkpoints(self, s: SessionState, end: int, others: int) -> list[Checkpoint]:
        """Checkpoints at the interval boundaries B in (num_cached, end] that a prefill of ``s.tokens[:end]``
        passes, except those whose prefix the tenant's index already holds. Room is made for them and for
        ``others`` states the work captures anyway; when the budget cannot hold them all, every n-th is kept
        (the last one always), so they stay aligned. Caller holds ``s.lock``."""
        step = self.config.checkpoint_interval_pages * self.config.page_size
        if not step:
            return []
        bounds = list(range((s.num_cached // step + 1) * step, min(end, s.num_tokens - 1) + 1, step))
        held = self.store_of(s.tenant).index.indexed(s.tokens, [b + 1 for b in bounds])
        bounds = [b for b in bounds if b + 1 not in held and INTERVAL + str(b) not in s.checkpoints]
        if not bounds:
            return []
        room = self.make_room(s, len(bounds) + others) - others
        if room <= 0:
            return []
        stride = -(-len(bounds) // room)
        kept = bounds[::-1][::stride][::-1]
        return [Checkpoint(name=f"{INTERVAL}{b}", position=b + 1, state_pos=-1) for b in kept]

    def settle(self, work: Work) -> None:
        """After a work on ``s`` (the caller holds its lock): index the interval checkpoints its prefill took,
        then bring the checkpoint states back within the budget."""
        s = work.session
        assert isinstance(s, SessionState)
        index = self.store_of(s.tenant).index
        index.add_many(s.tokens, [
            PrefixHit(s.id, c.name, c.position) for c in work.checkpoints
            if c.name.startswith(INTERVAL) and c.state_pos >= 0 and s.checkpoints.get(c.name) is c
        ])
        self.make_room(s, 0)

    # -- the memory bound ------------------------------------------------------------------------------------

    def make_room(self, current: SessionState, need: int) -> int:
        """Drop least recently used automatic checkpoint states (of idle sessions and ``current``, whose lock the
        caller holds) until ``need`` more fit in the budget; returns how many fit (at most ``need``)."""
        free = self.max_states - len(self.pools.host)
        if free >= need:
            return need
        victims = sorted(
            ((c, s) for s in self.held() if s is current or not s.lock.locked()
             for c in s.checkpoints.values() if c.resident and not self.pinned(s, c)),
            key=lambda cs: cs[0].last_used,
        )
        for c, s in victims:
            if free >= need:
                break
            self.drop(s, c)
            free += 1
        return max(0, min(need, free))

    @staticmethod
    def pinned(s: SessionState, c: Checkpoint) -> bool:
        """Named checkpoints, and the conversation's head (system prompt + tools)."""
        return not is_automatic(c.name) or is_head(s, c)

    def drop(self, s: SessionState, c: Checkpoint) -> None:
        """Free the checkpoint's host state and pages; one never saved is forgotten, index entry included (a saved
        one keeps its stored blobs: a fork loads them back)."""
        self.residency.release_checkpoint(c)
        if c.state_blob is None or c.page_blobs is None:
            del s.checkpoints[c.name]
            self.store_of(s.tenant).index.remove(s.id, c.name)

    # -- starting from an indexed prefix ---------------------------------------------------------------------

    async def reuse(self, s: SessionState, end: int) -> int:
        """Before ``s.tokens[num_cached:end]`` are prefilled, seat ``s`` on the longest indexed prefix of them
        that another of the tenant's sessions (held, or in the store) checkpointed: equal tokens, so the same
        state and KV rows. Only when that saves at least a page. Returns the tokens gained. Caller holds
        ``s.lock``; ``s`` is resident."""
        P = self.config.page_size
        if end - s.num_cached < P:
            return 0
        index = self.store_of(s.tenant).index
        hits = (h for h in index.matches(s.tokens, min(end + 1, s.num_tokens)) if h.session_id != s.id)
        for hit in islice(hits, 4):  # a few tries: entries whose sessions were deleted are removed on the way
            if hit.position - 1 < s.num_cached + P:
                break
            try:
                gained = await self._seat_from(s, hit)
            except SessionNotFound:  # deleted since it was indexed
                index.remove(hit.session_id, hit.checkpoint)
                gained = 0
            except KdaSessionsError:  # unreadable, or no pages to load it into: the next, else prefill
                gained = 0
            if gained:
                self.counters["prefix_cache_lookups"] += 1
                self.counters["prefix_cache_hits"] += 1
                self.counters["prefix_cache_hit_tokens"] += gained
                return gained
        return 0

    async def _seat_from(self, s: SessionState, hit: PrefixHit) -> int:
        """Seat ``s`` on ``hit``'s checkpoint: from memory, else loaded from the store (a held parent's under its
        lock, skipped while it is busy; an unheld parent's only for this seat)."""
        index = self.store_of(s.tenant).index
        parent = self.get(s.tenant, hit.session_id)
        transient = parent is None
        if parent is None:
            parent = await self.load_unheld(s.tenant, hit.session_id)
        cp = parent.checkpoints.get(hit.checkpoint)
        if cp is None or cp.position != hit.position:
            index.remove(hit.session_id, hit.checkpoint)
            return 0
        io = self.store_of(s.tenant)
        if transient:
            try:
                await io.materialize(cp)
                return await self.pools.run_locked(partial(self._seat, s, cp))
            finally:
                self.residency.release_checkpoint(cp)
        gained = await self.pools.run_locked(partial(self._seat, s, cp))
        if gained or parent.lock.locked() or (cp.state_blob is None or cp.page_blobs is None):
            return gained
        async with parent.lock:  # dropped from memory by the budget, kept in the store
            await io.materialize(cp)
            return await self.pools.run_locked(partial(self._seat, s, cp))

    def _seat(self, s: SessionState, cp: Checkpoint) -> int:
        """Under the pools' mutex: ``s``'s slot = the checkpoint's state, its pages = the checkpoint's (full pages
        shared, the partial one copied), when the checkpoint's state and pages are in memory and go further."""
        pos = cp.state_pos
        if cp.state_id is None or len(cp.pages) < pages_needed(pos, self.config.page_size) or pos <= s.num_cached:
            return 0
        assert s.slot is not None
        if pos % self.config.page_size and not self.pools.pages.num_free:
            return 0  # no page to copy the partial one into
        pages = self.pools.share(cp.pages, pos)
        self.pools.restore(cp.state_id, s.slot)
        self.pools.pages.decref(s.pages)
        gained = pos - s.num_cached
        cp.last_used = time.monotonic()
        s.pages, s.num_cached = pages, pos
        return gained
