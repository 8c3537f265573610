"""Scale-out on a Redis Cluster: 3 primaries started on loopback for the test session (`redis_cluster_url` in
tests/conftest.py). A session saved through one engine resumes through another bit-identically; a session's
manifest, lease and fence keys share one slot (CLUSTER KEYSLOT); blobs, and the chunks of one blob, spread over
slots and nodes; leases, SessionBusy and compare-and-set work across the cluster; listing scans every primary;
the eviction check covers every primary; a cluster that is down is StoreUnavailable, fast."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from redis_server import start_redis_cluster, stop_redis_cluster

import kda_sessions as ks
from kda_sessions.errors import SessionBusy
from kda_sessions.storage.backends.redis import RedisStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import SnapshotConflict, StoreError, StoreUnavailable

PROMPT = list(range(40, 160))  # 120 byte tokens: several KV pages of 16
N, M = 12, 10


@pytest.fixture
def cluster_url(redis_cluster_url: str) -> str:
    """The session's cluster under a key prefix of this test's own."""
    return f"{redis_cluster_url}&prefix=c{uuid.uuid4().hex[:10]}:"


@pytest.fixture
async def cstore(cluster_url: str) -> AsyncIterator[RedisStore]:
    s = await RedisStore.open(cluster_url, timeout_s=2.0)
    assert s.cluster
    yield s
    await s.close()


async def keys_by_node(store: RedisStore, pattern: str) -> dict[str, list[str]]:
    """node name -> keys matching `pattern` that live on that primary (SCAN on each node)."""
    out: dict[str, list[str]] = {}
    for node in store._r.get_primaries():
        keys = [k.decode() async for k in store._r.scan_iter(match=pattern, count=1000, target_nodes=node)]
        if keys:
            out[node.name] = keys
    return out


async def test_cluster_session_saved_by_one_engine_resumes_in_another(cluster_url: str, cstore: RedisStore) -> None:
    async with await ks.Engine.open(store="memory:", page_size=16) as ref:
        s = await ref.create_session()
        await s.append(PROMPT)
        first = await s.generate(max_tokens=N, ignore_eos=True)
        want = await s.generate(max_tokens=M, ignore_eos=True)

    async with await ks.Engine.open(store=cluster_url, page_size=16) as a:
        s = await a.create_session()
        await s.append(PROMPT)
        assert (await s.generate(max_tokens=N, ignore_eos=True)).token_ids == first.token_ids
        await s.save()
        async with await ks.Engine.open(store=cluster_url, page_size=16) as b:
            assert s.id in {i.session_id for i in await b.list_sessions()}  # found by a scan of every primary
            r = await b.resume(s.id)
            got = await r.generate(max_tokens=M, ignore_eos=True)
            assert got.token_ids == want.token_ids
            assert got.usage.prefill_tokens == 1  # only the pending last token
            assert got.usage.cached_tokens == len(PROMPT) + N - 1
            with pytest.raises(SessionBusy):  # A's save holds the session's lease in the cluster
                await r.save()

        keys = cstore.session_keys(s.id)  # the same prefix as the engines'
        assert all([await cstore._r.exists(k) for k in keys])  # the lease and fence too: A's save took them
        slots = {await cstore._r.cluster_keyslot(k) for k in keys}
        assert len(slots) == 1, f"manifest, lease and fence of one session in slots {slots}"
        blob_keys = await keys_by_node(cstore, f"{cstore.prefix}blob:*")
        all_blob_keys = [k for node_keys in blob_keys.values() for k in node_keys]
        assert len(all_blob_keys) >= 10
        assert len({await cstore._r.cluster_keyslot(k) for k in all_blob_keys}) > 1
        assert len(blob_keys) >= 2, f"every blob on one node: {list(blob_keys)}"
        print(f"cluster resume: {len(got.token_ids)} tokens equal, usage {got.usage.prefill_tokens} prefilled / "
              f"{got.usage.cached_tokens} cached; session keys in {len(slots)} slot; {len(all_blob_keys)} blob keys "
              f"on {len(blob_keys)} nodes")


async def test_cluster_leases_and_compare_and_set(cluster_url: str) -> None:
    a = await RedisStore.open(cluster_url)
    b = await RedisStore.open(cluster_url)
    sid = f"lease-{uuid.uuid4().hex}"

    def manifest(gen: int, note: str = "") -> bytes:
        return json.dumps({"session_id": sid, "generation": gen, "note": note}).encode()

    try:
        fence = await a.acquire_lease(sid, "owner-a", 5.0)
        with pytest.raises(SessionBusy):
            await b.acquire_lease(sid, "owner-b", 5.0)
        assert await a.acquire_lease(sid, "owner-a", 5.0) == fence  # renewal keeps the token
        await a.commit_manifest(sid, manifest(1), expected_generation=0, owner="owner-a", ttl_s=5.0)
        with pytest.raises(SessionBusy) as busy:
            await b.commit_manifest(sid, manifest(2), expected_generation=1, owner="owner-b", ttl_s=5.0)
        assert not isinstance(busy.value, SnapshotConflict)
        with pytest.raises(SnapshotConflict):  # a stale generation, even from the lease holder
            await a.commit_manifest(sid, manifest(1, "other"), expected_generation=0, owner="owner-a", ttl_s=5.0)
        # the same bytes again (a commit that landed, sent again after its reply was lost): committed again
        await a.commit_manifest(sid, manifest(1), expected_generation=0, owner="owner-a", ttl_s=5.0)
        assert await b.get_manifest(sid) == manifest(1)
        assert await a.release_lease(sid, "owner-a")
        assert await b.acquire_lease(sid, "owner-b", 5.0) > fence
        await b.commit_manifest(sid, manifest(2), expected_generation=1, owner="owner-b", ttl_s=5.0)
        assert await a.get_manifest(sid) == manifest(2)
        # an expired lease is taken over
        assert await b.acquire_lease(sid, "owner-b", 0.05)
        await anyio.sleep(0.1)
        assert await a.acquire_lease(sid, "owner-a", 5.0) > fence
    finally:
        await a.close()
        await b.close()


async def test_cluster_chunked_blob_spreads_and_deletes_across_nodes(cluster_url: str) -> None:
    store = await RedisStore.open(cluster_url + "&chunk_size=1000")
    try:
        data = bytes(range(256)) * 40  # 10,240 bytes: 11 chunks
        d = digest(data)
        small = {digest(bytes([i]) * 500): bytes([i]) * 500 for i in range(12)}
        assert await store.put_blobs({d: data, **small}, max_in_flight=4) == {d, *small}
        chunks = await keys_by_node(store, f"{store.prefix}blob:{d}:*")
        assert sum(map(len, chunks.values())) == 12  # 11 chunks + the meta key
        assert len(chunks) >= 2, f"every chunk on one node: {list(chunks)}"
        print(f"cluster chunks: {sum(map(len, chunks.values())) - 1} chunks + meta on {len(chunks)} nodes")
        assert await store.get_blobs([d, *small]) == {d: data, **small}
        assert await store.has_blobs([d, *small, digest(b"absent")]) == {d, *small}
        assert await store.list_blobs() == sorted([d, *small])
        assert (await store.stats()).blob_bytes == len(data) + 500 * 12
        assert await store.delete_blob(d)
        assert await keys_by_node(store, f"{store.prefix}blob:{d}*") == {}
    finally:
        await store.close()


async def test_cluster_lists_sessions_of_every_primary(cstore: RedisStore) -> None:
    sids = [f"list-{i}" for i in range(12)]
    for sid in sids:
        await cstore.put_manifest(sid, b"{}")
    assert await cstore.list_manifests() == sorted(sids)
    assert len(await keys_by_node(cstore, f"{cstore.prefix}manifest:*")) >= 2


async def test_cluster_eviction_policy_is_checked_on_every_primary(cluster_url: str, cstore: RedisStore) -> None:
    last = cstore._r.get_primaries()[-1]  # not the node the url names
    await cstore._r.config_set("maxmemory-policy", "allkeys-lru", target_nodes=last)
    try:
        with pytest.raises(StoreError, match=f"node {last.name}.*allkeys-lru"):
            await RedisStore.open(cluster_url)
        allowed = await RedisStore.open(cluster_url + "&allow_eviction=1")
        await allowed.close()
    finally:
        await cstore._r.config_set("maxmemory-policy", "noeviction", target_nodes=last)


async def test_cluster_down_is_store_unavailable_fast(tmp_path: Path) -> None:
    ports, procs = start_redis_cluster(tmp_path)
    url = f"redis://127.0.0.1:{ports[0]}?cluster=1&timeout=1"
    store = await RedisStore.open(url)
    try:
        await store.put_manifest("s", b"{}")
        stop_redis_cluster(procs)
        for op in (lambda: store.get_manifest("s"), lambda: store.put_blob(digest(b"x"), b"x")):
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await op()
            assert time.monotonic() - start < 5.0
            print(f"cluster down: StoreUnavailable in {time.monotonic() - start:.2f} s")
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await RedisStore.open(url)
        assert time.monotonic() - start < 5.0
        print(f"cluster down: open is StoreUnavailable in {time.monotonic() - start:.2f} s")
    finally:
        stop_redis_cluster(procs)
        await store.close()


def test_cluster_url_is_validated() -> None:
    with pytest.raises(ValueError, match="database 0"):
        anyio.run(RedisStore.open, "redis://127.0.0.1:1/3?cluster=1")
    with pytest.raises(ValueError, match="brace"):
        anyio.run(RedisStore.open, "redis://127.0.0.1:1?cluster=1&prefix=a{b}:")
