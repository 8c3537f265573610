"""Crash-safe file primitives shared by the disk store's parts (disk, disk_pack, disk_read, disk_manifests).

Every write goes to a uniquely named temp file (`TMP_PREFIX`, O_EXCL) in the destination directory, is flushed
and made durable, then moved into place; a failed write or fsync is never retried on the same file (the temp
file is closed and removed). A temp file's name carries its writer's host and pid (`temp_prefix`), so that
`orphaned` can tell a dead writer's leftovers from a live writer's file, whatever the clocks say.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import faults
from ..blobs import HASH_THREADS

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

TMP_PREFIX = ".tmp-"
PARALLEL_HASH_BYTES = 1 << 20  # below this a batch is hashed on the calling thread

HOST = socket.gethostname()


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


HOST_TAG = sha256_hex(HOST.encode())[:8]
"""Names this host in temp file names (`.tmp-<host tag>-<pid>-<random>`)."""


def temp_prefix() -> str:
    """The name prefix of this process's temp files: `.tmp-<host tag>-<pid>-`; a random suffix completes it."""
    return f"{TMP_PREFIX}{HOST_TAG}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def process_start_time() -> float:
    """Wall-clock start of this process (Linux /proc), else now; temp files older than it are orphans."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def orphaned(name: str, mtime: float, cutoff: float) -> bool:
    """Whether the temp file `name` (modified at `mtime`) was left by a writer that is gone.

    A temp file of this host names its writer: it is an orphan once that process has died, and never while it
    lives (a writer fsyncing a large blob is not disturbed). A temp file of another host, or of an older
    name form, cannot be checked that way: it is an orphan if it is older than this process (`cutoff`). Like the
    leases, this assumes that the processes sharing a host name share a pid namespace."""
    parts = name[len(TMP_PREFIX) :].split("-")
    if len(parts) == 3 and parts[0] == HOST_TAG and parts[1].isdigit():
        pid = int(parts[1])
        return pid != os.getpid() and not pid_alive(pid)
    return mtime < cutoff


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


LIBC_SYNCFS = _load_syncfs()
"""syncfs(2) where libc has it, else None (then `durable` fsyncs each path)."""


def syncfs(fd: int) -> None:
    """syncfs(2): flush the whole filesystem holding ``fd`` and report any writeback error on it (Linux >= 5.8)."""
    assert LIBC_SYNCFS is not None
    if LIBC_SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def durable(paths: list[Path]) -> None:
    """Make the data (or, for directories, the entries) of ``paths`` durable. One syncfs covers a whole batch
    where the OS has it (a save of N page blobs costs one flush instead of N fsyncs), else fsync each."""
    if not paths:
        return
    if LIBC_SYNCFS is not None:
        fd = os.open(paths[0], os.O_RDONLY | O_CLOEXEC)
        try:
            syncfs(fd)
        finally:
            os.close(fd)
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY | O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes the links and renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_temp(directory: Path, data: bytes, points: tuple[str, str] | None = None, *, sync: bool = True) -> Path:
    """Write `data` to a new temp file in `directory`, fsynced unless not `sync`; returns its path.

    On any error the file is closed and removed, never written or fsynced again. `points` names the fault
    points after the write and after the fsync.
    """
    tmp = directory / f"{temp_prefix()}{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
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


def link_new(tmp: Path, path: Path) -> bool:
    """Put ``tmp`` at ``path`` unless a file is already there; True if this call placed it."""
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


def replace_durably(tmp: Path, path: Path, points: tuple[str, str]) -> None:
    """Rename ``tmp`` onto ``path`` (``tmp`` removed if that fails), then make the rename durable; ``points`` are
    the fault points after the rename and after the folder's fsync."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    faults.point(points[0])
    fsync_dir(path.parent)
    faults.point(points[1])


def mkdir_durable(path: Path) -> None:
    """Create ``path`` and any missing parents, each made durable in its parent (fsync of the parent)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def is_file(path: str) -> bool:
    """`Path(path).is_file()` without the Path (same errors ignored)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return False
        raise


def read_file(path: Path) -> bytes:
    """The whole file at ``path``, never through a symlink (ELOOP)."""
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        return f.readall()


def unlink(path: Path) -> bool:
    """Remove ``path``; True if it existed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


class Hasher:
    """sha256 of many buffers on a few threads, so hashing runs ahead of the writer on another core."""

    def __init__(self, buffers: Sequence[bytes]) -> None:
        self._buffers = buffers
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[str]] = []
        if HASH_THREADS > 1 and sum(map(len, buffers)) >= PARALLEL_HASH_BYTES:
            self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="disk-hash")
            self._futures = [self._pool.submit(sha256_hex, b) for b in buffers]

    def result(self, i: int) -> str:
        return self._futures[i].result() if self._futures else sha256_hex(self._buffers[i])

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
