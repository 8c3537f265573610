"""Builders of realistic snapshots (manifest + blobs) for storage tests."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from kda_sessions.storage.backends.base import BlobStore
from kda_sessions.storage.backends.disk import DiskStore
from kda_sessions.storage.backends.memory import MemoryStore
from kda_sessions.storage.backends.redis import RedisStore
from kda_sessions.storage.blobs import digest, encode_tensor, encode_tensors
from kda_sessions.storage.manifest import CheckpointRecord, ModelFingerprint, SessionManifest

PAGE_SIZE = 4
FINGERPRINT = ModelFingerprint(
    model_id="tiny-random", config_hash="c0ffee", dtype="float32", page_size=PAGE_SIZE
)


def page_blob(tokens: list[int], start: int) -> bytes:
    """A fake MLA KV page whose bytes depend only on the tokens it covers, like a real one."""
    end = min(len(tokens), start + PAGE_SIZE)
    return encode_tensor(torch.tensor(tokens[start:end], dtype=torch.float32).repeat(8))


def make_snapshot(
    session_id: str, num_tokens: int, *, tokens: list[int] | None = None, checkpoint_at: int = 4
) -> tuple[SessionManifest, dict[str, bytes]]:
    """A manifest with a head at `num_tokens` and one checkpoint "cp0", and every blob it references."""
    tokens = tokens if tokens is not None else list(range(100, 100 + num_tokens))
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = digest(data)
        blobs[d] = data
        return d

    def record(name: str, position: int) -> CheckpointRecord:
        pages = [
            add(page_blob(tokens[:position], i * PAGE_SIZE)) for i in range(math.ceil(position / PAGE_SIZE))
        ]
        state = add(encode_tensors({"kda.0": torch.full((2, 3), float(sum(tokens[:position])))}))
        return CheckpointRecord(
            name=name, position=position, state_blob=state, pages=pages, created_at=time.time()
        )

    manifest = SessionManifest(
        session_id=session_id,
        fingerprint=FINGERPRINT,
        tokens_blob=add(encode_tensor(torch.tensor(tokens, dtype=torch.int32))),
        num_tokens=num_tokens,
        head=record("head", num_tokens),
        checkpoints=[record("cp0", min(checkpoint_at, num_tokens))],
        meta={"system": "be brief", "messages": [{"role": "user", "content": "hi"}]},
        saved_at=time.time(),
    )
    return manifest, blobs


async def open_redis(redis_url: str, prefix: str, *, chunk_size: int = 64 * 1024 * 1024) -> RedisStore:
    """A RedisStore on the test server whose keys all live under `prefix`."""
    return await RedisStore.open(f"{redis_url}?prefix={prefix}", chunk_size=chunk_size, timeout_s=2.0)


def synthetic_blobs(n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    """``n`` distinct blobs of ``size`` bytes by digest (deterministic in ``seed``)."""
    out = {}
    for i in range(n):
        b = bytes((seed * 131 + i * 7 + j) % 251 for j in range(size))
        out[digest(b)] = b
    return out


def pack_files(root: Path) -> list[Path]:
    """The pack files of a disk store rooted at ``root``."""
    return sorted((root / "blobs" / "packs").glob("pack-*.pack"))


async def corrupt(store: BlobStore, d: str, *, truncate: bool = False) -> None:
    """Damage a stored blob behind the store's back: flip its first byte, or drop its last one."""
    if isinstance(store, MemoryStore):
        data = store._blobs[d]
        store._blobs[d] = data[:-1] if truncate else bytes([data[0] ^ 1]) + data[1:]
    elif isinstance(store, DiskStore):
        path = store._blob_path(d)
        data = path.read_bytes()
        path.write_bytes(data[:-1] if truncate else bytes([data[0] ^ 1]) + data[1:])
    elif isinstance(store, RedisStore):
        r = store._r
        key = store._blob_key(d)
        if not await r.exists(key):
            key = store._chunk_key(d, 0)
        if truncate:
            await r.set(key, (await r.get(key))[:-1])
        else:
            first = (await r.getrange(key, 0, 0))[0]
            await r.setrange(key, 0, bytes([first ^ 1]))
    else:
        raise TypeError(store)
