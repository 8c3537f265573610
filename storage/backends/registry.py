"""`open_store(url)`: pick and open a backend from a URL; heavy imports happen only for the chosen one."""

from __future__ import annotations

from pathlib import Path

from .base import BlobStore

DEFAULT_STORE_URL = "disk:"


def default_disk_root() -> Path:
    """Where `disk:` with an empty path stores snapshots: the user cache dir of kda_sessions."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kda_sessions")) / "store"


async def open_store(url: str = DEFAULT_STORE_URL) -> BlobStore:
    """Open the store named by `url`.

    - `disk:PATH` — files under PATH (`~` expanded); `disk:` alone uses `default_disk_root()`;
    - `redis://host:port/db[?prefix=kda:&timeout=5]` (or `rediss://`) — fails fast with StoreUnavailable
      if the server does not answer;
    - `memory:` — volatile, this process only.

    Unknown schemes raise ValueError naming the scheme.
    """
    scheme, sep, rest = url.partition(":")
    if not sep:
        raise ValueError(
            f"store url must look like 'disk:PATH', 'redis://host:port/db' or 'memory:', got {url!r}"
        )
    if scheme == "disk":
        from .disk import DiskStore

        return await DiskStore.open(rest if rest else default_disk_root())
    if scheme == "memory":
        if rest:
            raise ValueError(f"memory store url takes no path, got {url!r}")
        from .memory import MemoryStore

        return MemoryStore()
    if scheme in ("redis", "rediss"):
        from .redis import RedisStore

        return await RedisStore.open(url)
    raise ValueError(f"unknown store scheme {scheme!r} in {url!r}; expected disk, redis, rediss or memory")
