"""The host-RAM tier: an LRU cache of verified blobs in front of a persistent store.

A session that was idle a moment ago resumes from RAM instead of disk or Redis. Writes go through to the
persistent store (write-through), so the RAM tier never holds the only copy of anything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio.to_thread

from .backends.base import DEFAULT_MAX_IN_FLIGHT, BlobStore, StoreStats, scatter_all
from .stream import BlobStream

DEFAULT_RAM_BYTES = 2 * 1024**3


@dataclass
class RamTierStats:
    """Counters of a RamTier since it was created."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    blobs: int = 0
    capacity_bytes: int = 0


class RamTier:
    """An LRU map digest -> bytes bounded by total bytes; holds only blobs already verified."""

    def __init__(self, capacity_bytes: int = DEFAULT_RAM_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, digest: str) -> bytes | None:
        """The cached bytes (marking them most recently used), or None."""
        data = self._items.get(digest)
        if data is None:
            self.misses += 1
            return None
        self._items.move_to_end(digest)
        self.hits += 1
        return data

    def put(self, digest: str, data: bytes) -> None:
        """Cache `data`, evicting least recently used blobs; a blob larger than the capacity is not cached."""
        if digest in self._items:
            self._items.move_to_end(digest)
            return
        if len(data) > self.capacity_bytes:
            return
        while self._bytes + len(data) > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= len(old)
            self.evictions += 1
        self._items[digest] = bytes(data)
        self._bytes += len(data)

    def discard(self, digest: str) -> None:
        """Forget a blob (not counted as an eviction)."""
        data = self._items.pop(digest, None)
        if data is not None:
            self._bytes -= len(data)

    def __contains__(self, digest: object) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """Bytes currently cached."""
        return self._bytes

    def stats(self) -> RamTierStats:
        return RamTierStats(
            self.hits, self.misses, self.evictions, self._bytes, len(self._items), self.capacity_bytes
        )


class TieredStore(BlobStore):
    """A persistent BlobStore with a RamTier in front: reads try RAM first, writes go to both."""

    def __init__(self, store: BlobStore, tier: RamTier | None = None) -> None:
        self.store = store
        self.tier = tier if tier is not None else RamTier()
        self.url = store.url
        self.lease_ttl_s = store.lease_ttl_s

    async def put_blob(self, digest: str, data: bytes) -> bool:
        written = await self.store.put_blob(digest, data)  # verifies the digest
        self.tier.put(digest, data)
        return written

    async def put_blobs(
        self, blobs: Mapping[str, bytes], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        written = await self.store.put_blobs(blobs, max_in_flight=max_in_flight, verified=verified)
        for d, data in blobs.items():
            self.tier.put(d, data)
        return written

    async def put_blob_stream(
        self, stream: BlobStream, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        written = await self.store.put_blob_stream(stream, max_in_flight=max_in_flight, verified=verified)
        for d, data in stream.blobs().items():
            self.tier.put(d, data)
        return written

    async def get_blob(self, digest: str) -> bytes:
        data = self.tier.get(digest)
        if data is None:
            data = await self.store.get_blob(digest)
            self.tier.put(digest, data)
        return data

    async def get_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        missing: list[str] = []
        for d in dict.fromkeys(digests):
            data = self.tier.get(d)
            if data is None:
                missing.append(d)
            else:
                out[d] = data
        if missing:
            fetched = await self.store.get_blobs(missing, max_in_flight=max_in_flight)
            for d, data in fetched.items():
                self.tier.put(d, data)
            out.update(fetched)
        return out

    async def get_blobs_into(
        self, targets: Sequence[tuple[str, Sequence[memoryview]]], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> list[int]:
        # Blobs RAM lacks are read by the persistent store straight into the buffers and not cached: they have
        # no bytes object to keep, and making one would cost the copy this path exists to avoid.
        hits: list[int] = []
        found: list[tuple[bytes, Sequence[memoryview]]] = []
        missing: list[int] = []
        for i, (d, bufs) in enumerate(targets):
            data = self.tier.get(d)
            if data is None:
                missing.append(i)
            else:
                hits.append(i)
                found.append((data, bufs))
        bad = [hits[j] for j in await anyio.to_thread.run_sync(scatter_all, found)] if found else []
        if missing:
            got = await self.store.get_blobs_into([targets[i] for i in missing], max_in_flight=max_in_flight)
            bad.extend(missing[j] for j in got)
        return sorted(bad)

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        # Asks the persistent store: another process may have deleted what RAM still holds.
        return await self.store.has_blobs(digests)

    async def verify_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> set[str]:
        # RAM holds what this process wrote, not what the persistent store holds now.
        return await self.store.verify_blobs(digests, max_in_flight=max_in_flight)

    async def delete_blob(self, digest: str) -> bool:
        self.tier.discard(digest)
        return await self.store.delete_blob(digest)

    async def list_blobs(self) -> list[str]:
        return await self.store.list_blobs()

    async def touch_blobs(self, digests: Iterable[str]) -> None:
        await self.store.touch_blobs(digests)

    async def recent_blobs(self, within_s: float) -> set[str]:
        return await self.store.recent_blobs(within_s)

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        return await self.store.recently_touched(digests, within_s)

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        await self.store.put_manifest(session_id, data)

    async def get_manifest(self, session_id: str) -> bytes:
        return await self.store.get_manifest(session_id)

    async def list_manifests(self) -> list[str]:
        return await self.store.list_manifests()

    async def delete_manifest(self, session_id: str) -> bool:
        return await self.store.delete_manifest(session_id)

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        return await self.store.acquire_lease(session_id, owner, ttl_s)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        return await self.store.release_lease(session_id, owner)

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        return await self.store.commit_manifest(
            session_id, data, expected_generation=expected_generation, owner=owner, ttl_s=ttl_s
        )

    async def stats(self) -> StoreStats:
        return await self.store.stats()

    async def close(self) -> None:
        await self.store.close()

    def __repr__(self) -> str:
        return f"TieredStore({self.store!r}, ram={self.tier.capacity_bytes} bytes)"
