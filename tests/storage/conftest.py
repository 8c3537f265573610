"""Fixtures for storage tests: one redis-server per test session, a fresh key prefix per test, and one
`store` fixture parametrized over every backend."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from storage_helpers import open_redis

from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.memory import MemoryStore


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses, so tests share the server without seeing each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}:"


@pytest.fixture(params=["memory", "disk", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BlobStore]:
    """Each backend in turn, empty."""
    s: BlobStore
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "disk":
        s = await DiskStore.open(tmp_path / "store")
    else:
        redis_url = request.getfixturevalue("redis_url")
        s = await open_redis(redis_url, request.getfixturevalue("redis_prefix"), chunk_size=1000)
    try:
        yield s
    finally:
        await s.close()
