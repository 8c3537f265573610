"""RamTier LRU accounting and TieredStore read-through / write-through."""

from __future__ import annotations

import pytest

from kda_sessions.storage.backends.memory import MemoryStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import BlobNotFound
from kda_sessions.storage.tier import RamTier, TieredStore


def test_lru_evicts_by_bytes() -> None:
    tier = RamTier(capacity_bytes=100)
    tier.put("a", b"x" * 40)
    tier.put("b", b"x" * 40)
    assert tier.get("a") is not None  # a is now most recently used
    tier.put("c", b"x" * 40)  # 120 > 100: evicts b, the least recently used
    assert "b" not in tier and "a" in tier and "c" in tier
    assert tier.bytes == 80 and tier.evictions == 1
    tier.put("d", b"x" * 100)  # exactly the capacity: evicts everything else
    assert len(tier) == 1 and tier.bytes == 100 and tier.evictions == 3
    tier.put("huge", b"x" * 101)  # larger than the capacity: not cached, nothing evicted
    assert "huge" not in tier and "d" in tier
    assert tier.get("zz") is None
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.bytes, stats.blobs) == (1, 1, 3, 100, 1)


def test_discard_and_zero_capacity() -> None:
    tier = RamTier(capacity_bytes=10)
    tier.put("a", b"12345")
    tier.discard("a")
    tier.discard("a")
    assert tier.bytes == 0 and tier.evictions == 0
    off = RamTier(capacity_bytes=0)
    off.put("a", b"1")
    assert len(off) == 0
    with pytest.raises(ValueError):
        RamTier(capacity_bytes=-1)


async def test_tiered_store_reads_ram_first_and_writes_through() -> None:
    base = MemoryStore()
    store = TieredStore(base, RamTier(1000))
    data = b"payload"
    d = digest(data)
    await store.put_blob(d, data)
    assert await base.get_blob(d) == data  # write-through
    base._blobs.clear()  # gone from the persistent store: RAM still serves it
    assert await store.get_blob(d) == data
    assert store.tier.hits == 1
    assert await store.has_blobs([d]) == set()  # existence always asks the persistent store


async def test_tiered_store_fills_ram_on_miss_and_forgets_on_delete() -> None:
    base = MemoryStore()
    data = b"payload"
    d = digest(data)
    await base.put_blob(d, data)
    store = TieredStore(base, RamTier(1000))
    assert await store.get_blobs([d]) == {d: data}
    assert d in store.tier and store.tier.misses == 1
    await store.delete_blob(d)
    assert d not in store.tier
    with pytest.raises(BlobNotFound):
        await store.get_blob(d)
