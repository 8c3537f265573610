"""Pack files of the disk store under faults their other tests do not reach: a torn tombstone append, a drop
interrupted between unlinking a pack and its tombstones, a reader whose every re-plan races another
compaction (its batch is planned again until the packs hold still, never an untyped error), and a collection in
another process racing a save that streamed blobs the store held already (the fresh copies protect them)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from storage_helpers import make_snapshot, pack_files, synthetic_blobs

from kda_sessions.storage import BlobStream, SnapshotStore
from kda_sessions.storage.backends import disk_read
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.errors import BlobNotFound, StoreUnavailable


async def test_a_torn_tombstone_does_not_misalign_the_next_ones(tmp_path: Path) -> None:
    """A crash (or a short write) mid-append leaves a tombstone file that is not a whole number of digests: the
    next delete cuts the torn bytes off before appending, so every process reads its tombstone as written."""
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = synthetic_blobs(8, 3000, seed=21)
    keys = list(blobs)
    await store.put_blobs(blobs)
    (pack,) = pack_files(tmp_path)
    dead = pack.with_suffix(".dead")
    await store.delete_blob(keys[0])
    dead.write_bytes(dead.read_bytes() + bytes.fromhex(keys[1])[:10])  # the torn append of a second tombstone
    assert await (await DiskStore.open(tmp_path)).has_blobs(keys[:3]) == set(keys[1:3])  # the torn one ignored
    assert await store.delete_blob(keys[2]) is True
    other = await DiskStore.open(tmp_path)  # another process reads the tombstone file from disk
    assert await other.has_blobs(keys) == set(keys) - {keys[0], keys[2]}
    assert await other.delete_blob(keys[2]) is False
    assert dead.stat().st_size == 64
    assert await other.get_blobs(keys[3:]) == {d: blobs[d] for d in keys[3:]}


async def test_a_drop_interrupted_before_its_tombstones_went_leaves_nothing_behind(tmp_path: Path) -> None:
    """A crash between unlinking a compacted pack and its tombstone file: the next open removes the stray
    tombstones, and a pack later given the same blobs is not affected by them."""
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = synthetic_blobs(4, 3000, seed=22)
    keys = list(blobs)
    await store.put_blobs(blobs)
    (pack,) = pack_files(tmp_path)
    tombstones = b"".join(bytes.fromhex(d) for d in keys)
    for d in keys:
        await store.delete_blob(d)
    assert pack_files(tmp_path) == []
    pack.with_suffix(".dead").write_bytes(tombstones)  # as if the crash came before its unlink
    reopened = await DiskStore.open(tmp_path)
    assert list(pack.parent.glob("*.dead")) == []
    await reopened.put_blobs(blobs)
    assert await (await DiskStore.open(tmp_path)).get_blobs(keys) == blobs


def _compact_elsewhere(root: Path, n: int) -> None:
    """What another process's compaction does to a pack: its blobs are written to a new pack, the old one goes."""
    (old,) = pack_files(root)
    old.with_name(f"pack-{n:x}-moved.pack").write_bytes(old.read_bytes())
    old.unlink()


@pytest.mark.parametrize("into", [False, True], ids=["bytes", "into"])
@pytest.mark.parametrize("moves, ok", [(3, True), (disk_read.PLAN_TRIES, False)], ids=["settles", "never"])
async def test_a_reader_plans_again_while_compactions_race_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, into: bool, moves: int, ok: bool
) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = synthetic_blobs(8, 3000, seed=23)
    await store.put_blobs(blobs)
    reader = await DiskStore.open(tmp_path)
    plans: list[int] = []
    real = disk_read.BlobReader._split

    def split(self: disk_read.BlobReader, keys: list[str]) -> object:
        planned = real(self, keys)
        plans.append(len(plans))
        if len(plans) <= moves:  # the pack this plan names moves before it is read
            _compact_elsewhere(tmp_path, len(plans))
        return planned

    monkeypatch.setattr(disk_read.BlobReader, "_split", split)

    async def read() -> dict[str, bytes]:
        if not into:
            return await reader.get_blobs(list(blobs))
        bufs = {d: memoryview(bytearray(len(b))) for d, b in blobs.items()}
        assert await reader.get_blobs_into([(d, [v]) for d, v in bufs.items()]) == []
        return {d: bytes(v) for d, v in bufs.items()}

    if ok:
        assert await read() == blobs
        assert len(plans) == moves + 1
    else:
        with pytest.raises(StoreUnavailable, match="compacted away"):
            await read()
        assert len(plans) == disk_read.PLAN_TRIES
    monkeypatch.undo()
    assert await reader.get_blobs(list(blobs)) == blobs
    with pytest.raises(BlobNotFound):
        await reader.get_blob(next(iter(synthetic_blobs(1, 10, seed=99))))


async def test_a_collection_spares_blobs_a_racing_save_streamed_again(tmp_path: Path) -> None:
    """Session x's blobs lie unreferenced in an old pack; a save of session a in another process streams the same
    blobs into a fresh pack of its own and commits between the collection's scans and its deletes. The check
    right before the deletes must see the fresh copies (not only the old pack's mtime), or the delete tombstones
    every copy and the acked session a names blobs the store no longer has."""
    writer = await DiskStore.open(tmp_path, pack_min_blobs=2)
    saver = SnapshotStore(writer, gc_grace_s=60)
    mx, bx = make_snapshot("x", 40)
    await saver.save(mx, bx)
    await writer.delete_manifest("x")
    (old,) = pack_files(tmp_path)
    past = time.time() - 3600
    os.utime(old, (past, past))
    collector = await DiskStore.open(tmp_path)  # another process
    ma, ba = make_snapshot("a", 40)
    assert set(ba) == set(bx)
    check = collector.recently_touched

    async def racing(digests: object, within_s: float) -> set[str]:
        stream = BlobStream(len(ba))
        stream.put(list(ba.items()))
        stream.close()
        streamed = await saver.put_stream(stream)
        await saver.save(ma, ba, verified=True, streamed=streamed)
        return await check(digests, within_s)  # type: ignore[arg-type]

    collector.recently_touched = racing  # type: ignore[method-assign]
    result = await SnapshotStore(collector, gc_grace_s=60).collect_garbage()
    assert result.blobs_deleted == 0 and len(pack_files(tmp_path)) == 2
    fresh = SnapshotStore(await DiskStore.open(tmp_path))
    m = await fresh.load_manifest("a")
    assert await fresh.load_blobs(m.blob_digests()) == ba


async def test_a_redundant_fresh_pack_dropped_at_open_leaves_its_blobs_fresh(tmp_path: Path) -> None:
    """A save streamed blobs an old pack holds into a fresh pack and has not committed yet when another process
    opens the store and drops the fresh pack as redundant: the old copies take its mtime, so a collection does
    not see the save's blobs as old."""
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = synthetic_blobs(6, 3000, seed=24)
    keys = list(blobs)
    await store.put_blobs(blobs)
    (old,) = pack_files(tmp_path)
    past = time.time() - 3600
    os.utime(old, (past, past))
    stream = BlobStream(4)
    stream.put([(d, blobs[d]) for d in keys[:4]])
    stream.close()
    await store.put_blob_stream(stream)
    assert len(pack_files(tmp_path)) == 2
    other = await DiskStore.open(tmp_path)
    assert pack_files(tmp_path) == [old]
    assert await other.recently_touched(keys, 60) == set(keys)  # the whole pack looks as new as its newest copy
    assert await other.get_blobs(keys) == blobs
