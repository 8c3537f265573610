"""`SnapshotStore`: save and load session snapshots (manifest + blobs) and reclaim unreferenced blobs.

Save order is the whole crash-safety story: blobs first (only those the store lacks), the manifest last as the
single commit point. Garbage collection deletes a blob only if no manifest references it, no save in this
process has it pinned, and it was not written or touched within `gc_grace_s` (which protects saves in flight in
other processes: a save touches the blobs it reuses before committing).

Writers: each SnapshotStore is one lease owner (a random token). `acquire_lease(session_id)` takes the
session's write lease in the store (SessionBusy if another owner holds it); `save(..., expected_generation=g)`
commits only if the stored manifest still has generation g (SnapshotConflict otherwise) and the lease is free
or ours, and renews the lease. `close()` gives back every lease taken.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import pydantic_core

from ..types import SaveResult
from .backends.base import DEFAULT_MAX_IN_FLIGHT, BlobStore, StoreStats, check_session_id
from .backends.registry import DEFAULT_STORE_URL, open_store
from .errors import (
    IncompatibleSnapshot,
    IntegrityError,
    ManifestNotFound,
    SessionBusy,
    StoreError,
)
from .manifest import CheckpointRecord, ModelFingerprint, SessionManifest
from .stream import BlobStream
from .tier import RamTier, TieredStore

logger = logging.getLogger(__name__)
_GC_BATCH = 256  # candidates checked for fresh touches at a time, right before their deletes

DEFAULT_GC_GRACE_S = 600.0
_MAX_VERIFIED = 1_000_000  # digests remembered as verified (~120 MB); past it they are checked again
MANIFEST_CACHE_BYTES = 256 << 20
"""Stored manifest bytes `SnapshotStore` keeps beside their parsed manifests (least recently used go first)."""


def _detached(m: SessionManifest) -> SessionManifest:
    """A copy of ``m`` that shares no mutable container with it (page lists, checkpoints, meta): what one caller
    changes in its manifest reaches neither the cache nor another caller. Meta goes through JSON as it is stored."""

    def record(r: CheckpointRecord) -> CheckpointRecord:
        return r.model_copy(update={"pages": list(r.pages)})

    return m.model_copy(update={
        "fingerprint": m.fingerprint.model_copy(), "head": record(m.head),
        "checkpoints": [record(r) for r in m.checkpoints], "meta": pydantic_core.from_json(pydantic_core.to_json(m.meta)),
    })


@dataclass(frozen=True)
class GcResult:
    """What one garbage collection removed, and what it kept only because a save may still need it."""

    blobs_deleted: int
    blobs_protected: int


class SnapshotStore:
    """The engine's view of a store: whole snapshots in, verified manifests and blobs out."""

    def __init__(
        self,
        store: BlobStore,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        gc_grace_s: float = DEFAULT_GC_GRACE_S,
    ) -> None:
        self.store = store
        self.max_in_flight = max_in_flight
        self.gc_grace_s = gc_grace_s
        self._pinned: Counter[str] = Counter()
        self._gc_lock = anyio.Lock()
        # every digest pinned at any moment of the running collection: a save may commit and unpin after the
        # collection's scans but before it reaches the blob (its manifest and touch postdate those scans)
        self._pinned_during_gc: set[str] | None = None
        self.owner = secrets.token_hex(16)
        """This store's identity as a lease holder."""
        self.lease_ttl_s = store.lease_ttl_s
        self._leased: set[str] = set()
        # session -> (expected generation, sha256 of the manifest) of a commit whose outcome is unknown
        self._uncertain: dict[str, tuple[int, str]] = {}
        self._manifests: OrderedDict[str, tuple[bytes, SessionManifest]] = OrderedDict()
        """session -> (stored bytes, the manifest they parse to) this store wrote or read: a manifest lists every
        page of every checkpoint (O(pages x checkpoints): 36 MB at 1M tokens with a checkpoint every 256 pages,
        0.4-0.5 s to parse and check), so a read that finds the very bytes it knows skips the parse."""
        self._manifest_bytes = 0
        self._verified: set[str] = set()
        """Blobs whose stored bytes this process wrote, or read back and hashed: dedup trusts only these."""

    @classmethod
    async def open(
        cls, url: str = DEFAULT_STORE_URL, *, ram_bytes: int = 0, gc_grace_s: float = DEFAULT_GC_GRACE_S
    ) -> SnapshotStore:
        """Open the store at `url` (see `open_store`), with a RAM tier of `ram_bytes` in front if > 0."""
        store = await open_store(url)
        if ram_bytes > 0:
            store = TieredStore(store, RamTier(ram_bytes))
        return cls(store, gc_grace_s=gc_grace_s)

    @contextmanager
    def _pin(self, digests: Iterable[str]) -> Iterator[None]:
        pinned = list(digests)
        self._pinned.update(pinned)
        if self._pinned_during_gc is not None:
            self._pinned_during_gc.update(pinned)
        try:
            yield
        finally:
            self._pinned.subtract(pinned)
            for d in pinned:
                if self._pinned[d] <= 0:
                    del self._pinned[d]

    @property
    def leased(self) -> frozenset[str]:
        """Sessions whose lease this store took (by acquire_lease or a commit) and has not given back."""
        return frozenset(self._leased)

    async def acquire_lease(self, session_id: str) -> int:
        """Take (or renew) the write lease of `session_id` for `lease_ttl_s`; its fencing token. SessionBusy."""
        fence = await self.store.acquire_lease(check_session_id(session_id), self.owner, self.lease_ttl_s)
        self._leased.add(session_id)
        return fence

    async def release_lease(self, session_id: str) -> bool:
        """Give back the lease of `session_id` if this store holds it."""
        self._leased.discard(session_id)
        return await self.store.release_lease(check_session_id(session_id), self.owner)

    async def save(
        self,
        manifest: SessionManifest,
        blobs: Mapping[str, bytes],
        *,
        expected_generation: int | None = None,
        verified: bool = False,
        streamed: Iterable[str] = (),
    ) -> SaveResult:
        """Make `manifest` durable: write the blobs the store lacks, then the manifest.

        `blobs` maps digest -> bytes and may omit blobs the store already holds (they are reused). Raises
        ValueError if `blobs` holds a blob the manifest does not reference, StoreError if the manifest
        references a blob that is neither given nor stored, IntegrityError if a digest does not match its
        bytes (not checked with `verified=True`: the caller named every blob by hashing these very bytes, as
        the engine does, so the store skips a second hash pass; every load verifies regardless). Returns once
        the manifest is committed.

        With `expected_generation` (the generation this writer loaded or last saved; 0 for a new session) the
        manifest is committed by compare-and-set under the session's lease: SessionBusy if another owner holds
        the lease, SnapshotConflict if the stored generation differs. If this store's previous commit of the
        session failed with an unknown outcome (connection lost mid-command) and did land, the save builds on
        it: the manifest is stored with generation `expected_generation + 2` (see SaveResult.generation).

        `streamed`: the blobs `put_stream` just wrote for this save (what it returned): fresh, so not touched
        again; they are counted as written by the stream's caller, not here.
        """
        referenced = manifest.blob_digests()
        extra = set(blobs) - referenced
        if extra:
            raise ValueError(
                f"session {manifest.session_id!r}: blobs {sorted(extra)[:4]} are not in its manifest"
            )
        with self._pin(referenced):
            stored = await self.store.has_blobs(referenced)
            missing = referenced - stored
            absent = missing - set(blobs)
            if absent:
                raise StoreError(
                    f"session {manifest.session_id!r}: manifest references blobs {sorted(absent)[:4]} that are "
                    f"neither given nor stored"
                )
            # Refresh reused blobs so a concurrent GC in another process leaves them alone (grace period).
            reused = stored - set(streamed)
            if reused:
                await self.store.touch_blobs(reused)
            corrupt = await self._verify_reused(manifest.session_id, stored & set(blobs))
            to_write = {d: blobs[d] for d in missing | corrupt}
            written = await self.store.put_blobs(to_write, max_in_flight=self.max_in_flight, verified=verified)
            self._trust(to_write)
            if expected_generation is None:
                data = manifest.dumps()
                await self.store.put_manifest(manifest.session_id, data)
            else:
                manifest, data = await self._commit(manifest, expected_generation)
            # detached: the caller's manifest shares lists with its live session (meta's messages, say)
            self._remember(manifest.session_id, data, _detached(manifest))
            await self._repair_after_commit(manifest, referenced, blobs, verified)
        return SaveResult(
            blobs_written=len(written),
            bytes_written=sum(len(blobs[d]) for d in written),
            blobs_reused=len(referenced) - len(written),
            manifest_bytes=len(data),
            generation=manifest.generation,
        )

    async def put_stream(self, stream: BlobStream) -> set[str]:
        """Write the blobs of ``stream`` while its producer is still making them (`BlobStore.put_blob_stream`),
        ahead of the `save` whose manifest names them; returns the digests written. The producer named every
        blob by hashing its bytes (as `save(verified=True)`). Pass the same blobs to that `save` (`stream.blobs()`, and
        what this returns as its `streamed`): it finds them stored, touches none it wrote, neither writes nor reads again those this call wrote, verifies those the store held
        already (as for any blob a save reuses), and can write them again should a racing collection delete them
        before the commit (written blobs are recent, which a collection spares for `gc_grace_s`)."""
        written = await self.store.put_blob_stream(stream, max_in_flight=self.max_in_flight, verified=True)
        self._trust(written)
        return written

    def _trust(self, digests: Iterable[str]) -> None:
        if len(self._verified) > _MAX_VERIFIED:
            self._verified.clear()
        self._verified.update(digests)

    async def _verify_reused(self, session_id: str, reused: set[str]) -> set[str]:
        """Read back and hash every blob this save reuses (has the bytes of, but does not write) that this
        process has not verified yet; delete the corrupt ones so that the save writes them again from its own
        copy. Returns those. Blobs the manifest names without giving their bytes were committed by an earlier
        save of this session: they are not reused by dedup and not read here (a load verifies them)."""
        unchecked = reused - self._verified
        if not unchecked:
            return set()
        corrupt = await self.store.verify_blobs(sorted(unchecked), max_in_flight=self.max_in_flight)
        for d in sorted(corrupt):
            await self.store.delete_blob(d)
        if corrupt:
            logger.warning(
                "session %s: %d stored blobs this save reuses were corrupt or missing; writing them again",
                session_id, len(corrupt),
            )
        self._trust(unchecked - corrupt)
        return corrupt

    async def _commit(self, manifest: SessionManifest, expected: int) -> tuple[SessionManifest, bytes]:
        sid = manifest.session_id
        uncertain = self._uncertain.get(sid)
        if uncertain is not None and uncertain[0] == expected:
            with contextlib.suppress(ManifestNotFound):
                if hashlib.sha256(await self.store.get_manifest(sid)).hexdigest() == uncertain[1]:
                    expected += 1  # it landed: it is the version this save replaces
        if manifest.generation != expected + 1:
            manifest = manifest.model_copy(update={"generation": expected + 1})
        data = manifest.dumps()
        try:
            await self.store.commit_manifest(
                sid, data, expected_generation=expected, owner=self.owner, ttl_s=self.lease_ttl_s
            )
        except SessionBusy:  # SnapshotConflict included: nothing was written
            raise
        except BaseException:
            self._uncertain[sid] = (expected, hashlib.sha256(data).hexdigest())
            raise
        self._uncertain.pop(sid, None)
        self._leased.add(sid)
        return manifest, data

    async def _repair_after_commit(
        self, manifest: SessionManifest, referenced: set[str], blobs: Mapping[str, bytes], verified: bool = False
    ) -> None:
        """Re-write blobs a racing GC removed between our has_blobs and our commit (if we hold their bytes)."""
        lost = referenced - await self.store.has_blobs(referenced)
        if not lost:
            return
        unrecoverable = lost - set(blobs)
        await self.store.put_blobs(
            {d: blobs[d] for d in lost - unrecoverable}, max_in_flight=self.max_in_flight, verified=verified
        )
        if unrecoverable:
            raise StoreError(
                f"session {manifest.session_id!r}: blobs {sorted(unrecoverable)[:4]} were deleted by a concurrent "
                f"garbage collection during the save; save again with their bytes"
            )
        logger.warning("session %s: re-wrote %d blobs deleted during save", manifest.session_id, len(lost))

    async def load_manifest(
        self, session_id: str, expected: ModelFingerprint | None = None
    ) -> SessionManifest:
        """The validated manifest of `session_id`; checked against `expected` if given.

        ManifestNotFound, IntegrityError (corrupt manifest), IncompatibleSnapshot (other model/format). The stored
        bytes are read every time; when they are the very bytes this store last wrote or read for the session,
        their parsed manifest is reused (a copy of it: the caller may change what it gets).
        """
        manifest = _detached(self._parse(session_id, await self.store.get_manifest(check_session_id(session_id))))
        if manifest.session_id != session_id:
            raise IntegrityError(
                f"manifest stored for session {session_id!r} names session {manifest.session_id!r}"
            )
        if expected is not None:
            manifest.check_compatible(expected)
        return manifest

    def _parse(self, session_id: str, data: bytes, remember: bool = True) -> SessionManifest:
        """`SessionManifest.loads` of ``data``, the manifest stored for ``session_id``, unless these are the bytes
        remembered for it: then the manifest they parsed to (shared: not to be changed, `_detached` first)."""
        known = self._manifests.get(session_id)
        if known is not None and known[0] == data:
            self._manifests.move_to_end(session_id)
            return known[1]
        manifest = SessionManifest.loads(data)
        if remember:
            head = manifest.head.pages
            for cp in manifest.checkpoints:  # a checkpoint's full pages are mostly the head's first: share the str
                n = len(cp.pages) - 1
                if 0 < n <= len(head) and cp.pages[:n] == head[:n]:
                    cp.pages[:n] = head[:n]
            self._remember(session_id, data, manifest)
        return manifest

    def _remember(self, session_id: str, data: bytes, manifest: SessionManifest) -> None:
        """Keep ``manifest`` (no other holder may change it) as what ``data``, stored for ``session_id``, parses
        to; the least recently used go past `MANIFEST_CACHE_BYTES`."""
        self._forget_manifest(session_id)
        if len(data) > MANIFEST_CACHE_BYTES:
            return
        self._manifests[session_id] = (bytes(data), manifest)
        self._manifest_bytes += len(data)
        while self._manifest_bytes > MANIFEST_CACHE_BYTES:
            _, (gone, _) = self._manifests.popitem(last=False)
            self._manifest_bytes -= len(gone)

    def _forget_manifest(self, session_id: str) -> None:
        old = self._manifests.pop(session_id, None)
        if old is not None:
            self._manifest_bytes -= len(old[0])

    async def load_blob(self, digest: str) -> bytes:
        """Verified bytes of one blob (BlobNotFound, IntegrityError)."""
        data = await self.store.get_blob(digest)
        self._trust((digest,))
        return data

    async def load_blobs(self, digests: Iterable[str]) -> dict[str, bytes]:
        """Verified bytes of many blobs, fetched concurrently/pipelined."""
        out = await self.store.get_blobs(digests, max_in_flight=self.max_in_flight)
        self._trust(out)
        return out

    async def load_blobs_into(self, targets: Sequence[tuple[str, Sequence[memoryview]]]) -> list[int]:
        """Verified bytes of many blobs written into the caller's buffers (see `BlobStore.get_blobs_into`);
        returns the indices whose stored size differs from their buffers (not written)."""
        bad = await self.store.get_blobs_into(targets, max_in_flight=self.max_in_flight)
        skip = set(bad)
        self._trust(d for i, (d, _) in enumerate(targets) if i not in skip)
        return bad

    async def list_sessions(self) -> list[str]:
        """Ids of every session with a manifest in the store."""
        return sorted(await self.store.list_manifests())

    async def delete_session(self, session_id: str) -> GcResult:
        """Delete a session's manifest, then reclaim blobs that no remaining manifest references."""
        await self.store.delete_manifest(check_session_id(session_id))
        self._forget_manifest(session_id)
        if session_id in self._leased:
            await self.release_lease(session_id)
        return await self.collect_garbage()

    async def collect_garbage(self) -> GcResult:
        """Delete blobs referenced by no manifest, sparing pinned and recently written/touched ones.

        If any manifest cannot be read or parsed, nothing is deleted: its references are unknown.
        """
        async with self._gc_lock:
            self._pinned_during_gc = set(self._pinned)
            try:
                return await self._collect_garbage(self._pinned_during_gc)
            finally:
                self._pinned_during_gc = None

    async def _collect_garbage(self, pinned: set[str]) -> GcResult:
        referenced: set[str] = set()
        for sid in await self.store.list_manifests():
            try:
                raw = await self.store.get_manifest(sid)
            except ManifestNotFound:  # deleted meanwhile: references nothing
                continue
            try:
                referenced |= self._parse(sid, raw, remember=False).blob_digests()
            except (IntegrityError, IncompatibleSnapshot) as e:
                logger.warning("garbage collection skipped: manifest of %s is unreadable (%s)", sid, e)
                return GcResult(0, 0)
        recent = await self.store.recent_blobs(self.gc_grace_s)
        unreferenced = [d for d in await self.store.list_blobs() if d not in referenced]
        candidates = [d for d in unreferenced if d not in recent]
        deleted = 0
        protected = len(unreferenced) - len(candidates)
        for i in range(0, len(candidates), _GC_BATCH):
            batch = candidates[i : i + _GC_BATCH]
            # Asked again right before the deletes: a save in another process may have touched a blob since the
            # scans (it touches what it reuses before it commits); pins cover this process's saves.
            fresh = await self.store.recently_touched(batch, self.gc_grace_s)
            for d in batch:
                if d in pinned or d in fresh:
                    protected += 1
                    continue
                if await self.store.delete_blob(d):
                    deleted += 1
        return GcResult(deleted, protected)

    async def stats(self) -> StoreStats:
        """Counts and bytes currently in the store."""
        return await self.store.stats()

    async def bytes_stored(self) -> int:
        """Bytes of all blobs and manifests currently in the store."""
        return await self.store.bytes_stored()

    async def close(self) -> None:
        """Give back every lease this store holds (best effort: a dead store lets them expire), then close."""
        for sid in sorted(self._leased):
            with contextlib.suppress(StoreError, OSError):
                await self.release_lease(sid)
        await self.store.close()

    async def __aenter__(self) -> SnapshotStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
