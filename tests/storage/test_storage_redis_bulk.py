"""The Redis bulk lanes (storage/backends/redis_bulk.py): hand-framed SET and GET agree byte for byte with
redis-py, chunk boundaries, the fallback to redis-py pipelines, RESP3, and a connection that breaks mid-save."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from storage_helpers import FINGERPRINT, make_snapshot, open_redis

from kda_sessions.storage.backends import redis_bulk, redis_io
from kda_sessions.storage.backends.redis import RedisStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import ManifestNotFound, StoreUnavailable
from kda_sessions.storage.snapshot import SnapshotStore

CHUNK = 1000
# Bytes that would break a careless framing (CR, LF, "$", "*", NUL), empty, and lengths around the chunk size.
AWKWARD = [
    b"",
    b"\r\n",
    b"$-1\r\n*2\r\n" * 7,
    bytes(range(256)) * 3,
    os.urandom(CHUNK - 1),
    os.urandom(CHUNK),
    os.urandom(CHUNK + 1),
    os.urandom(2 * CHUNK),
    os.urandom(5 * CHUNK + 17),
]


@pytest.fixture(params=["lanes", "pipelines"])
async def rstore(request: pytest.FixtureRequest, redis_url: str, redis_prefix: str) -> AsyncIterator[RedisStore]:
    """A RedisStore chunking above 1000 bytes, with its bulk lanes, or without (redis-py pipelines only)."""
    s = await open_redis(redis_url, redis_prefix, chunk_size=CHUNK)
    assert s._io.lanes is not None  # a plain TCP url gets lanes
    if request.param == "pipelines":
        s._io.lanes.close()
        s._io.lanes = None
    try:
        yield s
    finally:
        await s.close()


@pytest.mark.parametrize("verified", [False, True], ids=["hashed", "verified"])
async def test_bytes_round_trip_exactly(rstore: RedisStore, verified: bool) -> None:
    blobs = {digest(b): b for b in AWKWARD}
    assert await rstore.put_blobs(blobs, verified=verified) == set(blobs)
    assert await rstore.get_blobs(list(blobs)) == blobs
    for d, data in blobs.items():  # what redis-py itself reads back: the same bytes under the documented keys
        if len(data) <= CHUNK:
            assert await rstore._r.get(rstore._blob_key(d)) == data
        else:
            n = -(-len(data) // CHUNK)
            assert await rstore._r.get(rstore._meta_key(d)) == f"{n} {len(data)}".encode()
            chunks = [await rstore._r.get(rstore._chunk_key(d, i)) for i in range(n)]
            assert [len(c) for c in chunks] == [CHUNK] * (n - 1) + [len(data) - (n - 1) * CHUNK]
            assert b"".join(chunks) == data
    assert await rstore.has_blobs([*blobs, digest(b"absent")]) == set(blobs)
    assert await rstore.put_blobs(blobs, verified=verified) == set()  # NX: nothing rewritten


async def test_lanes_read_what_redis_py_wrote(redis_url: str, redis_prefix: str) -> None:
    blobs = {digest(b): b for b in AWKWARD}
    writer = await open_redis(redis_url, redis_prefix, chunk_size=CHUNK)
    reader = await open_redis(redis_url, redis_prefix, chunk_size=CHUNK)
    try:
        assert writer._io.lanes is not None
        writer._io.lanes.close()
        writer._io.lanes = None
        await writer.put_blobs(blobs)
        assert await reader.get_blobs(list(blobs)) == blobs
    finally:
        await writer.close()
        await reader.close()


async def test_resp3_connections(redis_url: str, redis_prefix: str) -> None:
    s = await RedisStore.open(f"{redis_url}?prefix={redis_prefix}&protocol=3", chunk_size=CHUNK)
    try:
        blobs = {digest(b): b for b in AWKWARD}
        assert await s.put_blobs(blobs) == set(blobs)
        assert await s.get_blobs(list(blobs)) == blobs
        assert await s.has_blobs([digest(b"absent")]) == set()
    finally:
        await s.close()


async def test_redirected_items_go_through_redis_py(rstore: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MOVED / ASK reply (a cluster resharding) is reported per item; the store sends those items again
    through redis-py, which follows redirects. Simulated: every other item comes back redirected."""
    if rstore._io.lanes is None:
        pytest.skip("lanes only")
    real_set, real_get = redis_bulk.Lane.set_many, redis_bulk.Lane.get

    def set_some(self: redis_bulk.Lane, items: Any, batch_bytes: int) -> list[Any]:
        got = real_set(self, items[::2], batch_bytes)
        return [got[i // 2] if i % 2 == 0 else redis_bulk.REDIRECTED for i in range(len(items))]

    def get_some(self: redis_bulk.Lane, keys: Any, digests: Any, batch_bytes: int, where: str) -> list[Any]:
        got = real_get(self, keys[::2], digests[::2], batch_bytes, where)
        return [got[i // 2] if i % 2 == 0 else redis_bulk.REDIRECTED for i in range(len(keys))]

    monkeypatch.setattr(redis_bulk.Lane, "set_many", set_some)
    monkeypatch.setattr(redis_bulk.Lane, "get", get_some)
    blobs = {digest(b): b for b in AWKWARD}
    assert await rstore.put_blobs(blobs) == set(blobs)
    assert await rstore.get_blobs(list(blobs)) == blobs


async def test_connection_broken_mid_save_leaves_no_manifest(
    rstore: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rstore._io.lanes is None:
        pytest.skip("lanes only")
    snaps = SnapshotStore(rstore)
    m, blobs = make_snapshot("s1", num_tokens=40)
    real_send = redis_bulk.Lane.send
    sends = [0]

    def break_after_first(self: redis_bulk.Lane, bufs: list[Any]) -> None:
        sends[0] += 1
        if sends[0] > 1:  # the connection dies in the middle of the next batch's bytes
            real_send(self, bufs[: len(bufs) // 2])
            self.sock.shutdown(2)
        real_send(self, bufs)

    monkeypatch.setattr(redis_io, "PIPELINE_BYTES", 256)  # several batches per lane
    monkeypatch.setattr(redis_bulk.Lane, "send", break_after_first)
    with pytest.raises(StoreUnavailable):
        await snaps.save(m, blobs)
    with pytest.raises(ManifestNotFound):
        await rstore.get_manifest("s1")
    monkeypatch.setattr(redis_bulk.Lane, "send", real_send)
    await snaps.save(m, blobs)  # the broken lane was dropped; a new one works
    loaded = await snaps.load_manifest("s1", FINGERPRINT)
    assert await snaps.load_blobs(loaded.blob_digests()) == blobs


async def test_many_lanes_and_batches(rstore: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_io, "PIPELINE_BYTES", 300)
    monkeypatch.setattr(redis_io, "SAVE_LANES", 3)
    monkeypatch.setattr(redis_io, "LOAD_LANES", 3)
    blobs = {digest(b): b for b in (os.urandom(n) for n in range(0, 4000, 37))}
    assert await rstore.put_blobs(blobs, verified=True) == set(blobs)
    assert await rstore.get_blobs(reversed(list(blobs))) == blobs


async def test_idle_lanes_survive_a_server_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redis_server import start_redis_server, stop_redis_server

    port, proc = start_redis_server(tmp_path)
    store = await RedisStore.open(f"redis://127.0.0.1:{port}/0?timeout=2")
    try:
        blobs = {digest(b): b for b in AWKWARD}
        assert await store.put_blobs(blobs) == set(blobs)  # the lanes are now idle in the pool
        stop_redis_server(proc)
        port, proc = start_redis_server(tmp_path, port=port)
        with contextlib.suppress(RedisConnectionError):  # redis-py's own pool fails once, then reconnects
            await store._r.ping()
        assert await store.put_blobs(blobs) == set(blobs)  # stale lanes replaced; an empty server: all written
        assert await store.get_blobs(list(blobs)) == blobs
    finally:
        stop_redis_server(proc)
        await store.close()
