"""`redis://host:port/db[?prefix=kda:]` — a shared store in Redis through `redis.asyncio`.

Keys, all under one prefix (default `kda:`)::

    kda:blob:<digest>            a blob of at most `chunk_size` bytes, written with SET NX (immutable)
    kda:blob:<digest>:<i>        chunk i of a larger blob (chunks of at most 64 MiB)
    kda:blob:<digest>:meta       "<chunks> <total bytes>" of a chunked blob, written LAST with SET NX, so a
                                 partially written chunked blob is never visible as a blob
    kda:blobtimes                sorted set digest -> last write/touch time (the GC grace period)
    kda:manifest:{<session>}     a session's manifest; the braces are a cluster hash tag, so the two keys
                                 below land in the same slot and one Lua script can touch all three
    kda:lease:{<session>}        "<owner>:<fence>", SET with PX: the session's write lease
    kda:fence:{<session>}        INCR counter of the session's fencing tokens

A manifest is committed by one Lua script that checks the lease and the stored generation (compare-and-set)
and writes the manifest and the lease together. At connect, a server whose `maxmemory-policy` may evict keys
(anything but `noeviction`) is refused (StoreError): an evicted blob is a lost session. `?allow_eviction=1`
overrides this for caches you can afford to lose. `?lease_ttl=SECONDS` sets the lease lifetime.

Connection errors and timeouts become StoreUnavailable; the timeouts are short so an unreachable server
fails fast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import faults
from ..blobs import is_digest
from ..errors import (
    BlobNotFound,
    IntegrityError,
    ManifestNotFound,
    SessionBusy,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)
from .base import DEFAULT_LEASE_TTL_S, BlobStore, StoreStats, check_digest, check_session_id, verify_blob

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kda:"
MAX_CHUNK_BYTES = 64 * 1024 * 1024
PIPELINE_BYTES = 64 * 1024 * 1024
"""Roughly how many value bytes one pipeline carries, bounding the client's send buffer."""
DEFAULT_TIMEOUT_S = 5.0
_TIMES_RETENTION_S = 24 * 3600.0
_T = TypeVar("_T")

# KEYS: lease, fence. ARGV: owner, ttl ms. -> {1, fence} taken or renewed; {0, "<owner>:<fence>"} busy.
_ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ':'
if cur and string.sub(cur, 1, #mine) ~= mine then return {0, cur} end
local fence
if cur then fence = tonumber(string.sub(cur, #mine + 1)) else fence = redis.call('INCR', KEYS[2]) end
redis.call('SET', KEYS[1], mine .. fence, 'PX', ARGV[2])
return {1, fence}
"""

# KEYS: lease, owner. -> 1 released, 0 not ours.
_RELEASE_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: manifest, lease, fence. ARGV: data, expected generation, owner, ttl ms.
# -> {1, fence} committed; {0, holder} lease busy; {-1, stored generation or "unreadable"} conflict.
_COMMIT_LUA = """
local cur = redis.call('GET', KEYS[2])
local mine = ARGV[3] .. ':'
if cur and string.sub(cur, 1, #mine) ~= mine then return {0, cur} end
local old = redis.call('GET', KEYS[1])
local gen = 0
if old then
  local ok, doc = pcall(cjson.decode, old)
  if not ok or type(doc) ~= 'table' or type(doc.generation) ~= 'number' then return {-1, 'unreadable'} end
  gen = doc.generation
end
if gen ~= tonumber(ARGV[2]) then return {-1, tostring(gen)} end
local fence
if cur then fence = tonumber(string.sub(cur, #mine + 1)) else fence = redis.call('INCR', KEYS[3]) end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], mine .. fence, 'PX', ARGV[4])
return {1, fence}
"""


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
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._commit = client.register_script(_COMMIT_LUA)

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
        `chunk_size`, `lease_ttl` (seconds) and `allow_eviction=1`. With `ping`, an unreachable server raises
        StoreUnavailable here, within ~`timeout_s`, and a server that may evict keys raises StoreError."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("prefix", DEFAULT_PREFIX)
        timeout_s = float(query.pop("timeout", timeout_s))
        chunk_size = int(query.pop("chunk_size", chunk_size))
        lease_ttl_s = float(query.pop("lease_ttl", DEFAULT_LEASE_TTL_S))
        allow_eviction = query.pop("allow_eviction", "0").lower() in ("1", "true", "yes")
        client_url = urlunsplit(parts._replace(query=urlencode(query)))
        client = aioredis.Redis.from_url(
            client_url,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            decode_responses=False,
            retry_on_timeout=False,
        )
        store = cls(client, prefix=prefix, chunk_size=chunk_size, url=url)
        store.lease_ttl_s = lease_ttl_s
        if ping:
            try:
                await store._call("ping", lambda: client.ping())
                await store._check_eviction(allow_eviction)
            except BaseException:
                await client.aclose()
                raise
        return store

    async def _check_eviction(self, allow: bool) -> None:
        try:
            reply: dict[Any, Any] = await self._r.config_get("maxmemory-policy")
        except ResponseError as e:  # CONFIG renamed or disabled (managed Redis): cannot check
            logger.warning("%s: cannot read maxmemory-policy (%s); make sure it is noeviction", self.url, e)
            return
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"{self.url}: config get failed: {e}") from e
        raw = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy", b"noeviction"))
        policy = raw.decode() if isinstance(raw, bytes) else str(raw)
        if policy == "noeviction":
            return
        if not allow:
            raise StoreError(
                f"{self.url}: maxmemory-policy is {policy!r}, so Redis may evict stored sessions; set it to "
                f"noeviction, or add ?allow_eviction=1 to the store url to accept losing sessions"
            )
        logger.warning("%s: maxmemory-policy is %r; sessions may be evicted (allowed by the url)", self.url, policy)

    # --- keys and error mapping --------------------------------------------------------------------------

    def _blob_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}"

    def _chunk_key(self, digest: str, i: int) -> str:
        return f"{self.prefix}blob:{digest}:{i}"

    def _meta_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}:meta"

    def _manifest_key(self, session_id: str) -> str:
        return f"{self.prefix}manifest:{{{check_session_id(session_id)}}}"

    def _lease_key(self, session_id: str) -> str:
        return f"{self.prefix}lease:{{{check_session_id(session_id)}}}"

    def _fence_key(self, session_id: str) -> str:
        return f"{self.prefix}fence:{{{check_session_id(session_id)}}}"

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
            faults.point("redis.blobs.sent")
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

    # --- leases ------------------------------------------------------------------------------------------

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        keys = [self._lease_key(session_id), self._fence_key(session_id)]
        ok, value = await self._call(
            f"lease {session_id}", lambda: self._acquire(keys=keys, args=[owner, max(1, int(ttl_s * 1000))])
        )
        if not ok:
            raise SessionBusy(f"session {session_id!r} is held by another writer (lease {value.decode()!r})")
        return int(value)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        key = self._lease_key(session_id)
        return bool(await self._call(f"release lease {session_id}", lambda: self._release(keys=[key], args=[owner])))

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        keys = [self._manifest_key(session_id), self._lease_key(session_id), self._fence_key(session_id)]
        args: list[Any] = [data, expected_generation, owner, max(1, int(ttl_s * 1000))]
        faults.point("redis.manifest.before")
        ok, value = await self._call(f"commit manifest {session_id}", lambda: self._commit(keys=keys, args=args))
        faults.point("redis.manifest.done")
        if ok == 0:
            raise SessionBusy(f"session {session_id!r} is held by another writer (lease {value.decode()!r})")
        if ok < 0:
            raise SnapshotConflict(
                f"session {session_id!r}: stored generation is {value.decode()}, this save expected "
                f"{expected_generation}"
            )
        return int(value)

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
