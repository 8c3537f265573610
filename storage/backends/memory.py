"""`memory:` — a volatile store in this process's dicts, for tests and ephemeral sessions."""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..errors import BlobNotFound, ManifestNotFound, SessionBusy, SnapshotConflict
from .base import BlobStore, StoreStats, check_digest, check_session_id, stored_generation, verify_blob


class MemoryStore(BlobStore):
    """Blobs and manifests in dicts. Bytes are copied in and out, so callers cannot alias stored data."""

    def __init__(self) -> None:
        self.url = "memory:"
        self._blobs: dict[str, bytes] = {}
        self._touched: dict[str, float] = {}
        self._manifests: dict[str, bytes] = {}
        self._leases: dict[str, tuple[str, int, float]] = {}  # session -> (owner, fence, monotonic expiry)
        self._fences: dict[str, int] = {}

    async def put_blob(self, digest: str, data: bytes) -> bool:
        check_digest(digest)
        await verify_blob(digest, data, where=f"put into {self.url}")
        self._touched[digest] = time.time()
        if digest in self._blobs:
            return False
        self._blobs[digest] = bytes(data)
        return True

    async def get_blob(self, digest: str) -> bytes:
        check_digest(digest)
        data = self._blobs.get(digest)
        if data is None:
            raise BlobNotFound(digest)
        await verify_blob(digest, data, where=self.url)
        return bytes(data)

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        return {d for d in digests if check_digest(d) in self._blobs}

    async def delete_blob(self, digest: str) -> bool:
        self._touched.pop(check_digest(digest), None)
        return self._blobs.pop(digest, None) is not None

    async def list_blobs(self) -> list[str]:
        return list(self._blobs)

    async def touch_blobs(self, digests: Iterable[str]) -> None:
        now = time.time()
        for d in digests:
            if check_digest(d) in self._blobs:
                self._touched[d] = now

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        cutoff = time.time() - within_s
        return {d for d in digests if self._touched.get(d, -1.0) >= cutoff}

    async def recent_blobs(self, within_s: float) -> set[str]:
        cutoff = time.time() - within_s
        return {d for d, t in self._touched.items() if t >= cutoff}

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        self._manifests[check_session_id(session_id)] = bytes(data)

    async def get_manifest(self, session_id: str) -> bytes:
        data = self._manifests.get(check_session_id(session_id))
        if data is None:
            raise ManifestNotFound(session_id)
        return bytes(data)

    async def list_manifests(self) -> list[str]:
        return list(self._manifests)

    async def delete_manifest(self, session_id: str) -> bool:
        return self._manifests.pop(check_session_id(session_id), None) is not None

    def _take_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        now = time.monotonic()
        held = self._leases.get(check_session_id(session_id))
        if held is not None and held[0] != owner and held[2] > now:
            raise SessionBusy(f"session {session_id!r} is held by another writer (lease token {held[1]})")
        if held is not None and held[0] == owner:
            fence = held[1]
        else:
            fence = self._fences[session_id] = self._fences.get(session_id, 0) + 1
        self._leases[session_id] = (owner, fence, now + ttl_s)
        return fence

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        return self._take_lease(session_id, owner, ttl_s)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        held = self._leases.get(check_session_id(session_id))
        if held is None or held[0] != owner:
            return False
        del self._leases[session_id]
        return True

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        held = self._leases.get(check_session_id(session_id))
        if held is not None and held[0] != owner and held[2] > time.monotonic():
            raise SessionBusy(f"session {session_id!r} is held by another writer (lease token {held[1]})")
        old = self._manifests.get(session_id)
        stored = stored_generation(old)
        if stored != expected_generation and old != data:  # these very bytes stored: the commit landed already
            raise SnapshotConflict(
                f"session {session_id!r}: stored generation is {stored}, this save expected {expected_generation}"
            )
        self._manifests[session_id] = bytes(data)
        return self._take_lease(session_id, owner, ttl_s)

    async def stats(self) -> StoreStats:
        return StoreStats(
            num_blobs=len(self._blobs),
            blob_bytes=sum(map(len, self._blobs.values())),
            num_manifests=len(self._manifests),
            manifest_bytes=sum(map(len, self._manifests.values())),
        )
