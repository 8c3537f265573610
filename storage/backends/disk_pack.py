"""Pack files of the disk store: one save's new blobs in one file, so a save costs one file, not one per page.

A pack is immutable once named (``ROOT/blobs/packs/pack-<time>-<random>.pack``); its layout and checks are
disk_pack_format's. Content addressing is unchanged: every blob keeps its own digest, is deduplicated by it and is
verified against it on every read.

Deleting a packed blob appends its digest to ``<pack>.dead`` (not fsynced: a tombstone lost in a crash only
brings back an unreferenced blob, which the next collection deletes again; a torn last tombstone is ignored by
readers and cut off by the next append, so the ones after it stay aligned). A pack whose blobs are all dead is
unlinked; one that is at least three quarters dead is compacted (live blobs re-verified and written to a new
pack made durable before the old one is unlinked). Tombstones and compaction hold an flock on
``packs/.lock``; readers take no lock and re-scan when a pack they knew has gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import faults
from ..errors import IncompatibleSnapshot, IntegrityError
from .disk_files import O_CLOEXEC, O_NOFOLLOW, fsync_dir, replace_durably, sha256_hex, write_all
from .disk_pack_format import HEADER_BYTES, encode_header, encode_index, parse_index

logger = logging.getLogger(__name__)

PACK_SUFFIX = ".pack"
DEAD_SUFFIX = ".dead"
COMPACT_DEAD_FRACTION = 0.75
"""A pack with at least this fraction of its data bytes dead is rewritten without them."""

WRITEBACK_CHUNK_BYTES = 1 << 20
"""A pack's bytes are handed to the disk every this many bytes while the rest is still being written (see
`start_writeback`), so its fsync waits for the last chunk instead of the whole file: 20 MiB packs took 18 ms
to write and fsync without this, 9 ms with it, on the benchmark VM (1 MiB beat 0.5, 2, 4 and 8 MiB there)."""
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of dirty pages in the range, do not wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_LIBC_SYNC_FILE_RANGE = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` back to the disk without waiting for them
    (Linux sync_file_range(2), SYNC_FILE_RANGE_WRITE). Only a head start for the fsync that must still follow:
    it promises no durability and waits for nothing. A system without the call makes this a no-op; an I/O error
    it reports is raised, so the file is abandoned like after a failed write (never fsynced and trusted)."""
    if _LIBC_SYNC_FILE_RANGE is None:
        return
    if _LIBC_SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE, errno.EPERM):
            return  # not offered here (a sandbox, another kernel): the fsync does all of the work
        raise OSError(code, os.strerror(code))


@dataclass
class Pack:
    """What this process knows of one pack file."""

    name: str
    ino: int
    size: int
    mtime: float
    entries: dict[str, tuple[int, int]]
    dead: set[str] = field(default_factory=set)
    dead_file_size: int = 0

    @property
    def data_bytes(self) -> int:
        return sum(n for _, n in self.entries.values())

    @property
    def dead_bytes(self) -> int:
        return sum(self.entries[d][1] for d in self.dead)

    def live(self) -> Iterator[str]:
        return (d for d in self.entries if d not in self.dead)


class PackSet:
    """The packs under one folder: a cached index of every pack, refreshed from the folder on demand."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.packs: dict[str, Pack] = {}
        self.corrupt: dict[str, str] = {}
        """Pack name -> why its index is unusable (its blobs read as IntegrityError, never as absent data)."""
        self.newer: dict[str, str] = {}
        """Pack name -> why this release cannot read it: a pack format version above its own (a newer release
        wrote it). Like a corrupt pack it is never deleted, compacted or dropped here, nor its tombstones; a blob
        it may hold reads as IncompatibleSnapshot."""
        self._where: dict[str, str] = {}
        """Digest -> name of a pack that holds it, for every digest of every known pack (live there unless
        tombstoned since): `locate` is one lookup however many packs there are."""
        self._mutex = threading.Lock()

    # --- the index ---------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Pick up packs and tombstones written by anyone since the last call; forget packs that are gone."""
        if not self.folder.is_dir():
            return
        seen: dict[str, os.stat_result] = {}
        dead_sizes: dict[str, int] = {}
        for entry in os.scandir(self.folder):
            stem, ext = os.path.splitext(entry.name)
            if not entry.name.startswith("pack-"):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if ext == PACK_SUFFIX:
                    seen[stem] = st
                elif ext == DEAD_SUFFIX:
                    dead_sizes[stem] = st.st_size
        with self._mutex:
            for name in set(self.packs) - set(seen):
                self._forget(self.packs[name])
            for name in set(self.corrupt) - set(seen):
                del self.corrupt[name]
            for name in set(self.newer) - set(seen):
                del self.newer[name]
        for name, st in seen.items():
            pack = self.packs.get(name)
            if pack is None or pack.ino != st.st_ino:
                if name in self.corrupt or name in self.newer:
                    continue
                try:
                    pack = self._load(name, st)
                except IncompatibleSnapshot as e:
                    logger.warning("%s; left in place", e)
                    with self._mutex:
                        self.newer[name] = str(e)
                    continue
                except IntegrityError as e:
                    logger.error("%s", e)
                    with self._mutex:
                        self.corrupt[name] = str(e)
                    continue
                except FileNotFoundError:
                    continue
            pack.mtime = st.st_mtime
            if dead_sizes.get(name, 0) != pack.dead_file_size:
                self._read_dead(pack)
            with self._mutex:
                old = self.packs.get(name)
                if old is not pack:
                    if old is not None:
                        self._forget(old)
                    self.packs[name] = pack
                    self._remember(pack)

    def _load(self, name: str, st: os.stat_result) -> Pack:
        path = self.folder / f"{name}{PACK_SUFFIX}"
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            entries = parse_index(lambda off, n: os.pread(fd, n, off), size, str(path))
        finally:
            os.close(fd)
        return Pack(name, st.st_ino, size, st.st_mtime, entries)

    def _read_dead(self, pack: Pack) -> None:
        try:
            raw = (self.folder / f"{pack.name}{DEAD_SUFFIX}").read_bytes()
        except FileNotFoundError:
            raw = b""
        whole = len(raw) - len(raw) % 32  # a torn last append is ignored
        pack.dead = {raw[i : i + 32].hex() for i in range(0, whole, 32)} & set(pack.entries)
        pack.dead_file_size = len(raw)

    def _remember(self, pack: Pack) -> None:
        """Index ``pack``'s digests (caller holds the mutex and has put it in ``packs``)."""
        for d in pack.entries:
            cur = self.packs.get(self._where.get(d, ""))
            if cur is None or d in cur.dead:
                self._where[d] = pack.name

    def _forget(self, pack: Pack) -> None:
        """Drop ``pack`` and its index entries, pointing each at another pack that holds the digest, if any
        (duplicates only follow a compaction; caller holds the mutex)."""
        self.packs.pop(pack.name, None)
        for d in pack.entries:
            if self._where.get(d) != pack.name:
                continue
            del self._where[d]
            for other in self.packs.values():
                if d in other.entries:
                    self._where[d] = other.name
                    if d not in other.dead:
                        break

    def locate(self, digest: str) -> tuple[Pack, int, int] | None:
        """Where a live copy of ``digest`` lies in a pack, or None."""
        with self._mutex:
            name = self._where.get(digest)
            if name is None:
                return None  # no pack holds it at all
            pack = self.packs.get(name)
            if pack is not None and digest not in pack.dead:
                off, n = pack.entries[digest]
                return pack, off, n
            for pack in self.packs.values():  # tombstoned there: another pack may still hold it live
                loc = pack.entries.get(digest)
                if loc is not None and digest not in pack.dead:
                    return pack, loc[0], loc[1]
        return None

    def live_mtimes(self) -> dict[str, float]:
        """Every live packed digest -> the newest mtime of the packs holding it live: a streamed save writes a
        blob again into its own pack, and that fresh copy is what keeps a collection off the blob."""
        out: dict[str, float] = {}
        with self._mutex:
            for p in self.packs.values():
                for d in p.live():
                    out[d] = max(out.get(d, p.mtime), p.mtime)
        return out

    def holders(self, digest: str) -> list[Pack]:
        """Every pack holding a live copy of ``digest``."""
        with self._mutex:
            return [p for p in self.packs.values() if digest in p.entries and digest not in p.dead]

    def path(self, pack: Pack) -> Path:
        return self.folder / f"{pack.name}{PACK_SUFFIX}"

    # --- writing -----------------------------------------------------------------------------------------

    def write(self, items: Sequence[tuple[str, bytes]], verified: Callable[[int], None], tmp_prefix: str) -> None:
        """Write one pack of ``items`` (digest, bytes) and make it durable: `write_stream` of one chunk."""
        self.write_stream([items], verified, tmp_prefix)

    def write_stream(
        self, chunks: Iterable[Sequence[tuple[str, bytes]]], verified: Callable[[int], None], tmp_prefix: str
    ) -> list[str]:
        """Write one pack of the blobs (digest, bytes) that ``chunks`` yields, each written as soon as its chunk
        arrives (the data comes first, the index last: however many blobs follow, nothing written moves), then
        make it durable; returns the digests in the pack, in order. ``verified(i)`` raises if the i-th blob's
        bytes do not match its digest (checked just before they are written). A digest seen twice is written
        once. No blob at all: no pack. On any error the temp file is closed and removed, never written or
        fsynced again. The temp file is named ``tmp_prefix`` plus a random suffix (the store's prefix names this
        host and process)."""
        if not self.folder.is_dir():
            self.folder.mkdir(exist_ok=True)
            fsync_dir(self.folder.parent)
        name = f"pack-{time.time_ns():x}-{secrets.token_hex(8)}"
        tmp = self.folder / f"{tmp_prefix}{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o644)
        kept: list[tuple[str, int]] = []
        try:
            write_all(fd, encode_header())
            written = flushed = HEADER_BYTES
            seen: set[str] = set()
            i = 0
            for chunk in chunks:
                for d, data in chunk:
                    verified(i)
                    i += 1
                    if d in seen:
                        continue
                    seen.add(d)
                    kept.append((d, len(data)))
                    write_all(fd, data)
                    written += len(data)
                    if written - flushed >= WRITEBACK_CHUNK_BYTES:
                        start_writeback(fd, flushed, written - flushed)
                        flushed = written
            if kept:
                write_all(fd, encode_index(kept))
                faults.point("disk.blob.written")
                os.fsync(fd)
                faults.point("disk.blob.fsynced")
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        if not kept:
            tmp.unlink(missing_ok=True)
            return []
        replace_durably(tmp, self.folder / f"{name}{PACK_SUFFIX}", ("disk.blob.linked", "disk.blob.done"))
        return [d for d, _ in kept]

    def touch(self, packs: set[str]) -> None:
        for name in packs:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.folder / f"{name}{PACK_SUFFIX}")

    # --- deleting ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def delete(self, digest: str, tmp_prefix: str) -> bool:
        """Tombstone every live packed copy of ``digest``; drop or compact packs that are (mostly) dead."""
        if not self.folder.is_dir():
            return False
        with self._locked():
            self.refresh()
            holders = self.holders(digest)
            for pack in holders:
                fd = os.open(
                    self.folder / f"{pack.name}{DEAD_SUFFIX}",
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o644,
                )
                try:
                    torn = os.fstat(fd).st_size % 32
                    if torn:  # a torn last append: cut off, else this and every later tombstone is misread
                        os.ftruncate(fd, os.fstat(fd).st_size - torn)
                    write_all(fd, bytes.fromhex(digest))
                    pack.dead_file_size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                pack.dead.add(digest)
                if len(pack.dead) == len(pack.entries):
                    self._drop(pack)
                elif pack.dead_bytes >= COMPACT_DEAD_FRACTION * pack.data_bytes:
                    self._compact(pack, tmp_prefix)
        return bool(holders)

    def _drop(self, pack: Pack) -> None:
        self.path(pack).unlink(missing_ok=True)
        (self.folder / f"{pack.name}{DEAD_SUFFIX}").unlink(missing_ok=True)
        with self._mutex:
            known = self.packs.get(pack.name)
            if known is not None:
                self._forget(known)

    def _compact(self, pack: Pack, tmp_prefix: str) -> None:
        """Rewrite ``pack`` without its dead blobs; a live blob that fails verification is left out (logged):
        the store then lacks it, so the next save that needs it writes it again."""
        items: list[tuple[str, bytes]] = []
        fd = os.open(self.path(pack), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        try:
            for d in pack.live():
                off, n = pack.entries[d]
                data = os.pread(fd, n, off)
                if sha256_hex(data) == d:
                    items.append((d, data))
                else:
                    logger.error("%s: blob %s is corrupt; not kept by compaction", self.path(pack), d)
        finally:
            os.close(fd)
        if items:
            self.write(items, lambda i: None, tmp_prefix)
        self._drop(pack)  # only once the new pack is durable: a crash in between leaves duplicates only
        self.refresh()

    def drop_redundant(self) -> None:
        """Unlink packs whose every live blob another pack also holds (left by a crash inside a compaction,
        or written by a streamed save that sent blobs the store held), and tombstone files whose pack is gone
        (left by a crash inside a drop). A pack newer than the copies kept passes its mtime on to them, so no
        blob of it looks older to a collection (a save that streamed it may not have committed yet)."""
        if not self.folder.is_dir() or not any(e.name.startswith("pack-") for e in os.scandir(self.folder)):
            return  # nothing to drop: take no lock (its file would be the folder's only entry)
        with self._locked():
            self.refresh()
            for entry in os.scandir(self.folder):
                stem, ext = os.path.splitext(entry.name)
                kept = stem in self.packs or stem in self.corrupt or stem in self.newer
                if ext == DEAD_SUFFIX and not kept:
                    Path(entry.path).unlink(missing_ok=True)
            with self._mutex:
                packs = sorted(self.packs.values(), key=lambda p: p.name)
            for pack in packs:
                others = {d for p in packs if p is not pack and p.name in self.packs for d in p.live()}
                live = set(pack.live())
                if live <= others:
                    logger.info("removing pack %s: every live blob is held by another pack", pack.name)
                    for p in packs:  # a blob's age is its packs' mtime: the copies kept inherit this one's
                        kept = p is not pack and p.name in self.packs
                        if kept and p.mtime < pack.mtime and not live.isdisjoint(p.live()):
                            with contextlib.suppress(FileNotFoundError):
                                os.utime(self.path(p), (pack.mtime, pack.mtime))
                            p.mtime = pack.mtime
                    self._drop(pack)

