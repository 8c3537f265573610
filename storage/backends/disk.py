"""`disk:PATH` — the embedded default store: a blob is a file of its own (loose) or lies in a pack file with the
other blobs of its save (see disk_pack); one file per manifest.

Layout::

    ROOT/blobs/ab/abcdef...        loose blob named by its sha256, sharded by the first two hex characters
    ROOT/blobs/packs/pack-*.pack   a batch of at least `PACK_MIN_BLOBS` new blobs; `pack-*.dead` its tombstones
    ROOT/manifests/<session>.json  a session's manifest
    ROOT/leases/<session>.lock     the session's write lease: JSON {owner, fence, pid, host, expires_at}
    ROOT/leases/<session>.fence    the last fencing token handed out for the session
    ROOT/leases/<session>.guard    empty; flock()ed around every lease change and manifest commit

Every write goes to a uniquely named temp file (`.tmp-` prefix, O_EXCL) in the destination directory, is
flushed and fsynced, then moved into place (link for blobs, so an existing blob is never replaced; rename for
manifests) and the directory is fsynced. A crash therefore leaves either nothing or a whole file under the final
name, plus possibly a temp file, which `DiskStore.open` removes once its writer is gone: a temp file's name carries
its writer's host and pid, so one of this host goes as soon as that process has died; one of another host once it
is older than the opening process.
File IO runs in worker threads so the event loop is never blocked. A failed write or fsync is never retried
on the same file: the temp file is closed and removed and the error surfaces as StoreUnavailable (after a failed
fsync the page cache may claim data the disk does not have).

Leases: a lease is stale once `expires_at` (wall clock) has passed, or at once if it names a process of this
host that no longer exists (a crashed engine). The guard's flock is released by the kernel when its holder
dies, so a crash never leaves a session locked beyond its lease.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio.to_thread

from .. import faults
from ..blobs import is_digest
from ..errors import (
    BlobNotFound,
    IntegrityError,
    ManifestNotFound,
    SessionBusy,
    SnapshotConflict,
    StoreUnavailable,
)
from .base import (
    DEFAULT_MAX_IN_FLIGHT,
    BlobStore,
    StoreStats,
    check_digest,
    check_session_id,
    stored_generation,
    verify_blob,
)
from .disk_pack import _O_CLOEXEC, _O_NOFOLLOW, PackSet, fsync_dir, sha256_hex

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
_T = TypeVar("_T")

PACK_MIN_BLOBS = 64
"""A batch with at least this many new blobs is written as one pack file (see disk_pack); smaller batches, such
as the few pages of one agent turn, stay loose files: one pack per small save would multiply the indexes every
reader loads for a gain of a few milliseconds (git keeps pushes under `transfer.unpackLimit` = 100 loose alike)."""
_IO_THREADS = max(1, min(8, os.cpu_count() or 1))  # reads hash what they read: sha256 wants cores
_PARALLEL_BYTES = 1 << 20  # below this a batch is hashed and read on the calling thread
_READ_CHUNK_BYTES = 8 << 20  # one read task's share of a pack


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux /proc), else now; temp files older than it are orphans."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_LIBC_SYNCFS = _load_syncfs()


def _syncfs(fd: int) -> None:
    """syncfs(2): flush the whole filesystem holding ``fd`` and report any writeback error on it (Linux >= 5.8)."""
    assert _LIBC_SYNCFS is not None
    if _LIBC_SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _durable(paths: list[Path]) -> None:
    """Make the data (or, for directories, the entries) of ``paths`` durable. One syncfs covers a whole batch
    where the OS has it — a save of N page blobs costs one flush instead of N fsyncs — else fsync each."""
    if not paths:
        return
    if _LIBC_SYNCFS is not None:
        fd = os.open(paths[0], os.O_RDONLY | _O_CLOEXEC)
        try:
            _syncfs(fd)
        finally:
            os.close(fd)
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_temp(directory: Path, data: bytes, points: tuple[str, str] | None = None, *, sync: bool = True) -> Path:
    """Write `data` to a new temp file in `directory`, fsynced unless not `sync`; returns its path.

    On any error the file is closed and removed, never written or fsynced again. `points` names the fault
    points after the write and after the fsync.
    """
    tmp = directory / f"{_temp_prefix()}{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if points is not None:
            faults.point(points[0])
        if sync:
            os.fsync(fd)
        if points is not None:
            faults.point(points[1])
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def _link(tmp: Path, path: Path) -> bool:
    """Put ``tmp`` at ``path`` unless a blob is already there; True if this call placed it."""
    try:
        # link() refuses to replace an existing name, so a blob is never overwritten, even by a racer.
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        os.replace(tmp, path)  # no hard links here; content is identical anyway
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


_HOST = socket.gethostname()
_HOST_TAG = sha256_hex(_HOST.encode())[:8]
"""Names this host in temp file names (`.tmp-<host tag>-<pid>-<random>`), so that `open` can tell a temp file of a
dead writer on this host from one of a live writer, whatever their clocks say."""


def _temp_prefix() -> str:
    """The name prefix of this process's temp files: `.tmp-<host tag>-<pid>-`; a random suffix completes it."""
    return f"{TMP_PREFIX}{_HOST_TAG}-{os.getpid()}-"


def _orphaned(name: str, mtime: float, cutoff: float) -> bool:
    """Whether the temp file `name` (modified at `mtime`) was left by a writer that is gone.

    A temp file of this host names its writer: it is an orphan once that process has died, and never while it
    lives (a writer fsyncing a large blob is not disturbed). A temp file of another host, or of an older
    name form, cannot be checked that way: it is an orphan if it is older than this process (`cutoff`). Like the
    leases, this assumes that the processes sharing a host name share a pid namespace."""
    parts = name[len(TMP_PREFIX) :].split("-")
    if len(parts) == 3 and parts[0] == _HOST_TAG and parts[1].isdigit():
        pid = int(parts[1])
        return pid != os.getpid() and not _pid_alive(pid)
    return mtime < cutoff


def _mkdir_durable(path: Path) -> None:
    """Create ``path`` and any missing parents, each made durable in its parent (fsync of the parent)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _is_file(path: str) -> bool:
    """`Path(path).is_file()` without the Path (same errors ignored)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return False
        raise


def _read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        return f.readall()


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
        self.pack_min_blobs = pack_min_blobs
        self._blobs = self.root / "blobs"
        self._manifests = self.root / "manifests"
        self._leases = self.root / "leases"
        self._blobs_str = str(self._blobs)
        self._packs = PackSet(self._blobs / "packs")

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
            _mkdir_durable(d)
        cutoff = _process_start_time()
        dirs = [self._manifests, self._leases, *(p for p in self._blobs.iterdir() if p.is_dir())]
        for d in dirs:
            for entry in os.scandir(d):
                if entry.name.startswith(TMP_PREFIX) and _orphaned(
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

    def _manifest_path(self, session_id: str) -> Path:
        return self._manifests / f"{check_session_id(session_id)}.json"

    # --- blobs -------------------------------------------------------------------------------------------

    async def put_blob(self, digest: str, data: bytes) -> bool:
        path = self._blob_path(check_digest(digest))
        await verify_blob(digest, data, where=f"put into {self.url}")
        return await self._run("write", path, partial(self._put_blob_sync, path, data))

    def _put_blob_sync(self, path: Path, data: bytes) -> bool:
        if self._exists_touch(path.name):
            return False
        shard = path.parent
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            fsync_dir(shard.parent)
        tmp = _write_temp(shard, data, ("disk.blob.written", "disk.blob.fsynced"))
        try:
            written = _link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        faults.point("disk.blob.linked")
        fsync_dir(shard)
        faults.point("disk.blob.done")
        return written

    def _blob_file(self, digest: str) -> str:
        """`_blob_path` as a str: a batch check of a thousand blobs spends more on Path objects than on stat."""
        return f"{self._blobs_str}/{digest[:2]}/{digest}"

    def _exists_touch(self, digest: str) -> bool:
        """True if the blob is stored (loose or packed), refreshing its GC grace period: a re-put is a use."""
        loc = self._packs.locate(digest)  # one dict lookup: before the stat, which most saves' blobs miss
        if loc is not None:
            self._packs.touch({loc[0].name})
            return True
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._blob_file(digest))
            return True
        return False

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
        return await self._run("write", self._blobs, partial(self._put_blobs_sync, list(blobs.items()), verified))

    def _put_blobs_sync(self, items: list[tuple[str, bytes]], trusted: bool = False) -> set[str]:
        self._packs.refresh()
        with _Hasher([] if trusted else [data for _, data in items]) as hashes:

            def verified(i: int) -> None:
                if trusted:
                    return
                actual = hashes.result(i)
                if actual != items[i][0]:
                    raise IntegrityError(
                        f"put into {self.url}: blob {items[i][0]} has sha256 {actual} ({len(items[i][1])} bytes)"
                    )

            new = [i for i, (d, _) in enumerate(items) if not self._exists_touch(d)]
            for i in sorted(set(range(len(items))) - set(new)):
                verified(i)
            if len(new) >= self.pack_min_blobs:
                self._packs.write([items[i] for i in new], lambda j: verified(new[j]), _temp_prefix())
                self._packs.refresh()
                return {items[i][0] for i in new}
            return self._put_loose_sync([items[i] for i in new], lambda j: verified(new[j]))

    def _put_loose_sync(self, items: list[tuple[str, bytes]], verified: Callable[[int], None]) -> set[str]:
        pending: list[tuple[str, Path, Path]] = []
        written: set[str] = set()
        new_shard = False
        try:
            for j, (d, data) in enumerate(items):
                verified(j)
                path = self._blob_path(d)
                if not path.parent.is_dir():
                    path.parent.mkdir(exist_ok=True)
                    new_shard = True
                pending.append((d, path, _write_temp(path.parent, data, sync=False)))
                faults.point("disk.blob.written")
            if not pending:
                return written
            _durable([tmp for _, _, tmp in pending])  # a failure abandons every temp file (finally below)
            faults.point("disk.blob.fsynced")
            for d, path, tmp in pending:
                if _link(tmp, path):
                    written.add(d)
                tmp.unlink(missing_ok=True)
            faults.point("disk.blob.linked")
            dirs = sorted({path.parent for _, path, _ in pending} | ({self._blobs} if new_shard else set()))
            if _LIBC_SYNCFS is not None:
                _durable(dirs[:1])  # one syncfs covers every directory of this filesystem
            else:
                for p in dirs:
                    fsync_dir(p)
            faults.point("disk.blob.done")
        finally:
            for _, _, tmp in pending:
                tmp.unlink(missing_ok=True)
        return written

    async def get_blob(self, digest: str) -> bytes:
        return (await self.get_blobs([digest]))[digest]

    async def get_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> dict[str, bytes]:
        """Verified bytes of many blobs: one worker thread plans the batch, up to `_IO_THREADS` threads read
        and hash it (a pack's blobs in file order with read-ahead, loose files one open and one pread each)."""
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]
        if not wanted:
            return {}
        return await self._run("read", self._blobs, partial(self._get_blobs_sync, wanted, max(1, max_in_flight)))

    def _get_blobs_sync(self, digests: list[str], max_threads: int) -> dict[str, bytes]:
        self._packs.refresh()
        try:
            return self._read_planned(digests, max_threads)
        except _PackGone:  # compacted or dropped by a collection since the refresh: its blobs moved
            self._packs.refresh()
            return self._read_planned(digests, max_threads)

    def _read_planned(self, digests: list[str], max_threads: int) -> dict[str, bytes]:
        by_pack: dict[str, list[tuple[str, int, int]]] = {}
        pack_paths: dict[str, Path] = {}
        loose: list[str] = []
        nbytes = 0
        for d in digests:
            loc = self._packs.locate(d)
            if loc is None:
                loose.append(d)
                continue
            pack, off, n = loc
            by_pack.setdefault(pack.name, []).append((d, off, n))
            pack_paths[pack.name] = self._packs.path(pack)
            nbytes += n
        tasks: list[Callable[[], list[tuple[str, bytes]]]] = []
        for name, entries in by_pack.items():
            entries.sort(key=lambda e: e[1])
            chunk: list[tuple[str, int, int]] = []
            size = 0
            for e in entries:
                chunk.append(e)
                size += e[2]
                if size >= _READ_CHUNK_BYTES:
                    tasks.append(partial(self._read_pack_range, pack_paths[name], chunk))
                    chunk, size = [], 0
            if chunk:
                tasks.append(partial(self._read_pack_range, pack_paths[name], chunk))
        step = max(1, -(-len(loose) // _IO_THREADS))
        for i in range(0, len(loose), step):
            tasks.append(partial(self._read_loose, loose[i : i + step]))
        threads = min(_IO_THREADS, max_threads, len(tasks))
        if threads <= 1 or (not loose and nbytes < _PARALLEL_BYTES):
            results = [t() for t in tasks]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="disk-read") as ex:
                results = [f.result() for f in [ex.submit(t) for t in tasks]]
        return {d: data for part in results for d, data in part}

    async def get_blobs_into(
        self, targets: Sequence[tuple[str, Sequence[memoryview]]], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> list[int]:
        """As `BlobStore.get_blobs_into`, with no bytes object in between: one preadv per blob straight into its
        buffers, hashed there while the bytes are still in the CPU's cache, on up to `_IO_THREADS` threads. The
        buffers are memory the caller has touched already: reading into fresh allocations costs a page fault
        per 4 KiB, which made reads 3-5x slower than the copy itself."""
        for d, _ in targets:
            check_digest(d)
        if not targets:
            return []
        job = partial(self._get_into_sync, list(targets), max(1, max_in_flight))
        return await self._run("read", self._blobs, job)

    def _get_into_sync(self, targets: list[tuple[str, Sequence[memoryview]]], max_threads: int) -> list[int]:
        self._packs.refresh()
        try:
            return self._read_into(targets, max_threads)
        except _PackGone:  # as in _get_blobs_sync: re-scan and read again
            self._packs.refresh()
            return self._read_into(targets, max_threads)

    def _read_into(self, targets: list[tuple[str, Sequence[memoryview]]], max_threads: int) -> list[int]:
        by_pack: dict[str, tuple[Path, list[tuple[int, int, int]]]] = {}  # pack -> (path, [(target, off, n)])
        loose: list[int] = []
        for i, (d, _) in enumerate(targets):
            loc = self._packs.locate(d)
            if loc is None:
                loose.append(i)
                continue
            pack, off, n = loc
            by_pack.setdefault(pack.name, (self._packs.path(pack), []))[1].append((i, off, n))
        tasks: list[Callable[[], list[int]]] = []
        for path, entries in by_pack.values():
            entries.sort(key=lambda e: e[1])
            per = max(1, _READ_CHUNK_BYTES // max(1, entries[0][2]))  # a read task's share: about 8 MiB
            for lo in range(0, len(entries), per):
                tasks.append(partial(self._read_pack_into, path, entries[lo : lo + per], targets))
        step = max(1, -(-len(loose) // _IO_THREADS))
        for lo in range(0, len(loose), step):
            tasks.append(partial(self._read_loose_into, loose[lo : lo + step], targets))
        threads = min(_IO_THREADS, max_threads, len(tasks))
        if threads <= 1:
            results = [t() for t in tasks]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="disk-read") as ex:
                results = [f.result() for f in [ex.submit(t) for t in tasks]]
        return sorted(i for part in results for i in part)

    def _check_into(self, digest: str, bufs: Sequence[memoryview], got: int, size: int, where: object) -> None:
        h = hashlib.sha256()
        for b in bufs:
            h.update(b)
        if got != size or h.hexdigest() != digest:
            raise IntegrityError(
                f"{self.url} ({where}): blob {digest} has sha256 {h.hexdigest()} ({got} of {size} bytes read); "
                f"corrupt or truncated"
            )

    def _read_pack_into(
        self, path: Path, entries: list[tuple[int, int, int]], targets: list[tuple[str, Sequence[memoryview]]]
    ) -> list[int]:
        try:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            raise _PackGone(path) from None
        bad = []
        try:
            start, end = entries[0][1], entries[-1][1] + entries[-1][2]
            with contextlib.suppress(AttributeError, OSError):  # read-ahead is a hint
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            for i, off, n in entries:
                d, bufs = targets[i]
                if sum(len(b) for b in bufs) != n:
                    bad.append(i)
                    continue
                self._check_into(d, bufs, os.preadv(fd, bufs, off), n, f"{path} at {off}")
        finally:
            os.close(fd)
        return bad

    def _read_loose_into(self, indices: list[int], targets: list[tuple[str, Sequence[memoryview]]]) -> list[int]:
        bad = []
        for i in indices:
            d, bufs = targets[i]
            path = self._blob_path(d)
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

    def _check(self, digest: str, data: bytes, where: object) -> bytes:
        actual = sha256_hex(data)
        if actual != digest:
            raise IntegrityError(
                f"{self.url} ({where}): blob {digest} has sha256 {actual} ({len(data)} bytes); corrupt or truncated"
            )
        return data

    def _read_pack_range(self, path: Path, entries: list[tuple[str, int, int]]) -> list[tuple[str, bytes]]:
        try:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            raise _PackGone(path) from None
        try:
            start, end = entries[0][1], entries[-1][1] + entries[-1][2]
            with contextlib.suppress(AttributeError, OSError):  # read-ahead is a hint
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            out = []
            for d, off, n in entries:
                data = os.pread(fd, n, off)
                out.append((d, self._check(d, data, f"{path} at {off}")))
            return out
        finally:
            os.close(fd)

    def _open_loose(self, digest: str, path: Path) -> int:
        """The loose blob file ``path`` of ``digest``, read-only, never through a symlink (IntegrityError)."""
        try:
            return os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            raise self._not_found(digest) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise IntegrityError(f"{self.url}: {path} is a symlink; refusing to follow it") from e
            raise

    def _not_found(self, digest: str) -> Exception:
        if self._packs.corrupt:
            return IntegrityError(
                f"{self.url}: blob {digest} is missing and packs {sorted(self._packs.corrupt)} are corrupt "
                f"(may have held it)"
            )
        return BlobNotFound(digest)

    def _read_loose(self, digests: list[str]) -> list[tuple[str, bytes]]:
        out = []
        for d in digests:
            path = self._blob_path(d)
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

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = [check_digest(d) for d in digests]

        def has() -> set[str]:
            self._packs.refresh()
            return {d for d in wanted if self._packs.locate(d) is not None or _is_file(self._blob_file(d))}

        return await self._run("stat", self._blobs, has)

    async def delete_blob(self, digest: str) -> bool:
        path = self._blob_path(check_digest(digest))

        def delete() -> bool:
            loose = self._unlink(path)
            packed = self._packs.delete(digest, _temp_prefix())
            return loose or packed

        return await self._run("delete", path, delete)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

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
        packed = {d: pack.mtime for d, pack in self._packs.live().items()}
        return self._scan_blobs(), packed

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
                loc = self._packs.locate(d)
                if loc is not None:
                    with contextlib.suppress(FileNotFoundError):  # a pack's mtime stands for all of its blobs
                        if os.stat(self._packs.path(loc[0])).st_mtime >= cutoff:
                            out.add(d)
            return out

        return await self._run("list", self._blobs, check)

    async def recent_blobs(self, within_s: float) -> set[str]:
        cutoff = time.time() - within_s
        loose, packed = await self._run("list", self._blobs, self._scan_all)
        return {d for d, st in loose.items() if st.st_mtime >= cutoff} | {
            d for d, mtime in packed.items() if mtime >= cutoff
        }

    # --- manifests ---------------------------------------------------------------------------------------

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        path = self._manifest_path(session_id)
        await self._run("write", path, partial(self._write_manifest, path, data))

    @staticmethod
    def _write_manifest(path: Path, data: bytes) -> None:
        tmp = _write_temp(path.parent, data, ("disk.manifest.written", "disk.manifest.fsynced"))
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        faults.point("disk.manifest.renamed")
        fsync_dir(path.parent)
        faults.point("disk.manifest.done")

    async def get_manifest(self, session_id: str) -> bytes:
        path = self._manifest_path(session_id)
        try:
            return await self._run("read", path, partial(_read_file, path))
        except StoreUnavailable as e:
            if isinstance(e.__cause__, FileNotFoundError):
                raise ManifestNotFound(session_id) from None
            raise

    def _scan_manifests(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in os.scandir(self._manifests):
            sid, ext = os.path.splitext(entry.name)
            if ext == ".json" and not entry.name.startswith(TMP_PREFIX):
                try:
                    out[check_session_id(sid)] = entry.stat(follow_symlinks=False).st_size
                except (ValueError, FileNotFoundError):
                    continue
        return out

    async def list_manifests(self) -> list[str]:
        return list(await self._run("list", self._manifests, self._scan_manifests))

    async def delete_manifest(self, session_id: str) -> bool:
        path = self._manifest_path(session_id)

        def delete() -> bool:
            existed = self._unlink(path)
            if existed:
                fsync_dir(path.parent)  # a deleted session must not come back after a crash
            return existed

        return await self._run("delete", path, delete)

    # --- leases ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, session_id: str) -> Iterator[None]:
        """Exclusive flock on the session's guard file (released by the kernel if this process dies)."""
        fd = os.open(
            self._leases / f"{session_id}.guard", os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, 0o644
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_lease(self, session_id: str) -> dict[str, object] | None:
        """The live lease record of another or this owner, or None if there is none or it is stale."""
        try:
            rec = json.loads(_read_file(self._leases / f"{session_id}.lock"))
            expires_at, pid, host = float(rec["expires_at"]), int(rec["pid"]), str(rec["host"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:  # torn or foreign: a lease nobody can prove it holds
            logger.warning("session %s: ignoring an unreadable lease file (%s)", session_id, e)
            return None
        if expires_at <= time.time() or (host == _HOST and not _pid_alive(pid)):
            return None
        return dict(rec)

    def _check_lease(self, session_id: str, owner: str) -> dict[str, object] | None:
        rec = self._read_lease(session_id)
        if rec is not None and rec.get("owner") != owner:
            raise SessionBusy(
                f"session {session_id!r} is held by another writer (pid {rec.get('pid')} on {rec.get('host')}, "
                f"lease token {rec.get('fence')}, expires in {float(str(rec['expires_at'])) - time.time():.1f} s)"
            )
        return rec

    def _take_lease(self, session_id: str, owner: str, ttl_s: float, rec: dict[str, object] | None) -> int:
        """Write our lease (caller holds the guard and checked `rec`, the current live lease or None)."""
        if rec is not None:
            fence = int(str(rec["fence"]))
            if float(str(rec["expires_at"])) - time.time() > ttl_s / 2:
                return fence  # fresh enough: skip a write on every save
        else:
            fence_path = self._leases / f"{session_id}.fence"
            try:
                fence = int(_read_file(fence_path) or b"0") + 1
            except FileNotFoundError:
                fence = 1
            except ValueError as e:  # the server's file, not the client's input: a 5xx, never a 400
                raise IntegrityError(f"{self.url}: lease fence file {fence_path} is corrupt: {e}") from e
            tmp = _write_temp(self._leases, str(fence).encode())
            os.replace(tmp, fence_path)
            fsync_dir(self._leases)
        body = {"owner": owner, "fence": fence, "pid": os.getpid(), "host": _HOST, "expires_at": time.time() + ttl_s}
        # Never fsynced: after a power loss every lease is void anyway (its process is gone).
        tmp = _write_temp(self._leases, json.dumps(body).encode(), sync=False)
        os.replace(tmp, self._leases / f"{session_id}.lock")
        faults.point("disk.lease.written")
        return fence

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        check_session_id(session_id)

        def acquire() -> int:
            with self._guard(session_id):
                return self._take_lease(session_id, owner, ttl_s, self._check_lease(session_id, owner))

        return await self._run("lease", self._leases, acquire)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        check_session_id(session_id)

        def release() -> bool:
            with self._guard(session_id):
                rec = self._read_lease(session_id)
                if rec is None or rec.get("owner") != owner:
                    return False
                return self._unlink(self._leases / f"{session_id}.lock")

        return await self._run("release lease", self._leases, release)

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        path = self._manifest_path(session_id)

        def commit() -> int:
            with self._guard(session_id):
                rec = self._check_lease(session_id, owner)
                try:
                    old: bytes | None = _read_file(path)
                except FileNotFoundError:
                    old = None
                stored = stored_generation(old)
                if stored != expected_generation:
                    raise SnapshotConflict(
                        f"session {session_id!r}: stored generation is {stored}, this save expected "
                        f"{expected_generation}"
                    )
                self._write_manifest(path, data)
                return self._take_lease(session_id, owner, ttl_s, rec)

        return await self._run("commit manifest", path, commit)

    async def stats(self) -> StoreStats:
        loose, packed = await self._run("list", self._blobs, self._scan_all)
        manifests = await self._run("list", self._manifests, self._scan_manifests)
        return StoreStats(
            num_blobs=len(loose.keys() | packed.keys()),
            # what the disk holds: whole pack files, dead bytes included until compaction
            blob_bytes=sum(st.st_size for st in loose.values()) + sum(p.size for p in self._packs.packs.values()),
            num_manifests=len(manifests),
            manifest_bytes=sum(manifests.values()),
        )


class _PackGone(Exception):
    """A pack named by the cached index was unlinked (compacted) meanwhile; re-scan and read again."""


class _Hasher:
    """sha256 of many buffers on a few threads, so hashing runs ahead of the writer on another core."""

    def __init__(self, buffers: Sequence[bytes]) -> None:
        self._buffers = buffers
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[str]] = []
        if _IO_THREADS > 1 and sum(map(len, buffers)) >= _PARALLEL_BYTES:
            self._pool = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="disk-hash")
            self._futures = [self._pool.submit(sha256_hex, b) for b in buffers]

    def result(self, i: int) -> str:
        return self._futures[i].result() if self._futures else sha256_hex(self._buffers[i])

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
