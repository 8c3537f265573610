"""open_store: URL schemes, defaults and errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kda_sessions.storage.backends import default_disk_root, open_store
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.memory import MemoryStore


async def test_memory_and_disk(tmp_path: Path) -> None:
    assert isinstance(await open_store("memory:"), MemoryStore)
    store = await open_store(f"disk:{tmp_path / 'x'}")
    assert isinstance(store, DiskStore) and store.root == tmp_path / "x"
    assert (tmp_path / "x" / "blobs").is_dir()


async def test_empty_disk_path_uses_user_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    root = default_disk_root()
    assert "kda_sessions" in str(root) and str(root).startswith(str(tmp_path))
    store = await open_store("disk:")
    assert isinstance(store, DiskStore) and store.root == root


async def test_redis_url(redis_url: str) -> None:
    store = await open_store(f"{redis_url}?prefix=reg:&timeout=2")
    try:
        assert type(store).__name__ == "RedisStore" and store.prefix == "reg:"  # type: ignore[attr-defined]
    finally:
        await store.close()


@pytest.mark.parametrize("url", ["s3://bucket", "nope", "memory:/x"])
async def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError, match=url.partition(":")[0] if ":" in url else "store url"):
        await open_store(url)


def test_importing_storage_does_not_import_redis() -> None:
    import subprocess

    code = "import kda_sessions.storage, sys; assert 'redis' not in sys.modules, 'redis imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, env=None)
