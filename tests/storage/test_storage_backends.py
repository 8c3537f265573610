"""One behavioural suite run against every backend (memory, disk, redis)."""

from __future__ import annotations

import pytest
from storage_helpers import corrupt

from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.memory import MemoryStore
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import BlobNotFound, IntegrityError, ManifestNotFound

SMALL = b"hello kda"
LARGE = bytes(range(256)) * 20  # 5120 bytes: chunked by the redis fixture (chunk_size=1000)


@pytest.mark.parametrize("data", [SMALL, LARGE, b""], ids=["small", "large", "empty"])
async def test_put_get(store: BlobStore, data: bytes) -> None:
    d = digest(data)
    assert await store.put_blob(d, data) is True
    assert await store.get_blob(d) == data
    assert await store.has_blobs([d, digest(b"other")]) == {d}
    assert await store.list_blobs() == [d]


async def test_put_is_immutable_nx(store: BlobStore) -> None:
    d = digest(LARGE)
    assert await store.put_blob(d, LARGE) is True
    assert await store.put_blob(d, LARGE) is False
    assert await store.get_blob(d) == LARGE
    assert (await store.stats()).blob_bytes == len(LARGE)


async def test_put_with_wrong_digest_is_refused(store: BlobStore) -> None:
    with pytest.raises(IntegrityError):
        await store.put_blob(digest(b"a"), b"b")
    with pytest.raises(ValueError, match="digest"):
        await store.put_blob("../../etc/passwd", b"b")
    assert await store.list_blobs() == []


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["small", "large"])
async def test_put_blobs_checks_digests_unless_the_caller_verified_them(store: BlobStore, data: bytes) -> None:
    wrong = digest(data + b"!")
    with pytest.raises(IntegrityError):
        await store.put_blobs({wrong: data})
    assert await store.list_blobs() == []
    # verified=True: the caller vouches (the engine hashes what it names); the store skips its hash pass on
    # disk and Redis, but a load still verifies, so a lie never comes back as data
    try:
        await store.put_blobs({wrong: data}, verified=True)
    except IntegrityError:
        assert isinstance(store, MemoryStore)  # it checks anyway (not a throughput path)
    else:
        with pytest.raises(IntegrityError, match=wrong):
            await store.get_blob(wrong)
    good = digest(data)
    assert await store.put_blobs({good: data}, verified=True) == {good}
    assert await store.get_blob(good) == data


@pytest.mark.parametrize("truncate", [False, True], ids=["flipped-byte", "truncated"])
@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["small", "large"])
async def test_corrupt_blob_raises_integrity_error(store: BlobStore, data: bytes, truncate: bool) -> None:
    d = digest(data)
    await store.put_blob(d, data)
    await corrupt(store, d, truncate=truncate)
    with pytest.raises(IntegrityError, match=d):
        await store.get_blob(d)


async def test_missing_blob_raises_not_found(store: BlobStore) -> None:
    d = digest(b"never stored")
    with pytest.raises(BlobNotFound, match=d):
        await store.get_blob(d)


async def test_get_and_put_many(store: BlobStore) -> None:
    items = {digest(x): x for x in (SMALL, LARGE, b"third")}
    assert await store.put_blobs(items) == set(items)
    assert await store.put_blobs(items) == set()
    assert await store.get_blobs(list(items)) == items


async def test_delete_blob(store: BlobStore) -> None:
    for data in (SMALL, LARGE):
        await store.put_blob(digest(data), data)
    assert await store.delete_blob(digest(LARGE)) is True
    assert await store.delete_blob(digest(LARGE)) is False
    assert await store.list_blobs() == [digest(SMALL)]
    with pytest.raises(BlobNotFound):
        await store.get_blob(digest(LARGE))
    assert (await store.stats()).blob_bytes == len(SMALL)


async def test_manifests(store: BlobStore) -> None:
    with pytest.raises(ManifestNotFound, match="s-1"):
        await store.get_manifest("s-1")
    await store.put_manifest("s-1", b'{"v": 1}')
    await store.put_manifest("s-1", b'{"v": 2}')  # manifests are replaced, not immutable
    await store.put_manifest("s_2", b"{}")
    assert await store.get_manifest("s-1") == b'{"v": 2}'
    assert sorted(await store.list_manifests()) == ["s-1", "s_2"]
    assert await store.delete_manifest("s-1") is True
    assert await store.delete_manifest("s-1") is False
    assert await store.list_manifests() == ["s_2"]
    stats = await store.stats()
    assert (stats.num_manifests, stats.manifest_bytes) == (1, 2)


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "a" * 129, "sp ace", "{x}"])
async def test_bad_session_ids_are_refused(store: BlobStore, bad: str) -> None:
    with pytest.raises(ValueError, match="session id"):
        await store.put_manifest(bad, b"{}")


async def test_touch_and_recent(store: BlobStore) -> None:
    d = digest(SMALL)
    await store.put_blob(d, SMALL)
    assert d in await store.recent_blobs(60.0)
    await store.touch_blobs([d, digest(b"absent")])
    assert await store.recent_blobs(60.0) >= {d}
    assert digest(b"absent") not in await store.recent_blobs(60.0)


async def test_bytes_stored_counts_blobs_and_manifests(store: BlobStore) -> None:
    await store.put_blob(digest(LARGE), LARGE)
    await store.put_manifest("s", b"0123456789")
    assert await store.bytes_stored() == len(LARGE) + 10


async def test_verify_blobs_names_every_corrupt_or_missing_blob(store: BlobStore) -> None:
    blobs = {digest(b): b for b in (SMALL, LARGE, b"third blob", b"fourth blob")}
    for d, data in blobs.items():
        await store.put_blob(d, data)
    assert await store.verify_blobs(blobs) == set()
    small, large = digest(SMALL), digest(LARGE)
    await corrupt(store, small)
    await corrupt(store, large, truncate=True)
    absent = digest(b"never stored")
    assert await store.verify_blobs([*blobs, absent]) == {small, large, absent}
