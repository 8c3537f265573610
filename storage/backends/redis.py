"""`redis://host:port/db[?prefix=kda:]` — a shared store in Redis through `redis.asyncio`.

Keys, all under one prefix (default `kda:`)::

    kda:blob:<digest>            a blob of at most `chunk_size` bytes, written with SET NX (immutable)
    kda:blob:<digest>:<i>        chunk i of a larger blob (chunks of at most 64 MiB)
    kda:blob:<digest>:meta       "<chunks> <total bytes>" of a chunked blob, written LAST with SET NX, so a
                                 partially written chunked blob is never visible as a blob
    kda:blobtimes                sorted set digest -> last write/touch time (the GC grace period)
    kda:manifest:{<session>}     a session's manifest; the braces are a cluster hash tag, so a later lease
                                 key `kda:lease:{<session>}` lands in the same slot

Connection errors and timeouts become StoreUnavailable; the timeouts are short so an unreachable server
fails fast.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..blobs import is_digest
from ..errors import BlobNotFound, IntegrityError, ManifestNotFound, StoreUnavailable
from .base import BlobStore, StoreStats, check_digest, check_session_id, verify_blob

DEFAULT_PREFIX = "kda:"
MAX_CHUNK_BYTES = 64 * 1024 * 1024
PIPELINE_BYTES = 64 * 1024 * 1024
"""Roughly how many value bytes one pipeline carries, bounding the client's send buffer."""
DEFAULT_TIMEOUT_S = 5.0
_TIMES_RETENTION_S = 24 * 3600.0
_T = TypeVar("_T")


def _batches(digests: list[str], blobs: Mapping[str, bytes], max_bytes: int) -> Iterator[list[str]]:
    """Split `digests` into runs whose blobs total at most `max_bytes` (a single larger blob goes alone)."""
    batch: list[str] = []
    size = 0
    for d in digests:
        if batch and size + len(blobs[d]) > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(d)
        size += len(blobs[d])
    if batch:
        yield batch


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore(BlobStore):
    """Blobs and manifests in one Redis database, under one key prefix; see the module docstring."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        chunk_size: int = MAX_CHUNK_BYTES,
        url: str = "redis://",
    ) -> None:
        """Wrap a client created with `decode_responses=False`; prefer `RedisStore.open(url)`."""
        if not 0 < chunk_size <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK_BYTES}], got {chunk_size}")
        self._r = client
        self.prefix = prefix
        self.chunk_size = chunk_size
        self.url = url

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_size: int = MAX_CHUNK_BYTES,
        ping: bool = True,
    ) -> RedisStore:
        """Connect to `url` (`redis://` or `rediss://`); the query may set `prefix`, `timeout` (seconds) and
        `chunk_size`. With `ping`, an unreachable server raises StoreUnavailable here, within ~`timeout_s`."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("prefix", DEFAULT_PREFIX)
        timeout_s = float(query.pop("timeout", timeout_s))
        chunk_size = int(query.pop("chunk_size", chunk_size))
        client_url = urlunsplit(parts._replace(query=urlencode(query)))
        client = aioredis.Redis.from_url(
            client_url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            decode_responses=False,
            retry_on_timeout=False,
        )
        store = cls(client, prefix=prefix, chunk_size=chunk_size, url=url)
        if ping:
            try:
                await store._call("ping", lambda: client.ping())
            except BaseException:
                await client.aclose()
                raise
        return store

    # --- keys and error mapping --------------------------------------------------------------------------

    def _blob_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}"

    def _chunk_key(self, digest: str, i: int) -> str:
        return f"{self.prefix}blob:{digest}:{i}"

    def _meta_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}:meta"

    def _manifest_key(self, session_id: str) -> str:
        return f"{self.prefix}manifest:{{{check_session_id(session_id)}}}"

    @property
    def _times_key(self) -> str:
        return f"{self.prefix}blobtimes"

    async def _call(self, op: str, fn: Callable[[], Awaitable[_T]]) -> _T:
        try:
            return await fn()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"{self.url}: {op} failed: {type(e).__name__}: {e}") from e
        except RedisError as e:
            raise StoreUnavailable(f"{self.url}: {op} failed: redis error: {e}") from e

    async def _scan(self, pattern: str) -> list[bytes]:
        async def scan() -> list[bytes]:
            return [k async for k in self._r.scan_iter(match=pattern, count=1000)]

        return await self._call(f"scan {pattern}", scan)

    @asynccontextmanager
    async def _pipeline(self) -> AsyncIterator[Any]:
        async with self._r.pipeline(transaction=False) as pipe:
            yield pipe

    # --- blobs -------------------------------------------------------------------------------------------

    async def put_blob(self, digest: str, data: bytes) -> bool:
        return digest in await self.put_blobs({digest: data})

    async def put_blobs(self, blobs: Mapping[str, bytes], *, max_in_flight: int = 8) -> set[str]:
        """Small blobs go in pipelines of SET NX (about `PIPELINE_BYTES` each); large ones chunk by chunk,
        meta key last. `max_in_flight` is unused: pipelining already bounds round trips."""
        for d, data in blobs.items():
            await verify_blob(check_digest(d), data, where=f"put into {self.url}")
        written: set[str] = set()
        if blobs:
            now = time.time()
            await self._call("touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(blobs, now)))
        small = [d for d, data in blobs.items() if len(data) <= self.chunk_size]
        for batch in _batches(small, blobs, PIPELINE_BYTES):

            async def put_batch(batch: list[str] = batch) -> list[Any]:
                async with self._pipeline() as pipe:
                    for d in batch:
                        pipe.set(self._blob_key(d), blobs[d], nx=True)
                    return list(await pipe.execute())

            results = await self._call("put blobs", put_batch)
            written.update(d for d, ok in zip(batch, results, strict=True) if ok)
        for d, data in blobs.items():
            if len(data) > self.chunk_size and await self._put_chunked(d, data):
                written.add(d)
        return written

    async def _put_chunked(self, digest: str, data: bytes) -> bool:
        if await self._call("exists", lambda: self._r.exists(self._meta_key(digest))):
            return False
        view = memoryview(data)
        n = -(-len(view) // self.chunk_size)

        async def write() -> bool:
            # A few chunks per pipeline bounds the client's buffer while keeping round trips few.
            for start in range(0, n, 4):
                async with self._pipeline() as pipe:
                    for i in range(start, min(n, start + 4)):
                        pipe.set(
                            self._chunk_key(digest, i), view[i * self.chunk_size : (i + 1) * self.chunk_size]
                        )
                    await pipe.execute()
            return bool(await self._r.set(self._meta_key(digest), f"{n} {len(view)}", nx=True))

        return await self._call(f"put chunked blob {digest}", write)

    async def get_blob(self, digest: str) -> bytes:
        return (await self.get_blobs([digest]))[digest]

    async def get_blobs(self, digests: Iterable[str], *, max_in_flight: int = 8) -> dict[str, bytes]:
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]

        async def fetch() -> list[Any]:
            async with self._pipeline() as pipe:
                for d in wanted:
                    pipe.get(self._blob_key(d))
                    pipe.get(self._meta_key(d))
                return list(await pipe.execute())

        results = await self._call("get blobs", fetch)
        out: dict[str, bytes] = {}
        for i, d in enumerate(wanted):
            data, meta = results[2 * i], results[2 * i + 1]
            if data is None and meta is None:
                raise BlobNotFound(d)
            if data is None:
                data = await self._get_chunked(d, meta)
            await verify_blob(d, data, where=self.url)
            out[d] = bytes(data)
        return out

    async def _get_chunked(self, digest: str, meta: bytes) -> bytes:
        try:
            n_str, total_str = meta.decode().split()
            n, total = int(n_str), int(total_str)
        except (UnicodeDecodeError, ValueError) as e:
            raise IntegrityError(f"{self.url}: blob {digest} has a bad chunk record {meta[:64]!r}") from e

        async def fetch() -> list[Any]:
            async with self._pipeline() as pipe:
                for i in range(n):
                    pipe.get(self._chunk_key(digest, i))
                return list(await pipe.execute())

        chunks = await self._call(f"get chunked blob {digest}", fetch)
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise IntegrityError(
                f"{self.url}: blob {digest} is truncated: chunks {missing[:8]} of {n} missing"
            )
        data = b"".join(chunks)
        if len(data) != total:
            raise IntegrityError(
                f"{self.url}: blob {digest} has {len(data)} bytes in chunks, expected {total}"
            )
        return data

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]

        async def check() -> list[Any]:
            async with self._pipeline() as pipe:
                for d in wanted:
                    pipe.exists(self._blob_key(d), self._meta_key(d))
                return list(await pipe.execute())

        return {d for d, n in zip(wanted, await self._call("has blobs", check), strict=True) if n}

    async def delete_blob(self, digest: str) -> bool:
        check_digest(digest)

        async def delete() -> bool:
            meta = await self._r.get(self._meta_key(digest))
            # The meta key goes first so the blob is never visible with chunks missing.
            existed = await self._r.delete(self._blob_key(digest), self._meta_key(digest))
            if meta is not None:
                n = int(meta.split()[0])
                for start in range(0, n, 256):
                    await self._r.delete(
                        *(self._chunk_key(digest, i) for i in range(start, min(n, start + 256)))
                    )
            await self._r.zrem(self._times_key, digest)
            return bool(existed)

        return await self._call(f"delete blob {digest}", delete)

    async def list_blobs(self) -> list[str]:
        skip = len(self.prefix) + len("blob:")
        names = {k.decode()[skip:] for k in await self._scan(f"{_glob_escape(self.prefix)}blob:*")}
        out = {n for n in names if is_digest(n)}
        out.update(n[:-5] for n in names if n.endswith(":meta") and is_digest(n[:-5]))
        return sorted(out)

    async def touch_blobs(self, digests: Iterable[str]) -> None:
        present = await self.has_blobs(digests)
        if present:
            now = time.time()
            await self._call(
                "touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(present, now))
            )

    async def recent_blobs(self, within_s: float) -> set[str]:
        now = time.time()

        async def recent() -> list[Any]:
            async with self._pipeline() as pipe:
                pipe.zremrangebyscore(self._times_key, "-inf", now - max(within_s, _TIMES_RETENTION_S))
                pipe.zrangebyscore(self._times_key, now - within_s, "+inf")
                return list(await pipe.execute())

        return {m.decode() for m in (await self._call("recent blobs", recent))[1]}

    # --- manifests ---------------------------------------------------------------------------------------

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        key = self._manifest_key(session_id)
        await self._call(f"put manifest {session_id}", lambda: self._r.set(key, data))

    async def get_manifest(self, session_id: str) -> bytes:
        key = self._manifest_key(session_id)
        data = await self._call(f"get manifest {session_id}", lambda: self._r.get(key))
        if not isinstance(data, bytes):  # None: absent (the client never decodes responses)
            raise ManifestNotFound(session_id)
        return data

    async def list_manifests(self) -> list[str]:
        keys = await self._scan(f"{_glob_escape(self.prefix)}manifest:{{*}}")
        skip = len(self.prefix) + len("manifest:{")
        return sorted(k.decode()[skip:-1] for k in keys)

    async def delete_manifest(self, session_id: str) -> bool:
        key = self._manifest_key(session_id)
        return bool(await self._call(f"delete manifest {session_id}", lambda: self._r.delete(key)))

    async def stats(self) -> StoreStats:
        blob_keys = [
            k for k in await self._scan(f"{_glob_escape(self.prefix)}blob:*") if not k.endswith(b":meta")
        ]
        manifest_keys = await self._scan(f"{_glob_escape(self.prefix)}manifest:{{*}}")

        async def sizes(keys: list[bytes]) -> list[int]:
            async with self._pipeline() as pipe:
                for k in keys:
                    pipe.strlen(k)
                return [int(n) for n in await pipe.execute()]

        blob_sizes = await self._call("stats", lambda: sizes(blob_keys))
        manifest_sizes = await self._call("stats", lambda: sizes(manifest_keys))
        return StoreStats(
            num_blobs=len(await self.list_blobs()),
            blob_bytes=sum(blob_sizes),
            num_manifests=len(manifest_keys),
            manifest_bytes=sum(manifest_sizes),
        )

    async def close(self) -> None:
        await self._r.aclose()
