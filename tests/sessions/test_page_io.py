"""Bulk page codec (sessions/page_io): the same blobs as the one-page encoder, so stored snapshots keep loading;
restores write the pool exactly, from memory and from disk (loose and packed); a foreign page blob is refused by
name."""

from __future__ import annotations

import pytest
import torch

import kda_sessions as ks
from kda_sessions.sessions import page_io
from kda_sessions.sessions.codec import blob, encode_page
from kda_sessions.storage import BlobNotFound, SnapshotStore, digest, encode_tensor
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.registry import open_store


@pytest.mark.parametrize("store", ["memory", "disk"])
async def test_bulk_encode_matches_one_page_encoder_and_restore_round_trips(monkeypatch, tmp_path, store):
    monkeypatch.setattr(page_io, "CHUNK_BYTES", 1)  # one page a chunk: the chunk loop runs many times
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session()
        await s.append([(i * 13) % 250 for i in range(5 * 16 + 3)])  # 5 full pages + a partial one
        full = s.state.pages[:5]
        codec = page_io.PageCodec(eng.pools, eng.model.config, eng.model.dtype)
        got = codec.encode(full)
        assert got == [blob(encode_page(eng.pools, p, 16)) for p in full]
        L, P, C = codec.shape
        foreign = encode_tensor(torch.zeros(L, P, C, dtype=torch.bfloat16))  # another model's dtype
        short = encode_tensor(torch.zeros(L, P - 1, C, dtype=eng.model.dtype))  # a partial page
        # as long as a page blob, another header: found by the header check, not by the size
        reshaped = encode_tensor(torch.zeros(1, L * P, C, dtype=eng.model.dtype))
        assert len(reshaped) == len(got[0][1]) and reshaped[:60] != got[0][1][:60]
        extra = {digest(foreign): foreign, digest(short): short, digest(reshaped): reshaped}
        # loose files and a pack: the disk store reads either straight into the pool
        backend = await (open_store("memory:") if store == "memory" else DiskStore.open(tmp_path, pack_min_blobs=3))
        snapshots = SnapshotStore(backend)
        await snapshots.store.put_blobs(dict(got))
        await snapshots.store.put_blobs(extra)
        fresh = eng.pages.alloc(5)
        await codec.restore(snapshots, fresh[::-1], [d for d, _ in got][::-1], "test")
        for kv in eng.pools.kv:
            assert torch.equal(kv[fresh], kv[full])
        with pytest.raises(ks.IncompatibleSnapshot, match="KV page"):
            await codec.restore(snapshots, fresh[:2], [got[0][0], digest(foreign)], "session 'x'")
        with pytest.raises(ks.IncompatibleSnapshot, match="KV page"):
            await codec.restore(snapshots, fresh[:1], [digest(short)], "session 'x'")
        with pytest.raises(ks.IncompatibleSnapshot, match="KV page"):
            await codec.restore(snapshots, fresh[:2], [got[1][0], digest(reshaped)], "session 'x'")
        with pytest.raises(BlobNotFound):
            await codec.restore(snapshots, fresh[:1], ["0" * 64], "session 'x'")
        await snapshots.close()


@pytest.mark.parametrize("staged", [False, True], ids=["from-pool", "staged"])
async def test_blobs_hold_while_copy_threads_lag_behind_the_staging(monkeypatch, staged):
    """Copy threads read their source through raw addresses (on CUDA each chunk's pinned buffer): it must live
    until every blob of the chunk is joined and hashed, however slow the threads are, while the next chunks are
    staged (a freed buffer reused by the next chunk gave wrong blobs). Join and hash are both slowed."""
    import hashlib
    import time

    monkeypatch.setattr(page_io, "CHUNK_BYTES", 1)  # one page a chunk: sources are freed and reallocated often
    real_join, real_digest = page_io.join, page_io.digest

    def slow_join(header: bytes, parts: list[tuple[int, int]]) -> bytes:
        time.sleep(0.02)  # the next chunks are staged meanwhile
        return real_join(header, parts)

    def slow_digest(data: bytes) -> str:
        time.sleep(0.02)
        return real_digest(data)

    monkeypatch.setattr(page_io, "join", slow_join)
    monkeypatch.setattr(page_io, "digest", slow_digest)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session()
        await s.append([(i * 7) % 250 for i in range(12 * 16)])
        codec = page_io.PageCodec(eng.pools, eng.model.config, eng.model.dtype)
        codec.staged = staged  # CUDA's path on the CPU: a host buffer per chunk, freed once its blobs are made
        pages = s.state.pages[:12]
        got = codec.encode(pages)
        assert [data for _, data in got] == [encode_page(eng.pools, p, 16) for p in pages]
    assert [d for d, _ in got] == [hashlib.sha256(data).hexdigest() for _, data in got]


async def test_a_consumer_that_stops_early_leaves_no_job_running(monkeypatch):
    """Closing the chunk generator after one chunk waits for the jobs already queued (they read the source
    through raw addresses): none runs after close returns, and no chunk beyond the next was staged."""
    import time

    monkeypatch.setattr(page_io, "CHUNK_BYTES", 1)
    real_join = page_io.join
    ended = []

    def slow_join(header: bytes, parts: list[tuple[int, int]]) -> bytes:
        time.sleep(0.01)
        ended.append(time.monotonic())
        return real_join(header, parts)

    monkeypatch.setattr(page_io, "join", slow_join)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session()
        await s.append([(i * 5) % 250 for i in range(40 * 16)])
        codec = page_io.PageCodec(eng.pools, eng.model.config, eng.model.dtype)
        chunks = codec.encode_chunks(s.state.pages[:40])
        assert len(next(chunks)) == 1
        chunks.close()
        closed = time.monotonic()
        time.sleep(0.05)
    assert ended and max(ended) <= closed
    assert len(ended) <= 2  # only the yielded chunk and the one staged behind it were ever queued
