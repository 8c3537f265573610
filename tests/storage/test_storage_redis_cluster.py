"""The backend contract of test_storage_backends.py and the snapshot store tests of test_storage_snapshot.py
(save/load, dedup of forks, delete + garbage collection across every primary, fingerprint and integrity checks),
run again on a RedisStore over a 3-node Redis Cluster (`redis_cluster_url` in tests/conftest.py), with small
chunks so that blobs are chunked across nodes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from test_storage_backends import (  # noqa: F401  (collected here again, with the cluster `store` below)
    test_bad_session_ids_are_refused,
    test_bytes_stored_counts_blobs_and_manifests,
    test_corrupt_blob_raises_integrity_error,
    test_delete_blob,
    test_get_and_put_many,
    test_manifests,
    test_missing_blob_raises_not_found,
    test_put_get,
    test_put_is_immutable_nx,
    test_put_with_wrong_digest_is_refused,
    test_touch_and_recent,
)
from test_storage_snapshot import (  # noqa: F401  (the same)
    test_delete_collects_unshared_blobs_only,
    test_forks_share_blobs_and_are_stored_once,
    test_gc_spares_recent_blobs_within_grace,
    test_load_checks_fingerprint_and_integrity,
    test_save_and_load,
)

from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.redis import RedisStore


@pytest.fixture
async def store(redis_cluster_url: str) -> AsyncIterator[BlobStore]:
    """A RedisStore on the cluster, under a prefix of this test's own, chunking blobs above 1000 bytes."""
    s = await RedisStore.open(f"{redis_cluster_url}&prefix=t{uuid.uuid4().hex[:12]}:", chunk_size=1000)
    assert s.cluster
    try:
        yield s
    finally:
        await s.close()
