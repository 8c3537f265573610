"""Garbage collection racing saves in the same process: a blob that a save pinned at any moment while a
collection ran is never deleted by it, even when that save finished before the collection reached the blob
(found by bench/load_http.py: sessions deleted while others saved left committed manifests naming deleted blobs)."""

from __future__ import annotations

import anyio
from rel_helpers import tiny_snapshot

from kda_sessions.storage import SnapshotStore, open_store


async def test_a_blob_pinned_during_a_collection_survives_it():
    snaps = SnapshotStore(await open_store("memory:"), gc_grace_s=0.0)
    _, other = tiny_snapshot("s_b", 1, fill=2.0)
    m1, blobs1 = tiny_snapshot("s_a", 1, fill=1.0)
    # garbage at the scan: other's blobs (the collection pauses on the first of them, after its pin check) and
    # the blobs s_a's save will reuse
    await snaps.store.put_blobs({d: b for d, b in other.items() if d not in blobs1})
    await snaps.store.put_blobs(blobs1)
    first = (await snaps.store.list_blobs())[0]
    assert first not in blobs1
    in_gc, resume = anyio.Event(), anyio.Event()
    delete = snaps.store.delete_blob

    async def slow_delete(digest: str) -> bool:
        in_gc.set()
        await resume.wait()
        return await delete(digest)

    snaps.store.delete_blob = slow_delete  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(snaps.collect_garbage)
        await in_gc.wait()  # the collection has scanned and is about to delete
        await snaps.save(m1, {}, expected_generation=0)  # reuses the stored blobs, commits, unpins
        resume.set()
    m = await snaps.load_manifest("s_a")
    assert m.blob_digests() <= await snaps.store.has_blobs(m.blob_digests())  # nothing it names was deleted
    await snaps.close()
