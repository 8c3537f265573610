"""Reading verified blobs out of the disk store's files: loose blob files and pack ranges, planned as one batch.

`BlobReader.read` returns bytes, `BlobReader.read_into` writes into the caller's buffers (one preadv per blob,
hashed while the bytes are still in the CPU's cache). Both group a batch by pack (each pack's blobs in file order,
about `READ_CHUNK_BYTES` per task, with read-ahead) and spread loose files and pack ranges over up to
`IO_THREADS` threads: sha256 releases the GIL and wants cores. A pack compacted away between the index refresh
and the read is noticed (`PackGone`) and the batch is planned again (`PLAN_TRIES`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

from ..errors import BlobNotFound, IncompatibleSnapshot, IntegrityError, StoreUnavailable
from .disk_files import O_CLOEXEC, O_NOFOLLOW, sha256_hex
from .disk_pack import PackSet

IO_THREADS = max(1, min(8, os.cpu_count() or 1))  # reads hash what they read: sha256 wants cores
PARALLEL_BYTES = 1 << 20  # below this a packed batch is hashed and read on the calling thread
READ_CHUNK_BYTES = 8 << 20  # one read task's share of a pack
PLAN_TRIES = 8  # a batch is planned again while packs it planned to read vanish under it, at most this often

Targets = Sequence[tuple[str, Sequence[memoryview]]]
_R = TypeVar("_R")


class PackGone(Exception):
    """A pack named by the cached index was unlinked (compacted) meanwhile; re-scan and read again."""


def _run_tasks(tasks: list[Callable[[], list[_R]]], threads: int) -> list[_R]:
    if threads <= 1:
        results = [t() for t in tasks]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="disk-read") as ex:
            results = [f.result() for f in [ex.submit(t) for t in tasks]]
    return [x for part in results for x in part]


class BlobReader:
    """Reads blobs of one store: loose files under ``blobs/`` (`blob_path`) and packed ones (``packs``)."""

    def __init__(self, url: str, blobs: Path, packs: PackSet) -> None:
        self.url = url
        self.blobs = blobs
        self.packs = packs

    def blob_path(self, digest: str) -> Path:
        return self.blobs / digest[:2] / digest

    def not_found(self, digest: str) -> Exception:
        """BlobNotFound; IntegrityError when a corrupt pack may have held the blob, else IncompatibleSnapshot
        (naming the version) when a pack of a newer format may have."""
        if self.packs.corrupt:
            return IntegrityError(
                f"{self.url}: blob {digest} is missing and packs {sorted(self.packs.corrupt)} are corrupt "
                f"(may have held it)"
            )
        if self.packs.newer:
            return IncompatibleSnapshot(
                f"{self.url}: blob {digest} is missing and packs this release cannot read may hold it: "
                + "; ".join(self.packs.newer[name] for name in sorted(self.packs.newer))
            )
        return BlobNotFound(digest)

    # --- whole batches -----------------------------------------------------------------------------------

    def read(self, digests: list[str], max_threads: int) -> dict[str, bytes]:
        """Verified bytes of ``digests`` (distinct, well-formed)."""
        return self._planned(partial(self._read_planned, digests, max_threads))

    def read_into(self, targets: Targets, max_threads: int) -> list[int]:
        """Blob ``targets[i][0]`` verified into the buffers ``targets[i][1]``; the indices whose stored size is not
        their buffers' total (nothing written there). See `BlobStore.get_blobs_into`."""
        return self._planned(partial(self._read_into, targets, max_threads))

    def _planned(self, read: Callable[[], _R]) -> _R:
        """``read()`` after an index refresh, planned and run again while packs it planned to read have gone
        (compacted or dropped by a collection since the refresh: their blobs moved); StoreUnavailable if they
        keep going `PLAN_TRIES` times."""
        for _ in range(PLAN_TRIES):
            self.packs.refresh()
            try:
                return read()
            except PackGone:
                continue
        raise StoreUnavailable(f"{self.url}: packs were compacted away under {PLAN_TRIES} reads in a row")

    def _split(self, keys: Sequence[str]) -> tuple[dict[str, tuple[Path, list[tuple[int, int, int]]]], list[int]]:
        """Index positions of ``keys`` grouped by pack (path, [(position, offset, length)] in file order) and
        the positions of loose blobs."""
        by_pack: dict[str, tuple[Path, list[tuple[int, int, int]]]] = {}
        loose: list[int] = []
        for i, d in enumerate(keys):
            loc = self.packs.locate(d)
            if loc is None:
                loose.append(i)
                continue
            pack, off, n = loc
            by_pack.setdefault(pack.name, (self.packs.path(pack), []))[1].append((i, off, n))
        for _, entries in by_pack.values():
            entries.sort(key=lambda e: e[1])
        return by_pack, loose

    def _read_planned(self, digests: list[str], max_threads: int) -> dict[str, bytes]:
        by_pack, loose = self._split(digests)
        tasks: list[Callable[[], list[tuple[str, bytes]]]] = []
        nbytes = 0
        for path, entries in by_pack.values():
            chunk: list[tuple[str, int, int]] = []
            size = 0
            for i, off, n in entries:
                chunk.append((digests[i], off, n))
                size += n
                nbytes += n
                if size >= READ_CHUNK_BYTES:
                    tasks.append(partial(self._read_pack_range, path, chunk))
                    chunk, size = [], 0
            if chunk:
                tasks.append(partial(self._read_pack_range, path, chunk))
        names = [digests[i] for i in loose]
        step = max(1, -(-len(names) // IO_THREADS))
        for i in range(0, len(names), step):
            tasks.append(partial(self._read_loose, names[i : i + step]))
        threads = min(IO_THREADS, max_threads, len(tasks))
        if not loose and nbytes < PARALLEL_BYTES:
            threads = 1
        return dict(_run_tasks(tasks, threads))

    def _read_into(self, targets: Targets, max_threads: int) -> list[int]:
        by_pack, loose = self._split([d for d, _ in targets])
        tasks: list[Callable[[], list[int]]] = []
        for path, entries in by_pack.values():
            per = max(1, READ_CHUNK_BYTES // max(1, entries[0][2]))  # a read task's share: about 8 MiB
            for lo in range(0, len(entries), per):
                tasks.append(partial(self._read_pack_into, path, entries[lo : lo + per], targets))
        step = max(1, -(-len(loose) // IO_THREADS))
        for lo in range(0, len(loose), step):
            tasks.append(partial(self._read_loose_into, loose[lo : lo + step], targets))
        return sorted(_run_tasks(tasks, min(IO_THREADS, max_threads, len(tasks))))

    # --- one file ----------------------------------------------------------------------------------------

    def _check(self, digest: str, data: bytes, where: object) -> bytes:
        actual = sha256_hex(data)
        if actual != digest:
            raise IntegrityError(
                f"{self.url} ({where}): blob {digest} has sha256 {actual} ({len(data)} bytes); corrupt or truncated"
            )
        return data

    def _check_into(self, digest: str, bufs: Sequence[memoryview], got: int, size: int, where: object) -> None:
        h = hashlib.sha256()
        for b in bufs:
            h.update(b)
        if got != size or h.hexdigest() != digest:
            raise IntegrityError(
                f"{self.url} ({where}): blob {digest} has sha256 {h.hexdigest()} ({got} of {size} bytes read); "
                f"corrupt or truncated"
            )

    @staticmethod
    def _open_pack(path: Path, start: int, end: int) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        except FileNotFoundError:
            raise PackGone(path) from None
        with contextlib.suppress(AttributeError, OSError):  # read-ahead is a hint
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
        return fd

    def _open_loose(self, digest: str, path: Path) -> int:
        """The loose blob file ``path`` of ``digest``, read-only, never through a symlink (IntegrityError)."""
        try:
            return os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        except FileNotFoundError:
            raise self.not_found(digest) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise IntegrityError(f"{self.url}: {path} is a symlink; refusing to follow it") from e
            raise

    def _read_pack_range(self, path: Path, entries: list[tuple[str, int, int]]) -> list[tuple[str, bytes]]:
        fd = self._open_pack(path, entries[0][1], entries[-1][1] + entries[-1][2])
        try:
            return [(d, self._check(d, os.pread(fd, n, off), f"{path} at {off}")) for d, off, n in entries]
        finally:
            os.close(fd)

    def _read_loose(self, digests: list[str]) -> list[tuple[str, bytes]]:
        out = []
        for d in digests:
            path = self.blob_path(d)
            fd = self._open_loose(d, path)
            try:
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0)
                while len(data) < size:  # short read: keep going (a blob file never changes)
                    more = os.pread(fd, size - len(data), len(data))
                    if not more:
                        break
                    data += more
            finally:
                os.close(fd)
            out.append((d, self._check(d, data, path)))
        return out

    def _read_pack_into(self, path: Path, entries: list[tuple[int, int, int]], targets: Targets) -> list[int]:
        fd = self._open_pack(path, entries[0][1], entries[-1][1] + entries[-1][2])
        bad = []
        try:
            for i, off, n in entries:
                d, bufs = targets[i]
                if sum(len(b) for b in bufs) != n:
                    bad.append(i)
                    continue
                self._check_into(d, bufs, os.preadv(fd, bufs, off), n, f"{path} at {off}")
        finally:
            os.close(fd)
        return bad

    def _read_loose_into(self, indices: list[int], targets: Targets) -> list[int]:
        bad = []
        for i in indices:
            d, bufs = targets[i]
            path = self.blob_path(d)
            fd = self._open_loose(d, path)
            try:
                size = os.fstat(fd).st_size
                if sum(len(b) for b in bufs) != size:
                    bad.append(i)
                    continue
                self._check_into(d, bufs, os.preadv(fd, bufs, 0), size, path)  # a blob file never changes
            finally:
                os.close(fd)
        return bad
