"""Store backends behind one ABC (`BlobStore`) and a URL registry (`open_store`).

`disk` and `memory` import nothing heavy; `redis` imports redis.asyncio only when a redis:// url is opened.
"""

from .base import BlobStore, StoreStats, check_session_id
from .registry import DEFAULT_STORE_URL, default_disk_root, open_store

__all__ = [
    "DEFAULT_STORE_URL",
    "BlobStore",
    "StoreStats",
    "check_session_id",
    "default_disk_root",
    "open_store",
]
