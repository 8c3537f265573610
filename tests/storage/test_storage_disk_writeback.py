"""Disk store save path tuned for throughput: a pack's bytes go to the disk while the rest is written (a head
start for the one fsync, never a substitute for it), a failure of that hand-off abandons the pack like a failed
write, and `open` makes the folders it creates durable so a first save pays no mkdir."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
from pathlib import Path

import pytest
from storage_helpers import make_snapshot, pack_files, synthetic_blobs

from kda_sessions.storage import SnapshotStore
from kda_sessions.storage.backends import disk_files, disk_pack
from kda_sessions.storage.backends.disk import TMP_PREFIX, DiskStore
from kda_sessions.storage.errors import StoreUnavailable


def _blobs(n: int, size: int = 5000, seed: int = 0) -> dict[str, bytes]:
    return synthetic_blobs(n, size, seed)


_packs = pack_files


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


async def test_pack_bytes_are_handed_to_the_disk_in_order_then_fsynced_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(10)
    events: list[tuple[str, str, int, int]] = []
    real_wb, real_fsync = disk_pack.start_writeback, os.fsync

    def writeback(fd: int, offset: int, length: int) -> None:
        events.append(("writeback", _fd_path(fd), offset, length))
        real_wb(fd, offset, length)

    def fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd), 0, 0))
        real_fsync(fd)

    monkeypatch.setattr(disk_pack, "WRITEBACK_CHUNK_BYTES", 12_000)
    monkeypatch.setattr(disk_pack, "start_writeback", writeback)
    monkeypatch.setattr(disk_files.os, "fsync", fsync)
    assert await store.put_blobs(blobs) == set(blobs)
    monkeypatch.undo()
    tmp = [e for e in events if TMP_PREFIX in e[1]]
    kinds = [e[0] for e in tmp]
    assert kinds[-1] == "fsync" and kinds.count("fsync") == 1  # the fsync comes after every hand-off
    ranges = [(off, n) for kind, _, off, n in tmp if kind == "writeback"]
    assert len(ranges) >= 3
    assert all(n >= 12_000 for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))  # contiguous, in order
    (pack,) = _packs(tmp_path)
    assert ranges[-1][0] + ranges[-1][1] <= pack.stat().st_size
    assert await (await DiskStore.open(tmp_path)).get_blobs(list(blobs)) == blobs


def _failing_sync_file_range(code: int):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def fake(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append(fd)
        ctypes.set_errno(code)
        return -1

    return fake, calls


async def test_writeback_io_error_abandons_the_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    old = _blobs(4, seed=1)
    await store.put_blobs(old)
    fake, calls = _failing_sync_file_range(errno.EIO)
    fsynced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        fsynced.append(_fd_path(fd))
        real_fsync(fd)

    monkeypatch.setattr(disk_pack, "WRITEBACK_CHUNK_BYTES", 6000)
    monkeypatch.setattr(disk_pack, "_LIBC_SYNC_FILE_RANGE", fake)
    monkeypatch.setattr(disk_files.os, "fsync", fsync)
    new = _blobs(8, seed=2)
    with pytest.raises(StoreUnavailable, match="EIO"):
        await store.put_blobs(new)
    monkeypatch.undo()
    assert len(calls) == 1  # the first error stops the pack: nothing more is written to it
    assert not any(TMP_PREFIX in p for p in fsynced)  # never fsynced and trusted after the error
    assert _temp_files(tmp_path) == [] and len(_packs(tmp_path)) == 1
    assert await store.has_blobs([*old, *new]) == set(old)
    assert await store.get_blobs(list(old)) == old


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL], ids=["enosys", "einval"])
async def test_writeback_unavailable_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    fake, calls = _failing_sync_file_range(code)
    monkeypatch.setattr(disk_pack, "WRITEBACK_CHUNK_BYTES", 6000)
    monkeypatch.setattr(disk_pack, "_LIBC_SYNC_FILE_RANGE", fake)
    blobs = _blobs(8)
    assert await store.put_blobs(blobs) == set(blobs)
    assert len(calls) > 1
    assert await (await DiskStore.open(tmp_path)).get_blobs(list(blobs)) == blobs


async def test_a_save_that_fails_mid_pack_keeps_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole-snapshot save dies while its pack is handed to the disk (before the fsync, the rename and the
    manifest): the previous generation still loads, nothing of the new one is visible, no temp file survives."""
    url = f"disk:{tmp_path}"
    snaps = await SnapshotStore.open(url)
    snaps.store.pack_min_blobs = 2  # type: ignore[attr-defined]
    m1, b1 = make_snapshot("sess", 40)
    await snaps.save(m1, b1, expected_generation=0)
    m2, b2 = make_snapshot("sess", 80, tokens=list(range(500, 580)))
    m2 = m2.model_copy(update={"generation": 2})
    fake, _ = _failing_sync_file_range(errno.EIO)
    monkeypatch.setattr(disk_pack, "WRITEBACK_CHUNK_BYTES", 64)
    monkeypatch.setattr(disk_pack, "_LIBC_SYNC_FILE_RANGE", fake)
    with pytest.raises(StoreUnavailable):
        await snaps.save(m2, b2, expected_generation=1)
    monkeypatch.undo()
    await snaps.close()
    fresh = await SnapshotStore.open(url)
    got = await fresh.load_manifest("sess")
    assert got.generation == 1 and got.blob_digests() == m1.blob_digests()
    assert await fresh.load_blobs(got.blob_digests()) == {d: b1[d] for d in got.blob_digests()}
    assert await fresh.store.has_blobs(set(b2) - set(b1)) == set()
    assert _temp_files(tmp_path) == []
    await fresh.close()


async def test_open_creates_the_layout_durably_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[Path] = []
    real = disk_files.fsync_dir

    def fsync_dir(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(disk_files, "fsync_dir", fsync_dir)
    root = tmp_path / "store"
    await DiskStore.open(root)
    assert (root / "blobs" / "packs").is_dir()
    # every folder made is durable in its parent before anything is written into it
    assert set(synced) == {tmp_path, root, root / "blobs"}
    synced.clear()
    store = await DiskStore.open(root)
    assert synced == []  # nothing made, nothing to sync
    await store.put_blobs(_blobs(70))  # a first pack: no mkdir, so no parent fsync, in the save
    assert root / "blobs" not in synced


async def test_pack_index_follows_duplicates_tombstones_and_vanished_packs(tmp_path: Path) -> None:
    """`locate` answers from one digest -> pack index: a blob tombstoned in one pack but live in another (a crash
    inside a compaction leaves such duplicates) is still found, and so is one whose indexed pack vanished."""
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    a, b = _blobs(4, seed=1), _blobs(4, seed=2)
    await store.put_blobs(a)
    await store.put_blobs(b)
    (first, _) = _packs(tmp_path)
    store._packs.write(list(a.items()), lambda i: None, TMP_PREFIX)  # a second copy of a, in a third pack
    keys = list(a)
    with open(first.with_suffix(".dead"), "ab") as f:  # another process tombstones keys[0] in the first pack only
        f.write(bytes.fromhex(keys[0]))
    assert await store.has_blobs([*a, *b]) == set(a) | set(b)
    assert await store.get_blobs(keys) == a
    copies = [p for p in _packs(tmp_path) if p != first and set(a) <= set(_index_of(p))]
    assert len(copies) == 1
    copies[0].unlink()  # another process drops the copy: keys[0] is now dead everywhere, the rest live in `first`
    assert await store.has_blobs([*a, *b]) == (set(a) - {keys[0]}) | set(b)
    assert await store.get_blobs(keys[1:]) == {d: a[d] for d in keys[1:]}
    fresh = await DiskStore.open(tmp_path)
    assert await fresh.has_blobs([*a, *b]) == (set(a) - {keys[0]}) | set(b)


def _index_of(pack: Path) -> list[str]:
    data = pack.read_bytes()
    return list(disk_pack.parse_index(lambda off, n: data[off : off + n], len(data), str(pack)))
