"""SnapshotStore: save order, dedup accounting, load checks, garbage collection safety."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from storage_helpers import FINGERPRINT, corrupt, make_snapshot

from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.memory import MemoryStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import (
    BlobNotFound,
    IncompatibleSnapshot,
    IntegrityError,
    ManifestNotFound,
    StoreError,
)
from kda_sessions.storage.snapshot import SnapshotStore


def _size(blobs: dict[str, bytes]) -> int:
    return sum(map(len, blobs.values()))


async def test_save_and_load(store: BlobStore) -> None:
    snaps = SnapshotStore(store)
    m, blobs = make_snapshot("s1", num_tokens=10)
    result = await snaps.save(m, blobs)
    assert result.blobs_written == len(blobs) and result.bytes_written == _size(blobs)
    loaded = await snaps.load_manifest("s1", FINGERPRINT)
    assert loaded == m
    assert await snaps.load_blobs(loaded.blob_digests()) == blobs
    assert await snaps.load_blob(m.tokens_blob) == blobs[m.tokens_blob]
    assert await snaps.list_sessions() == ["s1"]


async def test_forks_share_blobs_and_are_stored_once(store: BlobStore) -> None:
    snaps = SnapshotStore(store)
    prefix = list(range(100, 116))  # 16 tokens = 4 full pages shared by every fork
    parent, parent_blobs = make_snapshot("parent", 16, tokens=prefix)
    await snaps.save(parent, parent_blobs)
    union = dict(parent_blobs)
    manifest_bytes = len(parent.dumps())
    for i in range(8):
        child, child_blobs = make_snapshot(f"fork{i}", 18, tokens=[*prefix, 500 + i, 600 + i])
        result = await snaps.save(child, child_blobs)
        new = {d: b for d, b in child_blobs.items() if d not in union}
        assert result.blobs_written == len(new) and result.blobs_reused == len(child_blobs) - len(new)
        union.update(child_blobs)
        manifest_bytes += len(child.dumps())
    assert await snaps.bytes_stored() == _size(union) + manifest_bytes
    # The 4 prefix pages exist once, not 9 times.
    stats = await snaps.stats()
    assert stats.num_blobs == len(union)


async def test_delete_collects_unshared_blobs_only(store: BlobStore) -> None:
    snaps = SnapshotStore(store, gc_grace_s=0.0)
    a, a_blobs = make_snapshot("a", 10, tokens=list(range(10)))
    b, b_blobs = make_snapshot("b", 10, tokens=[*range(8), 77, 78])  # shares pages 0-1 and cp0 with a
    await snaps.save(a, a_blobs)
    await snaps.save(b, b_blobs)
    shared = set(a_blobs) & set(b_blobs)
    assert shared
    result = await snaps.delete_session("a")
    assert result.blobs_deleted == len(set(a_blobs) - shared)
    assert set(await store.list_blobs()) == set(b_blobs)
    with pytest.raises(ManifestNotFound):
        await snaps.load_manifest("a")
    await snaps.delete_session("b")
    assert await store.list_blobs() == []
    assert await snaps.bytes_stored() == 0


async def test_gc_spares_recent_blobs_within_grace(store: BlobStore) -> None:
    snaps = SnapshotStore(store, gc_grace_s=3600.0)
    m, blobs = make_snapshot("a", 6)
    await snaps.save(m, blobs)
    result = await snaps.delete_session("a")
    assert result.blobs_deleted == 0 and result.blobs_protected == len(blobs)
    assert len(await store.list_blobs()) == len(blobs)


async def test_gc_spares_blobs_of_a_save_in_flight() -> None:
    store = MemoryStore()
    snaps = SnapshotStore(store, gc_grace_s=0.0)
    m, blobs = make_snapshot("late", 6)
    gate = anyio.Event()
    real_put_manifest = store.put_manifest

    async def slow_put_manifest(session_id: str, data: bytes) -> None:
        await gate.wait()  # blobs are written, manifest not yet committed
        await real_put_manifest(session_id, data)

    store.put_manifest = slow_put_manifest  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(snaps.save, m, blobs)
        while len(store._blobs) < len(blobs):
            await anyio.sleep(0.001)
        result = await snaps.collect_garbage()
        assert result.blobs_deleted == 0 and result.blobs_protected == len(blobs)
        gate.set()
    assert (await snaps.load_manifest("late")).blob_digests() == set(blobs)


async def test_gc_skips_everything_if_a_manifest_is_unreadable() -> None:
    store = MemoryStore()
    snaps = SnapshotStore(store, gc_grace_s=0.0)
    m, blobs = make_snapshot("a", 6)
    await snaps.save(m, blobs)
    await store.put_manifest("broken", b"{oops")
    await store.delete_manifest("a")
    assert (await snaps.collect_garbage()).blobs_deleted == 0
    assert len(store._blobs) == len(blobs)


async def test_save_may_omit_blobs_already_stored() -> None:
    snaps = SnapshotStore(MemoryStore())
    m, blobs = make_snapshot("a", 10)
    await snaps.save(m, blobs)
    m2 = m.model_copy(update={"generation": 1})
    assert (await snaps.save(m2, {})).blobs_written == 0
    assert (await snaps.load_manifest("a")).generation == 1


async def test_save_refuses_incomplete_or_extra_blobs() -> None:
    store = MemoryStore()
    snaps = SnapshotStore(store)
    m, blobs = make_snapshot("a", 10)
    missing = dict(blobs)
    missing.pop(m.tokens_blob)
    with pytest.raises(StoreError, match="neither given nor stored"):
        await snaps.save(m, missing)
    assert await store.list_manifests() == []
    _, other = make_snapshot("b", 3, tokens=[9, 9, 9])
    with pytest.raises(ValueError, match="not in its manifest"):
        await snaps.save(m, {**blobs, **other})


async def test_load_checks_fingerprint_and_integrity(store: BlobStore) -> None:
    snaps = SnapshotStore(store)
    m, blobs = make_snapshot("a", 10)
    await snaps.save(m, blobs)
    with pytest.raises(IncompatibleSnapshot, match="page_size"):
        await snaps.load_manifest("a", FINGERPRINT.model_copy(update={"page_size": 16}))
    await store.put_manifest("a", b"{truncated")
    with pytest.raises(IntegrityError):
        await snaps.load_manifest("a")
    await store.put_manifest("b", m.dumps())  # a manifest stored under another session's name
    with pytest.raises(IntegrityError, match="names session"):
        await snaps.load_manifest("b")
    with pytest.raises(BlobNotFound):
        await snaps.load_blob("0" * 64)


async def test_open_by_url_with_ram_tier(tmp_path: Path) -> None:
    async with await SnapshotStore.open(f"disk:{tmp_path}", ram_bytes=1 << 20) as snaps:
        m, blobs = make_snapshot("a", 10)
        await snaps.save(m, blobs)
    async with await SnapshotStore.open(f"disk:{tmp_path}") as again:
        assert (await again.load_manifest("a")) == m


@pytest.mark.parametrize("touched", [True, False], ids=["touched-after-scan", "untouched"])
async def test_gc_spares_a_blob_another_process_touched_after_its_scans(store: BlobStore, touched: bool) -> None:
    """A save in another process (no shared pins) touches a blob it reuses after this collection took its
    `recent_blobs` snapshot and listed the blobs: the fresh check right before the delete must spare it."""
    snaps = SnapshotStore(store, gc_grace_s=0.3)
    data = b"reused page " * 100
    d = digest(data)
    await store.put_blob(d, data)
    await anyio.sleep(0.4)  # older than the grace period, referenced by no manifest: a candidate
    list_blobs = store.list_blobs

    async def list_then_other_process_touches() -> list[str]:
        listed = await list_blobs()
        if touched:
            await store.touch_blobs([d])
        return listed

    store.list_blobs = list_then_other_process_touches  # type: ignore[method-assign]
    result = await snaps.collect_garbage()
    if touched:
        assert result.blobs_deleted == 0 and result.blobs_protected == 1
        assert await store.get_blob(d) == data
    else:
        assert result.blobs_deleted == 1
        assert d not in await store.list_blobs()


async def test_dedup_rewrites_a_corrupt_reused_blob_from_the_savers_copy(store: BlobStore) -> None:
    """Issue 24.6: a second session with the same prefix reuses the first one's blobs; one of them rotted in
    the store. Its save must notice (this process never verified that blob) and write it again, so the
    second session loads; before the fix the save was acknowledged and the session could not be loaded."""
    tokens = list(range(200, 216))
    m1, blobs1 = make_snapshot("first", 16, tokens=tokens)
    await SnapshotStore(store).save(m1, blobs1)
    page = m1.head.pages[0]
    await corrupt(store, page)
    saver = SnapshotStore(store)  # another process: it has verified nothing in the store yet
    m2, blobs2 = make_snapshot("second", 16, tokens=tokens)
    assert page in blobs2
    result = await saver.save(m2, blobs2)
    assert result.blobs_written == 1 and result.blobs_reused == len(m2.blob_digests()) - 1
    reader = SnapshotStore(store)
    loaded = await reader.load_manifest("second", FINGERPRINT)
    assert await reader.load_blobs(loaded.blob_digests()) == blobs2
    # once verified, later saves of this process trust the blob without reading it again
    await corrupt(store, m2.tokens_blob)
    again = await saver.save(m2.model_copy(update={"session_id": "third"}), blobs2)
    assert again.blobs_written == 0


async def test_dedup_verification_reads_through_the_ram_tier(tmp_path: Path) -> None:
    """The RAM tier holds the saver's own good bytes; verification must read what the disk holds."""
    tokens = list(range(300, 308))
    snaps = await SnapshotStore.open(f"disk:{tmp_path}", ram_bytes=1 << 20)
    m1, blobs1 = make_snapshot("first", 8, tokens=tokens)
    await snaps.save(m1, blobs1)
    disk = await DiskStore.open(tmp_path)
    await corrupt(disk, m1.head.state_blob)
    fresh = await SnapshotStore.open(f"disk:{tmp_path}", ram_bytes=1 << 20)
    await fresh.load_blobs([])  # nothing read yet: the tier is empty, the store unverified
    m2, blobs2 = make_snapshot("second", 8, tokens=tokens)
    assert (await fresh.save(m2, blobs2)).blobs_written == 1
    assert await disk.get_blob(m1.head.state_blob) == blobs1[m1.head.state_blob]
    await disk.close()
