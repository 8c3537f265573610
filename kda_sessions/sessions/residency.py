"""Where sessions' states live: a state slot and KV pages while resident, the store (and its RAM tier) when moved
out. Gives slots and pages, evicting idle sessions to the store when none are free; seats new sessions on a
checkpoint or another session's head; captures, trims and releases checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio

from ..engine.checkpoints import capture, release
from ..engine.core import EngineCore
from ..errors import OutOfPages, OutOfSlots, SessionBusy, SnapshotConflict
from .state import Checkpoint, SessionState
from .store_io import StoreIO

log = logging.getLogger(__name__)


def is_head(s: SessionState, c: Checkpoint) -> bool:
    """Whether ``c`` is the conversation's head: the end of its leading system messages (with the tools), the
    prefix other conversations of the tenant share. Kept in memory however long the conversation grows."""
    return c.name.startswith("msg-") and c.num_messages > 0 and all(
        m.get("role") == "system" for m in s.messages[: c.num_messages]
    )


class Residency:
    """``held`` lists the sessions the manager holds (the eviction candidates), ``save`` saves one (its caller
    holds its lock) and ``store_of`` is the StoreIO of a tenant."""

    def __init__(
        self,
        core: EngineCore,
        held: Callable[[], Iterable[SessionState]],
        save: Callable[[SessionState], Awaitable[Any]],
        store_of: Callable[[str | None], StoreIO],
    ) -> None:
        self.core = core
        self.pools = core.pools
        self.evictions = 0  # idle sessions saved to the store to free their slot and pages
        self.config = core.config
        self.held = held
        self.save = save
        self.store_of = store_of

    # -- slots and pages -------------------------------------------------------------------------------------

    async def make_resident(self, s: SessionState) -> None:
        """Give ``s`` a state slot (evicting idle sessions to the store if none is free) and, for a session that
        was saved and moved out, load its head state and pages back. On failure or cancellation nothing stays
        allocated."""
        if s.resident:
            return
        slot = await self._alloc_slot(exclude=s)
        s.slot = slot
        try:  # a failure or a cancellation anywhere from here leaves it as it was: not resident
            await self.pools.run_locked(lambda: self.pools.zero_slot(slot))
            if s.head_blobs is not None:
                await self.ensure_pages(s, s.num_cached)
                await self.store_of(s.tenant).restore_head(s)
        except BaseException:
            self.release(s, keep_checkpoint_states=True)
            raise

    async def _alloc_slot(self, exclude: SessionState) -> int:
        """A free slot, else an idle session's (evicted to the store); while every slot's session is busy, wait (up
        to ``config.page_wait_s``) for one to become idle, so that more concurrent requests than slots queue
        instead of failing."""
        deadline = anyio.current_time() + self.config.page_wait_s
        while True:
            with self.pools.mutex:
                try:
                    return self.pools.slots.alloc()
                except OutOfSlots:
                    pass
            if await self.evict_one(exclude):
                continue
            left = deadline - anyio.current_time()
            busy = any(x.lock.locked() for x in self.held() if x.resident and x is not exclude)
            n = self.pools.slots.num_slots
            if not busy:
                raise OutOfSlots(f"all {n} state slots hold sessions this engine cannot move out (saving them failed)")
            if left <= 0:
                raise OutOfSlots(f"all {n} state slots hold sessions that stayed busy for {self.config.page_wait_s:g} s")
            with anyio.move_on_after(min(left, 0.25)):  # a work ending, or a caller releasing its session
                await self.core.work_ended.wait()

    async def ensure_pages(self, s: SessionState, total_tokens: int) -> None:
        """Make sure the pool can give ``s`` pages for ``total_tokens`` tokens: evict idle sessions, and while
        running requests hold pages, wait (up to ``config.page_wait_s``) for them to end and their sessions to
        become idle, so that a request queues instead of failing when the pool is only busy for now."""
        need = self.core.pages_for(total_tokens) - len(s.pages)
        deadline = anyio.current_time() + self.config.page_wait_s
        while need > self.pools.pages.num_free:
            if await self.evict_one(s):
                continue
            busy = self.core.busy or any(x.lock.locked() for x in self.held() if x is not s)
            left = deadline - anyio.current_time()
            if not busy or left <= 0:
                raise OutOfPages(f"need {need} KV pages, {self.pools.pages.num_free} free and every session is busy")
            with anyio.move_on_after(min(left, 0.25)):  # a work ending, or a caller releasing its session
                await self.core.work_ended.wait()

    async def evict_one(self, exclude: SessionState | None = None) -> bool:
        """Save the least recently used idle resident session to the store and free its slot and pages. A session
        this engine cannot save (another engine holds its lease, or saved it since) is skipped for the next one."""
        idle = [s for s in self.held() if s.resident and s is not exclude and not s.lock.locked()]
        for victim in sorted(idle, key=lambda s: s.last_used):
            if victim.lock.locked():
                continue
            async with victim.lock:
                if not victim.resident:
                    return True
                never_saved = victim.generation == 0
                try:
                    await self.save(victim)
                except (SessionBusy, SnapshotConflict) as e:
                    log.warning("cannot evict session %s: %s: %s", victim.id, type(e).__name__, e)
                    continue
                victim.stored_by_eviction_only = victim.stored_by_eviction_only or never_saved
                self.release(victim, keep_checkpoint_states=True)
            self.evictions += 1
            log.info("evicted idle session %s to the store", victim.id)
            return True
        return False

    def release(self, s: SessionState, keep_checkpoint_states: bool) -> None:
        """Free the session's slot and pages, and its checkpoints' pages (their host states too unless
        ``keep_checkpoint_states``: a saved checkpoint keeps its stored blobs either way)."""
        with self.pools.mutex:
            if s.slot is not None:
                self.pools.slots.free(s.slot)
                s.slot = None
            if s.pages:
                self.pools.pages.decref(s.pages)
                s.pages = []
            for cp in s.checkpoints.values():
                release(cp, self.pools, keep_state=keep_checkpoint_states)

    # -- seating new sessions --------------------------------------------------------------------------------

    async def seat_on_checkpoint(self, child: SessionState, cp: Checkpoint) -> None:
        """Give ``child`` a slot holding the checkpoint's state (resident: see StoreIO.materialize), share its
        full pages and copy the partial one."""
        await self.make_resident(child)

        def seat() -> None:
            assert cp.state_id is not None and child.slot is not None
            self.pools.restore(cp.state_id, child.slot)
            child.pages = self.pools.share(cp.pages, cp.state_pos)

        await self.pools.run_locked(seat)

    async def seat_on_head(self, child: SessionState, parent: SessionState) -> None:
        """Give ``child`` the parent's current state: a slot-to-slot copy on the device, full pages shared and
        the partial one copied. The caller holds the parent's lock (nothing runs on it)."""
        await self.make_resident(parent)  # an evicted parent's head is in the store only
        await self.make_resident(child)

        def seat() -> None:
            assert parent.slot is not None and child.slot is not None
            self.pools.copy_slot(parent.slot, child.slot)
            child.pages = self.pools.share(parent.pages, parent.num_cached)

        await self.pools.run_locked(seat)

    # -- checkpoints -----------------------------------------------------------------------------------------

    async def capture_head(self, s: SessionState, cp: Checkpoint) -> None:
        """Make ``cp`` the session's checkpoint of its current position (state and pages). The device-to-host
        copy runs on a worker thread, not on the event loop, and after the pools' mutex is released
        (``Pools.read_slot_async``). The caller holds ``s.lock``."""

        def run() -> None:
            assert s.slot is not None
            cp.position = s.num_tokens
            capture(s, cp, s.num_cached, self.pools.read_slot_async(s.slot), self.pools)

        await self.pools.run_locked(run)

    def release_checkpoint(self, cp: Checkpoint, keep_state: bool = False) -> None:
        with self.pools.mutex:
            release(cp, self.pools, keep_state=keep_state)

    def trim_checkpoints(self, s: SessionState) -> None:
        """Bound the host memory a long conversation holds in checkpoints: keep the newest
        ``max_checkpoints_in_memory`` automatic (msg-N) ones in memory; an older one that was saved keeps only its
        stored blobs (a fork loads them back), an unsaved one is dropped, its prefix index entry too. Named
        checkpoints and the head are always kept."""
        auto = [c for c in s.checkpoints.values()
                if c.name.startswith("msg-") and (c.resident or c.pages) and not is_head(s, c)]
        for c in sorted(auto, key=lambda c: c.position)[: max(0, len(auto) - self.config.max_checkpoints_in_memory)]:
            self.release_checkpoint(c)
            if c.state_blob is None or c.page_blobs is None:
                del s.checkpoints[c.name]
                self.store_of(s.tenant).index.remove(s.id, c.name)
