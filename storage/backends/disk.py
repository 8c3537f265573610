"""`disk:PATH`: the embedded default store. A blob is a file of its own (loose) or lies in a pack file with the
other blobs of its save (disk_pack); one file per manifest and a lease per session (disk_manifests).

Layout::

    ROOT/blobs/ab/abcdef...        loose blob named by its sha256, sharded by the first two hex characters
    ROOT/blobs/packs/pack-*.pack   a batch of at least `PACK_MIN_BLOBS` new blobs; `pack-*.dead` its tombstones
    ROOT/manifests/<session>.json  a session's manifest
    ROOT/leases/<session>.*        the session's write lease (see disk_manifests)

Writes follow disk_files: a uniquely named temp file, made durable, then moved into place (link for blobs, so an
existing blob is never replaced; rename for manifests) and the directory made durable. A crash therefore leaves
either nothing or a whole file under the final name, plus possibly a temp file, which `DiskStore.open` removes
once its writer is gone. Reads are disk_read's. File IO runs in worker threads so the event loop is never
blocked; an OSError surfaces as StoreUnavailable naming the errno (after a failed fsync the page cache may claim
data the disk does not have, so nothing is retried on the same file).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio.to_thread

from ..blobs import is_digest
from ..errors import IntegrityError, ManifestNotFound, StoreUnavailable
from ..stream import BlobStream
from .base import DEFAULT_MAX_IN_FLIGHT, BlobStore, StoreStats, check_digest, check_session_id, verify_blob
from .disk_files import (
    TMP_PREFIX,
    is_file,
    mkdir_durable,
    orphaned,
    process_start_time,
    read_file,
    temp_prefix,
    unlink,
)
from .disk_manifests import ManifestFiles
from .disk_pack import PackSet
from .disk_read import BlobReader
from .disk_write import BlobWriter

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

PACK_MIN_BLOBS = 64
"""A batch with at least this many new blobs is written as one pack file (see disk_pack); smaller batches, such
as the few pages of one agent turn, stay loose files: one pack per small save would multiply the indexes every
reader loads for a gain of a few milliseconds (git keeps pushes under `transfer.unpackLimit` = 100 loose alike)."""


class DiskStore(BlobStore):
    """Blobs and manifests as files under one root directory; see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike[str], *, pack_min_blobs: int | None = None) -> None:
        """Use `DiskStore.open`, which also creates the layout and removes orphaned temp files.
        `pack_min_blobs` (default `PACK_MIN_BLOBS`): the fewest new blobs of a batch written as one pack."""
        pack_min_blobs = PACK_MIN_BLOBS if pack_min_blobs is None else pack_min_blobs
        if pack_min_blobs < 1:
            raise ValueError(f"pack_min_blobs must be >= 1, got {pack_min_blobs}")
        self.root = Path(root)
        self.url = f"disk:{self.root}"
        self._blobs = self.root / "blobs"
        self._manifests = self.root / "manifests"
        self._leases = self.root / "leases"
        self._packs = PackSet(self._blobs / "packs")
        self._reader = BlobReader(self.url, self._blobs, self._packs)
        self._writer = BlobWriter(self.url, self._blobs, self._packs, pack_min_blobs)
        self._manifest_files = ManifestFiles(self.url, self._manifests, self._leases)

    @property
    def pack_min_blobs(self) -> int:
        """The fewest new blobs of a batch (or announced by a stream) written as one pack."""
        return self._writer.pack_min_blobs

    @pack_min_blobs.setter
    def pack_min_blobs(self, n: int) -> None:
        self._writer.pack_min_blobs = n

    @classmethod
    async def open(cls, root: str | os.PathLike[str], *, pack_min_blobs: int | None = None) -> DiskStore:
        """Create `root` (and its layout) if needed and clean temp files left by crashed writers."""
        store = cls(Path(root).expanduser(), pack_min_blobs=pack_min_blobs)
        await store._run("open", store.root, store._open_sync)
        return store

    def _open_sync(self) -> None:
        # the packs folder too, so that a first save does not pay its mkdir and parent fsync; a folder made here
        # is made durable in its parent before anything is written into it
        for d in (self._blobs, self._manifests, self._leases, self._packs.folder):
            mkdir_durable(d)
        cutoff = process_start_time()
        dirs = [self._manifests, self._leases, *(p for p in self._blobs.iterdir() if p.is_dir())]
        for d in dirs:
            for entry in os.scandir(d):
                if entry.name.startswith(TMP_PREFIX) and orphaned(
                    entry.name, entry.stat(follow_symlinks=False).st_mtime, cutoff
                ):
                    logger.info("removing orphaned temp file %s", entry.path)
                    Path(entry.path).unlink(missing_ok=True)
        self._packs.drop_redundant()

    async def _run(self, op: str, path: Path, fn: Callable[[], _T]) -> _T:
        """Run blocking `fn` in a worker thread, turning OSError into StoreUnavailable."""
        try:
            return await anyio.to_thread.run_sync(fn)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise IntegrityError(f"{self.url}: {path} is a symlink; refusing to follow it") from e
            code = errno.errorcode.get(e.errno or 0, "?")
            raise StoreUnavailable(
                f"{self.url}: {op} {path} failed: {code} (errno {e.errno}): {e.strerror}"
            ) from e

    def _blob_path(self, digest: str) -> Path:
        return self._blobs / digest[:2] / digest

    # --- blobs -------------------------------------------------------------------------------------------

    async def put_blob(self, digest: str, data: bytes) -> bool:
        path = self._blob_path(check_digest(digest))
        await verify_blob(digest, data, where=f"put into {self.url}")
        return await self._run("write", path, partial(self._writer.put_one, path, data))

    async def put_blobs(
        self, blobs: Mapping[str, bytes], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        """Store many blobs as one batch. At least `pack_min_blobs` new ones: one pack file, fsynced, renamed
        into place, folder fsynced. Fewer: every temp file written, made durable together, linked into place,
        links made durable together. Digests are verified on other threads while the batch is written (unless the
        caller says it already did: `verified`)."""
        if not blobs:
            return set()
        for d in blobs:
            check_digest(d)
        return await self._run("write", self._blobs, partial(self._writer.put_many, list(blobs.items()), verified))

    async def put_blob_stream(
        self, stream: BlobStream, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        """At least `pack_min_blobs` announced: one pack, each chunk written as it arrives (its writeback already
        started while later chunks are made), fsynced, renamed into place, folder fsynced once the stream ends.
        Fewer: as `BlobStore.put_blob_stream`. Unless `verified`, each blob is hashed just before it is written.
        Blobs the store holds already are written again into the pack (a duplicate, which reads and GC handle):
        checking first would wait for the digests the stream exists not to wait for."""
        try:
            count = await anyio.to_thread.run_sync(stream.wait_count)
        except BaseException:
            stream.abandon()
            raise
        if count < self.pack_min_blobs:
            return await super().put_blob_stream(stream, max_in_flight=max_in_flight, verified=verified)
        return await self._run("write", self._blobs, partial(self._writer.put_stream, stream, verified))

    async def get_blob(self, digest: str) -> bytes:
        return (await self.get_blobs([digest]))[digest]

    async def get_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> dict[str, bytes]:
        """Verified bytes of many blobs: one worker thread plans the batch, up to `IO_THREADS` threads read
        and hash it (a pack's blobs in file order with read-ahead, loose files one open and one pread each)."""
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]
        if not wanted:
            return {}
        return await self._run("read", self._blobs, partial(self._reader.read, wanted, max(1, max_in_flight)))

    async def get_blobs_into(
        self, targets: Sequence[tuple[str, Sequence[memoryview]]], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> list[int]:
        """As `BlobStore.get_blobs_into`, with no bytes object in between: one preadv per blob straight into its
        buffers, hashed there while the bytes are still in the CPU's cache, on up to `IO_THREADS` threads. The
        buffers are memory the caller has touched already: reading into fresh allocations costs a page fault
        per 4 KiB, which made reads 3-5x slower than the copy itself."""
        for d, _ in targets:
            check_digest(d)
        if not targets:
            return []
        job = partial(self._reader.read_into, list(targets), max(1, max_in_flight))
        return await self._run("read", self._blobs, job)

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = [check_digest(d) for d in digests]

        def has() -> set[str]:
            self._packs.refresh()
            return {d for d in wanted if self._packs.locate(d) is not None or is_file(self._writer.blob_file(d))}

        return await self._run("stat", self._blobs, has)

    async def delete_blob(self, digest: str) -> bool:
        path = self._blob_path(check_digest(digest))

        def delete() -> bool:
            loose = unlink(path)
            packed = self._packs.delete(digest, temp_prefix())
            return loose or packed

        return await self._run("delete", path, delete)

    def _scan_blobs(self) -> dict[str, os.stat_result]:
        out: dict[str, os.stat_result] = {}
        for shard in os.scandir(self._blobs):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if is_digest(entry.name) and entry.name.startswith(shard.name):
                    with contextlib.suppress(FileNotFoundError):  # deleted while scanning
                        out[entry.name] = entry.stat(follow_symlinks=False)
        return out

    def _scan_all(self) -> tuple[dict[str, os.stat_result], dict[str, float]]:
        """Loose blobs with their stat, and packed live blobs with their pack's mtime."""
        self._packs.refresh()
        return self._scan_blobs(), self._packs.live_mtimes()

    async def list_blobs(self) -> list[str]:
        loose, packed = await self._run("list", self._blobs, self._scan_all)
        return list(loose.keys() | packed.keys())

    async def touch_blobs(self, digests: Iterable[str]) -> None:
        wanted = [check_digest(d) for d in digests]

        def touch() -> None:
            self._packs.refresh()
            packs: set[str] = set()
            for d in wanted:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(self._blob_path(d))
                loc = self._packs.locate(d)
                if loc is not None:
                    packs.add(loc[0].name)
            self._packs.touch(packs)  # a pack's mtime stands for all of its blobs

        await self._run("touch", self._blobs, touch)

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        wanted = [check_digest(d) for d in digests]
        cutoff = time.time() - within_s

        def check() -> set[str]:
            self._packs.refresh()
            out = set()
            for d in wanted:
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(self._blob_path(d)).st_mtime >= cutoff:
                        out.add(d)
                        continue
                for pack in self._packs.holders(d):  # a pack's mtime stands for all of its blobs; any fresh copy
                    with contextlib.suppress(FileNotFoundError):
                        if os.stat(self._packs.path(pack)).st_mtime >= cutoff:
                            out.add(d)
                            break
            return out

        return await self._run("list", self._blobs, check)

    async def recent_blobs(self, within_s: float) -> set[str]:
        cutoff = time.time() - within_s
        loose, packed = await self._run("list", self._blobs, self._scan_all)
        return {d for d, st in loose.items() if st.st_mtime >= cutoff} | {
            d for d, mtime in packed.items() if mtime >= cutoff
        }

    # --- manifests and leases (disk_manifests) ----------------------------------------------------------

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        path = self._manifest_files.path(session_id)
        await self._run("write", path, partial(self._manifest_files.write, path, data))

    async def get_manifest(self, session_id: str) -> bytes:
        path = self._manifest_files.path(session_id)
        try:
            return await self._run("read", path, partial(read_file, path))
        except StoreUnavailable as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise ManifestNotFound(session_id) from None
            raise

    async def list_manifests(self) -> list[str]:
        return list(await self._run("list", self._manifests, self._manifest_files.scan))

    async def delete_manifest(self, session_id: str) -> bool:
        path = self._manifest_files.path(session_id)
        return await self._run("delete", path, partial(self._manifest_files.delete, path))

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        job = partial(self._manifest_files.acquire_lease, check_session_id(session_id), owner, ttl_s)
        return await self._run("lease", self._leases, job)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        job = partial(self._manifest_files.release_lease, check_session_id(session_id), owner)
        return await self._run("release lease", self._leases, job)

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        path = self._manifest_files.path(session_id)
        job = partial(self._manifest_files.commit, session_id, data, expected_generation, owner, ttl_s)
        return await self._run("commit manifest", path, job)

    async def stats(self) -> StoreStats:
        loose, packed = await self._run("list", self._blobs, self._scan_all)
        manifests = await self._run("list", self._manifests, self._manifest_files.scan)
        return StoreStats(
            num_blobs=len(loose.keys() | packed.keys()),
            # what the disk holds: whole pack files, dead bytes included until compaction
            blob_bytes=sum(st.st_size for st in loose.values()) + sum(p.size for p in self._packs.packs.values()),
            num_manifests=len(manifests),
            manifest_bytes=sum(manifests.values()),
        )

