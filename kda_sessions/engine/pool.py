"""The state pools and their allocators: every read, write and copy of a KDA slot or a KV page goes through
``Pools``, under its ``mutex``.

Pages are reference-counted: a fork or a checkpoint that shares a full page only increments its count; a page
returns to the free list when the count drops to 0. Checkpoint states live in a host pool (``HostStates``)
indexed by id: a checkpoint names its state, it does not hold it.

Shapes: KDA slot [L_kda, H, K, V] float32, conv tail [L_kda, W - 1, Dc] (model dtype), KV page [P, C] per MLA
layer (C = r + dr).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import anyio
import torch
from torch import Tensor

from ..errors import OutOfPages, OutOfSlots
from ..model import StatePools

T = TypeVar("T")
log = logging.getLogger(__name__)

STAGING_SHAPES = 4
"""Page-locked staging buffers ``Pools`` keeps for its host copies (a slot's state and conv tails: two)."""


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_slots} state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, slot
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)


class PageAllocator:
    """Free list, reference counts and reservations. A request reserves at admission the pages it may need, so
    that requests admitted together cannot run out of pages in the middle of their generations; ``num_free``
    counts only pages nobody has reserved."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages
        self.reserved = 0
        """Free pages set aside for admitted requests (see ``reserve``)."""
        self.digests: dict[int, str] = {}
        """Digest of each full page's blob, valid until the page is freed: full pages never change."""

    def alloc(self, n: int = 1, reserved: int = 0) -> list[int]:
        """``n`` pages, ``reserved`` of them out of the caller's reservation."""
        assert 0 <= reserved <= min(n, self.reserved), (reserved, n, self.reserved)
        if n - reserved > self.num_free:
            raise OutOfPages(f"need {n - reserved} KV pages, {self.num_free} of {self.num_pages} are free")
        self.reserved -= reserved
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def reserve(self, n: int) -> None:
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} of {self.num_pages} are free")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved, (n, self.reserved)
        self.reserved -= n

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, p
            self.refs[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] > 0, p
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
                self.digests.pop(p, None)

    @property
    def num_free(self) -> int:
        """Free pages nobody has reserved."""
        return len(self._free) - self.reserved


class PendingState:
    """A state on its way to the host (``Pools.read_slot_async``): ``result`` waits for the copy."""

    def __init__(self, future: Future[tuple[Tensor, Tensor]]) -> None:
        self.future = future

    def result(self) -> tuple[Tensor, Tensor]:
        return self.future.result()


def on_host(state: State) -> tuple[Tensor, Tensor]:
    """``state``'s tensors on the host, waiting for them where their copy is under way."""
    return state.result() if isinstance(state, PendingState) else state


State = tuple[Tensor, Tensor] | PendingState
"""A KDA and conv state on the host, or on its way there."""


class HostStates:
    """Checkpoint states on the host, by id: (kda [L_kda, H, K, V] float32, conv [L_kda, W - 1, Dc]). A state put
    while its copy is under way (``PendingState``) is waited for by ``get``."""

    def __init__(self) -> None:
        self._states: dict[int, State] = {}
        self._ids = itertools.count(1)

    def put(self, kda: Tensor | PendingState, conv: Tensor | None = None) -> int:
        if isinstance(kda, PendingState):
            state: State = kda
        else:
            assert conv is not None and kda.device.type == "cpu" and conv.device.type == "cpu"
            state = (kda, conv)
        sid = next(self._ids)
        self._states[sid] = state
        return sid

    def get(self, state_id: int) -> tuple[Tensor, Tensor]:
        return on_host(self._states[state_id])

    def free(self, state_id: int) -> None:
        del self._states[state_id]

    def __len__(self) -> int:
        return len(self._states)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Pools:
    """The model's ``StatePools`` with their slot and page allocators and the host pool of checkpoint states.
    Callers hold ``mutex`` around every call (the step thread and the event loop share the pools)."""

    def __init__(self, tensors: StatePools, num_slots: int, num_pages: int) -> None:
        self.tensors = tensors
        self.slots = SlotAllocator(num_slots)
        self.pages = PageAllocator(num_pages)
        self.host = HostStates()
        self.mutex = threading.RLock()
        self.page_size = tensors.page_size
        self.async_capture = True
        """On a CUDA device, ``read_slot_async`` copies to the host on a side stream from a worker thread; off: it
        waits for the copy, as ``read_slot``."""
        self._copier: tuple[ThreadPoolExecutor, torch.cuda.Stream] | None = None
        self.pinned_staging = True
        """``to_host_async``'s worker copies a state into page-locked buffers it keeps (a DMA at the link's rate), then
        on the CPU into the state's own memory; off (or where page-locked memory cannot be had): ``.cpu()``, a copy
        into pageable memory through the driver's own staging (33 ms for the 48B shape's 43 MB on an H100 machine
        against 0.89 into page-locked buffers, ``bench/undo_copy.py``)."""
        self._staging: dict[tuple[tuple[int, ...], torch.dtype], Tensor | None] = {}
        """The worker's page-locked buffers by shape and dtype (None: allocating one failed); only it uses them."""

    async def run_locked(self, fn: Callable[[], T]) -> T:
        """``fn()`` under the mutex on a worker thread: device copies never hold up the event loop (and the step
        thread may hold the mutex for a whole model call)."""

        def run() -> T:
            with self.mutex:
                return fn()

        return await anyio.to_thread.run_sync(run)

    # -- slots -----------------------------------------------------------------------------------------------

    def read_slot(self, slot: int) -> tuple[Tensor, Tensor]:
        """Host copies of the slot's state: (kda [L_kda, H, K, V], conv [L_kda, W - 1, Dc])."""
        kda = torch.stack([st[slot] for st in self.tensors.kda]).cpu()
        conv = torch.stack([cv[slot] for cv in self.tensors.conv]).cpu()
        return kda, conv

    def read_slot_async(self, slot: int) -> State:
        """``read_slot`` without waiting: on a CUDA device (``async_capture``) the slot is copied on the device, in
        the stream's order (~30 us for the 48B shape's 42 MB), and from that copy to the host on a side stream by a
        worker thread, so the caller does not wait for the host copy (into pageable memory: 33 ms for the 48B shape's
        43 MB on an H100 machine, ``bench/undo_copy.py``), and a step queued after it may change the slot.
        ``HostStates.get`` waits for it."""
        t = self.tensors
        if not self.async_capture or not t.kda or t.kda[0].device.type != "cuda":
            return self.read_slot(slot)
        if t.kda_layers is not None and t.conv_layers is not None:
            kda, conv = t.kda_layers[:, slot].clone(), t.conv_layers[:, slot].clone()
        else:
            kda, conv = torch.stack([st[slot] for st in t.kda]), torch.stack([cv[slot] for cv in t.conv])
        return self.to_host_async(kda, conv)

    def close(self) -> None:
        """Wait for the host copies under way and end their worker thread."""
        if self._copier is not None:
            self._copier[0].shutdown(wait=True)
            self._copier = None
        self._staging.clear()

    def to_host_async(self, kda: Tensor, conv: Tensor) -> PendingState:
        """Host copies of device tensors that nothing writes any more, made on a side stream by a worker thread
        once the current stream has produced them."""
        if self._copier is None:
            self._copier = (ThreadPoolExecutor(1, thread_name_prefix="kda-state-copy"), torch.cuda.Stream(kda.device))
        pool, stream = self._copier
        ready = torch.cuda.Event()
        ready.record()
        held = [kda, conv]

        def copy() -> tuple[Tensor, Tensor]:
            k, c = held
            held.clear()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                staged = [(t, self._staging_for(t)) for t in (k, c)]
                for t, buf in staged:
                    if buf is not None:
                        buf.copy_(t, non_blocking=True)
                out = [t.cpu() if buf is None else None for t, buf in staged]  # .cpu() waits for its copy
                stream.synchronize()
            del k, c  # the device copies go back to the allocator before the result is seen, not after
            done = []
            for o, (_, buf) in zip(out, staged):
                if buf is not None:  # out of the page-locked buffer (reused) into memory of the state's own
                    o = torch.empty(buf.shape, dtype=buf.dtype).copy_(buf)
                assert o is not None
                done.append(o)
            return done[0], done[1]

        return PendingState(pool.submit(copy))

    def _staging_for(self, t: Tensor) -> Tensor | None:
        """The worker's page-locked buffer for tensors like ``t`` (None: ``pinned_staging`` off, or no page-locked
        memory to be had, which is logged once per shape)."""
        if not self.pinned_staging:
            return None
        key = (tuple(t.shape), t.dtype)
        if key not in self._staging:
            if len(self._staging) >= STAGING_SHAPES:  # a new shape (another model's pools): drop the old buffers
                self._staging.clear()
            try:
                self._staging[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError as e:
                log.warning("no page-locked buffer of %.1f MB for checkpoint states (%s); copying through pageable "
                            "memory", t.numel() * t.element_size() / 1e6, e)
                self._staging[key] = None
        return self._staging[key]

    def write_slot(self, slot: int, kda: Tensor, conv: Tensor) -> None:
        for i, (st, cv) in enumerate(zip(self.tensors.kda, self.tensors.conv)):
            st[slot] = kda[i].to(st.device)
            cv[slot] = conv[i].to(cv.device)

    def zero_slot(self, slot: int) -> None:
        for st, cv in zip(self.tensors.kda, self.tensors.conv):
            st[slot].zero_()
            cv[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot ``dst`` = slot ``src``, on the device."""
        for st, cv in zip(self.tensors.kda, self.tensors.conv):
            st[dst] = st[src]
            cv[dst] = cv[src]

    def capture(self, slot: int) -> int:
        """The slot's state copied into the host pool; its id."""
        return self.host.put(*self.read_slot(slot))

    def restore(self, state_id: int, slot: int) -> None:
        """Slot ``slot`` = the host state ``state_id``."""
        self.write_slot(slot, *self.host.get(state_id))

    # -- pages -----------------------------------------------------------------------------------------------

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """The first ``rows`` KV rows of page ``src`` into page ``dst``, in every MLA layer."""
        for kv in self.tensors.kv:
            kv[dst, :rows] = kv[src, :rows]

    def write_rows(self, page: int, rows: Tensor) -> None:
        """Page ``page``'s first rows = ``rows`` [L_mla, n, C]."""
        for layer, kv in enumerate(self.tensors.kv):
            kv[page, : rows.shape[1]] = rows[layer].to(kv.device)

    def read_rows(self, page: int, rows: int) -> Tensor:
        """Host copy of page ``page``'s first ``rows`` KV rows: [L_mla, rows, C]."""
        return torch.stack([kv[page, :rows] for kv in self.tensors.kv]).cpu()

    def read_kv(self, pages: list[int], num_tokens: int) -> list[Tensor]:
        """Host copies of the first ``num_tokens`` KV rows held in ``pages``: one [num_tokens, C] per MLA layer."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.tensors.kv[0].device) if self.tensors.kv else None
        return [kv.index_select(0, idx).flatten(0, 1)[:num_tokens].cpu() for kv in self.tensors.kv]  # type: ignore[arg-type]

    def write_kv(self, pages: list[int], rows: list[Tensor]) -> None:
        """The inverse of ``read_kv``: ``rows`` (one [n, C] per MLA layer) into ``pages`` (covering n tokens)."""
        P = self.page_size
        for kv, r in zip(self.tensors.kv, rows):
            n = r.shape[0]
            for i, page in enumerate(pages):
                lo, hi = i * P, min(n, (i + 1) * P)
                if lo < hi:
                    kv[page, : hi - lo] = r[lo:hi].to(kv.device)

    def share(self, pages: list[int], num_tokens: int) -> list[int]:
        """A new holder's pages for the first ``num_tokens`` tokens of ``pages``: full pages shared (refcount),
        the partial last page copied (copy on write)."""
        full, rows = divmod(num_tokens, self.page_size)
        out = list(pages[:full])
        self.pages.incref(out)
        if rows:
            try:
                (page,) = self.pages.alloc(1)
            except BaseException:
                self.pages.decref(out)
                raise
            self.copy_rows(pages[full], page, rows)
            out.append(page)
        return out
