"""`get_blobs_into`: blobs read straight into the caller's buffers, verified, on every backend (disk loose and
packed, memory, Redis, and through the RAM tier); a size that is not the buffers' total is reported, not written;
a corrupt blob is an IntegrityError, a missing one BlobNotFound; Redis's bulk lanes receive into the buffers."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from storage_helpers import corrupt, open_redis, synthetic_blobs

from kda_sessions.storage import BlobNotFound, IntegrityError
from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.redis import RedisStore
from kda_sessions.storage.tier import RamTier, TieredStore


def _targets(blobs: dict[str, bytes], parts: int = 3) -> list[tuple[str, list[memoryview]]]:
    """Each blob split over ``parts`` buffers of unequal sizes (the last takes the rest)."""
    targets = []
    for d, data in blobs.items():
        cuts = [*[0, 7, len(data) // 2][:parts], len(data)]
        targets.append((d, [memoryview(bytearray(b - a)) for a, b in itertools.pairwise(cuts)]))
    return targets


async def _round_trip(store: BlobStore) -> None:
    blobs = synthetic_blobs(6, 20_000, seed=3)
    await store.put_blobs(blobs)
    targets = _targets(blobs)
    targets.append(targets[0])  # the same blob twice is read twice
    assert await store.get_blobs_into(targets) == []
    for d, views in targets:
        assert b"".join(bytes(v) for v in views) == blobs[d]
    wrong = [(targets[1][0], [memoryview(bytearray(len(blobs[targets[1][0]]) - 1))]), targets[2]]
    assert await store.get_blobs_into(wrong) == [0]
    assert bytes(wrong[0][1][0]) == bytes(len(blobs[targets[1][0]]) - 1)  # nothing written there
    with pytest.raises(BlobNotFound):
        await store.get_blobs_into([("0" * 64, [memoryview(bytearray(4))])])
    await corrupt(store, targets[3][0])
    with pytest.raises(IntegrityError):
        await store.get_blobs_into(targets[3:4])


async def test_every_backend_reads_into_buffers(store: BlobStore) -> None:
    await _round_trip(store)


@pytest.mark.parametrize("pack_min_blobs", [1, 100], ids=["packed", "loose"])
async def test_disk_reads_into_buffers_packed_and_loose(tmp_path: Path, pack_min_blobs: int) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=pack_min_blobs)
    blobs = synthetic_blobs(40, 9_000, seed=1)
    await store.put_blobs(blobs)
    targets = _targets(blobs, parts=2)
    assert await store.get_blobs_into(targets, max_in_flight=4) == []
    assert [b"".join(bytes(v) for v in views) for _, views in targets] == list(blobs.values())
    if pack_min_blobs == 1:
        pack = next((tmp_path / "blobs" / "packs").glob("pack-*.pack"))
        raw = bytearray(pack.read_bytes())
        raw[-5] ^= 1  # in the last blob's bytes
        pack.write_bytes(bytes(raw))
        with pytest.raises(IntegrityError):
            await (await DiskStore.open(tmp_path)).get_blobs_into(targets)


async def test_ram_tier_serves_hits_and_reads_misses_through(tmp_path: Path) -> None:
    disk = await DiskStore.open(tmp_path)
    blobs = synthetic_blobs(4, 5_000, seed=2)
    await disk.put_blobs(blobs)
    tiered = TieredStore(disk, RamTier(1 << 20))
    first = dict(list(blobs.items())[:2])
    await tiered.get_blobs(list(first))  # now cached
    targets = _targets(blobs)
    targets[3] = (targets[3][0], [memoryview(bytearray(3))])  # a miss of the wrong size
    targets[0] = (targets[0][0], [memoryview(bytearray(2))])  # a hit of the wrong size
    assert await tiered.get_blobs_into(targets) == [0, 3]
    for d, views in targets[1:3]:
        assert b"".join(bytes(v) for v in views) == blobs[d]
    assert tiered.tier.hits >= 2


async def test_redis_lanes_receive_into_the_buffers(redis_url: str, redis_prefix: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Values of one key each are received straight into the buffers by the bulk lanes (never as bytes through
    `get_blobs`); a chunked blob among them still takes the default path."""
    store = await open_redis(redis_url, redis_prefix, chunk_size=50_000)
    try:
        assert store._io.lanes is not None
        blobs = synthetic_blobs(30, 20_000, seed=5)
        big = synthetic_blobs(1, 120_000, seed=6)  # stored in 3 chunks
        await store.put_blobs(blobs | big)
        fetched: list[str] = []
        real_get_blobs = RedisStore.get_blobs

        async def get_blobs(self, digests, **kw):  # type: ignore[no-untyped-def]
            fetched.extend(digests)
            return await real_get_blobs(self, digests, **kw)

        monkeypatch.setattr(RedisStore, "get_blobs", get_blobs)
        targets = _targets(blobs | big)
        wrong = (targets[4][0], [memoryview(bytearray(100))])
        assert await store.get_blobs_into([*targets, wrong], max_in_flight=4) == [len(targets)]
        assert [b"".join(bytes(v) for v in views) for _, views in targets] == list((blobs | big).values())
        assert bytes(wrong[1][0]) == bytes(100)
        assert fetched == list(big)  # only the chunked blob went through get_blobs
        await corrupt(store, targets[7][0])
        with pytest.raises(IntegrityError):
            await store.get_blobs_into(targets[5:10])
        assert await store.get_blobs_into(targets[:3]) == []  # the lanes are fine after the error
        with pytest.raises(BlobNotFound):
            await store.get_blobs_into([("0" * 64, [memoryview(bytearray(4))])])
    finally:
        await store.close()


def test_bundle_layout_locates_each_tensor_as_decode_tensors_reads_it() -> None:
    import torch

    from kda_sessions.storage.blobs import bundle_layout, decode_tensors, encode_tensors

    tensors = {"kda": torch.randn(2, 3, 4), "conv": torch.randn(2, 5).to(torch.bfloat16)}
    data = encode_tensors(tensors)
    offset, entries = bundle_layout(data)
    assert set(entries) == {"kda", "conv"}
    decoded = decode_tensors(data)
    for name, (dtype, shape, begin, end) in entries.items():
        assert (dtype, shape) == (tensors[name].dtype, list(tensors[name].shape))
        got = torch.frombuffer(bytearray(data[offset + begin : offset + end]), dtype=dtype).view(shape)
        assert torch.equal(got, decoded[name]) and torch.equal(got, tensors[name])
    with pytest.raises(IntegrityError):
        bundle_layout(data[:-1])  # the tensors no longer cover the payload
