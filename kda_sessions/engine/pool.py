"""Slot and page allocators for the state pools. Pages are reference-counted: a fork or a checkpoint that
shares a full page only increments its count; a page returns to the free list when the count drops to 0."""

from __future__ import annotations

from ..errors import OutOfPages, OutOfSlots


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
