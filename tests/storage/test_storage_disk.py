"""Disk backend specifics: layout, atomic writes, temp file cleanup, OSError mapping."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kda_sessions.storage.backends import disk_files
from kda_sessions.storage.backends.disk import TMP_PREFIX, DiskStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import IntegrityError, StoreUnavailable


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


async def test_layout_and_no_temp_files_left(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path)
    d = digest(b"abc")
    await store.put_blob(d, b"abc")
    await store.put_blob(d, b"abc")
    await store.put_manifest("sess", b"{}")
    assert (tmp_path / "blobs" / d[:2] / d).read_bytes() == b"abc"
    assert (tmp_path / "manifests" / "sess.json").read_bytes() == b"{}"
    assert _temp_files(tmp_path) == []


async def test_open_removes_orphaned_temp_files_only(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path)
    d = digest(b"abc")
    await store.put_blob(d, b"abc")
    old = [tmp_path / "manifests" / f"{TMP_PREFIX}1-dead", tmp_path / "blobs" / d[:2] / f"{TMP_PREFIX}1-dead"]
    for p in old:
        p.write_bytes(b"half a file")
        os.utime(p, (1_000_000, 1_000_000))  # long before this process started
    fresh = tmp_path / "manifests" / f"{TMP_PREFIX}2-inflight"  # a live writer in another process
    fresh.write_bytes(b"in progress")
    await DiskStore.open(tmp_path)
    assert _temp_files(tmp_path) == [fresh]
    assert await store.list_manifests() == []
    assert await store.get_blob(d) == b"abc"


async def test_open_removes_temp_files_of_dead_writers_of_this_host(tmp_path: Path) -> None:
    """A temp file named by this host's writer goes once that process has died, however new its mtime (a writer
    killed a moment before this process started), and stays while it lives, however old its mtime."""
    await DiskStore.open(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / "manifests" / f"{TMP_PREFIX}{disk_files.HOST_TAG}-{gone.pid}-0123456789abcdef"
    live = tmp_path / "leases" / f"{TMP_PREFIX}{disk_files.HOST_TAG}-{os.getppid()}-0123456789abcdef"
    other_host = tmp_path / "manifests" / f"{TMP_PREFIX}00000000-{gone.pid}-0123456789abcdef"  # can't be checked
    for p in (dead, live, other_host):
        p.write_bytes(b"half a file")
    os.utime(live, (1_000_000, 1_000_000))
    await DiskStore.open(tmp_path)
    assert sorted(_temp_files(tmp_path)) == sorted([live, other_host])


async def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await DiskStore.open(tmp_path)

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_files.os, "write", full_disk)
    with pytest.raises(StoreUnavailable, match="ENOSPC") as info:
        await store.put_blob(digest(b"abc"), b"abc")
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(StoreUnavailable, match="ENOSPC"):
        await store.put_manifest("s", b"{}")
    monkeypatch.undo()
    assert _temp_files(tmp_path) == []
    assert await store.list_blobs() == [] and await store.list_manifests() == []


async def test_symlinked_blob_is_not_followed(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path / "store")
    d = digest(b"abc")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"abc")
    (tmp_path / "store" / "blobs" / d[:2]).mkdir()
    (tmp_path / "store" / "blobs" / d[:2] / d).symlink_to(target)
    with pytest.raises(IntegrityError, match="symlink"):
        await store.get_blob(d)


async def test_unwritable_root_is_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreUnavailable):
        await DiskStore.open(blocker / "store")
