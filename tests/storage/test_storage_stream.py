"""Blob streams: a store writes each chunk while the producer makes the next (one pack on disk, written before the
stream ends), on every backend; duplicates, a failing producer, a failing writer and a wrong count."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from storage_helpers import pack_files, synthetic_blobs

from kda_sessions.storage import BlobStream, RamTier, TieredStore
from kda_sessions.storage.backends import disk_files
from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.disk import TMP_PREFIX, DiskStore
from kda_sessions.storage.errors import StoreUnavailable
from kda_sessions.storage.stream import StreamAbandoned


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


def _chunks(blobs: dict[str, bytes], size: int) -> list[list[tuple[str, bytes]]]:
    items = list(blobs.items())
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _stream_into(store: BlobStore, chunks: list[list[tuple[str, bytes]]], count: int) -> set[str]:
    stream = BlobStream(count)

    def produce() -> None:
        for chunk in chunks:
            stream.put(chunk)
        stream.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, produce)
        written = await store.put_blob_stream(stream)
    return written


async def test_every_backend_stores_a_stream(store: BlobStore) -> None:
    blobs = synthetic_blobs(150, 2000, seed=1)
    assert await _stream_into(store, _chunks(blobs, 40), len(blobs)) == set(blobs)
    assert await store.get_blobs(list(blobs)) == blobs


async def test_disk_writes_one_pack_chunk_by_chunk_before_the_stream_ends(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    blobs = synthetic_blobs(30, 5000, seed=2)
    chunks = _chunks(blobs, 10)
    stream = BlobStream()
    seen_before_last: list[int] = []

    def produce() -> None:
        stream.announce(len(blobs))
        for i, chunk in enumerate(chunks):
            if i == len(chunks) - 1:  # wait until the writer has the first two chunks in the temp file
                for _ in range(500):
                    sizes = [p.stat().st_size for p in _temp_files(tmp_path)]
                    if sizes and max(sizes) >= 20 * 5000:
                        break
                    threading.Event().wait(0.01)
                seen_before_last.extend(sizes)
            stream.put(chunk)
        stream.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, produce)
        assert await store.put_blob_stream(stream) == set(blobs)
    assert seen_before_last and max(seen_before_last) >= 20 * 5000
    assert len(pack_files(tmp_path)) == 1 and _temp_files(tmp_path) == []
    assert await (await DiskStore.open(tmp_path)).get_blobs(list(blobs)) == blobs


async def test_duplicates_in_a_stream_leave_a_valid_pack(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    blobs = synthetic_blobs(12, 3000, seed=3)
    items = list(blobs.items())
    chunks = [items[:6], items[3:]]  # 3 blobs twice: 15 announced, 12 distinct
    assert await _stream_into(store, chunks, 15) == set(blobs)
    assert len(pack_files(tmp_path)) == 1 and _temp_files(tmp_path) == []
    assert await (await DiskStore.open(tmp_path)).get_blobs(list(blobs)) == blobs


@pytest.mark.parametrize("pack_min", [4, 1000], ids=["pack", "loose"])
async def test_a_failing_producer_fails_the_write_and_leaves_nothing(tmp_path: Path, pack_min: int) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=pack_min)
    blobs = synthetic_blobs(20, 3000, seed=4)
    stream = BlobStream(40)

    def produce() -> None:
        stream.put(list(blobs.items()))
        stream.fail(RuntimeError("the device copy failed"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, produce)
        with pytest.raises(RuntimeError, match="device copy failed"):
            await store.put_blob_stream(stream)
    assert _temp_files(tmp_path) == [] and pack_files(tmp_path) == []


async def test_a_failing_writer_stops_the_producer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    blobs = synthetic_blobs(20, 3000, seed=5)
    real = os.write

    def full(fd: int, data: bytes) -> int:
        if TMP_PREFIX in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(disk_files.os, "write", full)
    stream = BlobStream(len(blobs))
    stream.put(list(blobs.items())[:5])
    with pytest.raises(StoreUnavailable, match="ENOSPC"):
        await store.put_blob_stream(stream)
    with pytest.raises(StreamAbandoned):
        stream.put(list(blobs.items())[5:])
    assert _temp_files(tmp_path) == [] and pack_files(tmp_path) == []


async def test_more_blobs_than_announced_is_refused(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    blobs = synthetic_blobs(10, 3000, seed=6)
    stream = BlobStream(8)
    stream.put(list(blobs.items()))
    with pytest.raises(ValueError, match="announced 8 blobs and was given 10"):
        stream.close()
    with pytest.raises(ValueError, match="announced 8"):
        await store.put_blob_stream(stream)
    assert _temp_files(tmp_path) == [] and pack_files(tmp_path) == []


async def test_the_ram_tier_keeps_what_a_stream_wrote(tmp_path: Path) -> None:
    tiered = TieredStore(await DiskStore.open(tmp_path, pack_min_blobs=4), RamTier(1 << 20))
    blobs = synthetic_blobs(10, 3000, seed=7)
    await _stream_into(tiered, _chunks(blobs, 3), len(blobs))
    assert all(tiered.tier.get(d) == data for d, data in blobs.items())
