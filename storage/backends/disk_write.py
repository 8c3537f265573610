"""Writing blobs into the disk store's files: one loose file, a batch (one pack, or loose files made durable
together), or a stream (one pack written chunk by chunk as the producer hands it over; see storage/stream.py).

Every write follows disk_files: temp file, made durable, moved into place (link for loose blobs, so an existing
blob is never replaced; rename for packs), directory made durable, with the fault points of storage/faults.py
between the steps. A blob already stored (loose or packed) is not written again by `put_one` / `put_many`, only
touched (a re-put is a use, which refreshes its GC grace period).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import faults
from ..errors import IntegrityError
from ..stream import BlobStream
from .disk_files import (
    LIBC_SYNCFS,
    Hasher,
    durable,
    fsync_dir,
    link_new,
    sha256_hex,
    temp_prefix,
    write_temp,
)
from .disk_pack import PackSet


class BlobWriter:
    """Writes blobs of one store: loose files under ``blobs/`` and packs in ``packs``; a batch of at least
    ``pack_min_blobs`` new blobs becomes one pack."""

    def __init__(self, url: str, blobs: Path, packs: PackSet, pack_min_blobs: int) -> None:
        self.url = url
        self.blobs = blobs
        self.packs = packs
        self.pack_min_blobs = pack_min_blobs
        self._blobs_str = str(blobs)

    def blob_path(self, digest: str) -> Path:
        return self.blobs / digest[:2] / digest

    def put_one(self, path: Path, data: bytes) -> bool:
        """Write one loose blob at ``path`` unless the blob is stored; True if this call wrote it."""
        if self.exists_touch(path.name):
            return False
        shard = path.parent
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            fsync_dir(shard.parent)
        tmp = write_temp(shard, data, ("disk.blob.written", "disk.blob.fsynced"))
        try:
            written = link_new(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        faults.point("disk.blob.linked")
        fsync_dir(shard)
        faults.point("disk.blob.done")
        return written

    def blob_file(self, digest: str) -> str:
        """`blob_path` as a str: a batch check of a thousand blobs spends more on Path objects than on stat."""
        return f"{self._blobs_str}/{digest[:2]}/{digest}"

    def exists_touch(self, digest: str) -> bool:
        """True if the blob is stored (loose or packed), refreshing its GC grace period: a re-put is a use."""
        loc = self.packs.locate(digest)  # one dict lookup: before the stat, which most saves' blobs miss
        if loc is not None:
            self.packs.touch({loc[0].name})
            return True
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.blob_file(digest))
            return True
        return False

    def put_many(self, items: list[tuple[str, bytes]], trusted: bool = False) -> set[str]:
        """Store a batch (see `DiskStore.put_blobs`); the digests written. Unless ``trusted``, digests are
        verified on other threads while the batch is written."""
        self.packs.refresh()
        with Hasher([] if trusted else [data for _, data in items]) as hashes:

            def verified(i: int) -> None:
                if trusted:
                    return
                actual = hashes.result(i)
                if actual != items[i][0]:
                    raise IntegrityError(
                        f"put into {self.url}: blob {items[i][0]} has sha256 {actual} ({len(items[i][1])} bytes)"
                    )

            new = [i for i, (d, _) in enumerate(items) if not self.exists_touch(d)]
            for i in sorted(set(range(len(items))) - set(new)):
                verified(i)
            if len(new) >= self.pack_min_blobs:
                self.packs.write([items[i] for i in new], lambda j: verified(new[j]), temp_prefix())
                self.packs.refresh()
                return {items[i][0] for i in new}
            return self._put_loose([items[i] for i in new], lambda j: verified(new[j]))

    def put_stream(self, stream: BlobStream, trusted: bool) -> set[str]:
        """One pack of the blobs of ``stream``, written as they arrive (`PackSet.write_stream`); the digests
        written. Unless ``trusted``, each blob is hashed just before it is written. On any error the
        stream is abandoned (its producer's next put raises) and the error raised."""
        seen: list[tuple[str, bytes]] = []

        def chunks() -> Iterator[list[tuple[str, bytes]]]:
            for chunk in stream.chunks():
                seen.extend(chunk)
                yield chunk

        def verified(i: int) -> None:
            if not trusted and sha256_hex(seen[i][1]) != seen[i][0]:
                d, data = seen[i]
                raise IntegrityError(
                    f"put into {self.url}: blob {d} has sha256 {sha256_hex(data)} ({len(data)} bytes)"
                )

        try:
            self.packs.refresh()
            digests = self.packs.write_stream(chunks(), verified, temp_prefix())
        except BaseException:
            stream.abandon()
            raise
        self.packs.refresh()
        return set(digests)

    def _put_loose(self, items: list[tuple[str, bytes]], verified: Callable[[int], None]) -> set[str]:
        pending: list[tuple[str, Path, Path]] = []
        written: set[str] = set()
        new_shard = False
        try:
            for j, (d, data) in enumerate(items):
                verified(j)
                path = self.blob_path(d)
                if not path.parent.is_dir():
                    path.parent.mkdir(exist_ok=True)
                    new_shard = True
                pending.append((d, path, write_temp(path.parent, data, sync=False)))
                faults.point("disk.blob.written")
            if not pending:
                return written
            durable([tmp for _, _, tmp in pending])  # a failure abandons every temp file (finally below)
            faults.point("disk.blob.fsynced")
            for d, path, tmp in pending:
                if link_new(tmp, path):
                    written.add(d)
                tmp.unlink(missing_ok=True)
            faults.point("disk.blob.linked")
            dirs = sorted({path.parent for _, path, _ in pending} | ({self.blobs} if new_shard else set()))
            if LIBC_SYNCFS is not None:
                durable(dirs[:1])  # one syncfs covers every directory of this filesystem
            else:
                for p in dirs:
                    fsync_dir(p)
            faults.point("disk.blob.done")
        finally:
            for _, _, tmp in pending:
                tmp.unlink(missing_ok=True)
        return written
