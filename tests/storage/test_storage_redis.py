"""Redis backend specifics: chunking, key layout, partial writes, failing fast when unreachable."""

from __future__ import annotations

import time

import pytest
from redis_server import free_port
from storage_helpers import open_redis

from kda_sessions.storage.backends.redis import RedisStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import IntegrityError, StoreUnavailable


@pytest.fixture
async def rstore(redis_url: str, redis_prefix: str):  # type: ignore[no-untyped-def]
    s = await open_redis(redis_url, redis_prefix, chunk_size=100)
    assert isinstance(s, RedisStore)
    yield s
    await s.close()


async def test_key_layout_and_chunks(rstore: RedisStore, redis_prefix: str) -> None:
    data = bytes(range(250))
    d = digest(data)
    await rstore.put_blob(d, data)
    await rstore.put_manifest("abc", b"{}")
    keys = sorted(k.decode() for k in await rstore._r.keys(f"{redis_prefix}*"))
    p = redis_prefix
    assert keys == sorted(
        [
            f"{p}blob:{d}:0",
            f"{p}blob:{d}:1",
            f"{p}blob:{d}:2",
            f"{p}blob:{d}:meta",
            f"{p}blobtimes",
            f"{p}manifest:{{abc}}",
        ]
    )
    assert [len(await rstore._r.get(f"{p}blob:{d}:{i}")) for i in range(3)] == [100, 100, 50]
    assert await rstore.get_blob(d) == data
    assert await rstore.list_blobs() == [d]
    assert (await rstore.stats()).blob_bytes == 250


async def test_chunked_blob_without_meta_is_invisible(rstore: RedisStore) -> None:
    data = bytes(300)
    d = digest(data)
    await rstore._r.set(rstore._chunk_key(d, 0), data[:100])  # a writer that died before the meta key
    assert await rstore.has_blobs([d]) == set()
    assert await rstore.list_blobs() == []
    assert await rstore.put_blob(d, data) is True
    assert await rstore.get_blob(d) == data


async def test_missing_chunk_is_integrity_error(rstore: RedisStore) -> None:
    data = bytes(range(250))
    d = digest(data)
    await rstore.put_blob(d, data)
    await rstore._r.delete(rstore._chunk_key(d, 1))
    with pytest.raises(IntegrityError, match="truncated"):
        await rstore.get_blob(d)


async def test_delete_chunked_removes_every_key(rstore: RedisStore, redis_prefix: str) -> None:
    data = bytes(range(250))
    await rstore.put_blob(digest(data), data)
    assert await rstore.delete_blob(digest(data)) is True
    assert await rstore._r.keys(f"{redis_prefix}blob:*") == []


async def test_prefixes_isolate_stores(rstore: RedisStore, redis_url: str) -> None:
    other = await open_redis(redis_url, "other-prefix:")
    try:
        await rstore.put_blob(digest(b"x"), b"x")
        await rstore.put_manifest("s", b"{}")
        assert await other.list_blobs() == [] and await other.list_manifests() == []
    finally:
        await other.close()


async def test_unreachable_server_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="ping"):
        await RedisStore.open(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    assert time.monotonic() - start < 3.0


async def test_server_gone_mid_use_is_store_unavailable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from redis_server import start_redis_server, stop_redis_server

    port, proc = start_redis_server(tmp_path)
    store = await RedisStore.open(f"redis://127.0.0.1:{port}/0?timeout=1")
    try:
        await store.put_blob(digest(b"x"), b"x")
        stop_redis_server(proc)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.get_blob(digest(b"x"))
        assert time.monotonic() - start < 3.0
    finally:
        stop_redis_server(proc)
        await store.close()


async def test_many_small_blobs_span_several_pipelines(
    rstore: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kda_sessions.storage.backends import redis_io

    monkeypatch.setattr(redis_io, "PIPELINE_BYTES", 64)
    items = {digest(bytes([i]) * 30): bytes([i]) * 30 for i in range(10)}
    assert await rstore.put_blobs(items) == set(items)
    assert await rstore.put_blobs(items) == set()
    assert await rstore.get_blobs(items) == items
