"""`redis://host:port/db[?prefix=kda:]` — a shared store in Redis through `redis.asyncio`; `?cluster=1` for a
Redis Cluster (`redis.asyncio.cluster.RedisCluster`, database 0 only).

Keys, all under one prefix (default `kda:`)::

    kda:blob:<digest>            a blob of at most `chunk_size` bytes (4 MiB by default), written with SET NX
    kda:blob:<digest>:<i>        chunk i of a larger blob (chunks of at most 64 MiB)
    kda:blob:<digest>:meta       "<chunks> <total bytes>" of a chunked blob, written LAST with SET NX, so a
                                 partially written chunked blob is never visible as a blob
    kda:blobtimes                sorted set digest -> last write/touch time (the GC grace period)
    kda:manifest:{<session>}     a session's manifest; the braces are a cluster hash tag, so the two keys
                                 below land in the same slot and one Lua script can touch all three
    kda:lease:{<session>}        "<owner>:<fence>", SET with PX: the session's write lease
    kda:fence:{<session>}        INCR counter of the session's fencing tokens

Blob keys carry no hash tag, so in a cluster blobs (and the chunks of one blob) spread over every slot; each
blob command touches one key, so redis-py's cluster pipeline splits a batch by node. Only the three session keys
above ever meet in one command (the Lua scripts), and they share a slot.

Blobs go out in pipelines of about `PIPELINE_BYTES` (small pipelines keep the client's copies in cache and let
the server work while the next one is packed), up to `max_in_flight` at once on separate connections; each
batch is hashed (in a worker thread) before it is sent, and read batches are hashed before they are returned.
A chunked blob's meta key is written only after every chunk is acknowledged.

A manifest is committed by one Lua script that checks the lease and the stored generation (compare-and-set)
and writes the manifest and the lease together. At connect, a server whose `maxmemory-policy` may evict keys
(anything but `noeviction`) is refused (StoreError): an evicted blob is a lost session; in a cluster every
primary is checked. `?allow_eviction=1` overrides this for caches you can afford to lose. `?lease_ttl=SECONDS`
sets the lease lifetime.

Connection errors and timeouts become StoreUnavailable; the timeouts are short so an unreachable server
fails fast.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import anyio.to_thread
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
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
from .base import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_IN_FLIGHT,
    BlobStore,
    StoreStats,
    check_digest,
    check_session_id,
)
from .redis_bulk import REDIRECTED, Item, Lane, Lanes, ReplyError

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kda:"
MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Blobs above this are chunked. Small enough that a large blob's chunks spread over connections (and cluster
nodes) and stay cache-friendly; stored blobs of any earlier chunk size read the same (the meta key says)."""
PIPELINE_BYTES = 2 * 1024 * 1024
"""Roughly how many value bytes one pipeline carries. Measured (bench/store_redis.py): 64 MiB pipelines ran
at a third of the speed of 1-2 MiB ones, which keep the client's copies of the values in cache."""
DEFAULT_TIMEOUT_S = 5.0
_TIMES_RETENTION_S = 24 * 3600.0
SAVE_LANES = max(1, (os.cpu_count() or 2) - 1)
"""Lanes (threads, each with its own connection; redis_bulk.py) a save spreads over: sending costs the client
little CPU, so one core is left to a local server (measured on 2 cores: 1 lane saved 1,124-1,275 MB/s of 80 KiB
blobs, 2 lanes 1,002-1,089)."""
LOAD_LANES = max(2, os.cpu_count() or 2)
"""Lanes a load spreads over: each hashes what it reads, so one per core (2 cores: 1 lane 741-764 MB/s, 2 lanes
917-963, 3 lanes 1,099 once)."""
_THREAD_HASH_BYTES = 256 * 1024
"""A batch at least this large is hashed in a worker thread (hashlib releases the GIL) so I/O goes on."""
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


def _batches(todo: list[int], sizes: Sequence[int], max_bytes: int) -> Iterator[list[int]]:
    """Split the indices `todo` into runs whose sizes total at most `max_bytes` (a larger item goes alone)."""
    batch: list[int] = []
    size = 0
    for i in todo:
        if batch and size + sizes[i] > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += sizes[i]
    if batch:
        yield batch


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def _mismatches(items: Sequence[tuple[str, bytes | memoryview]]) -> list[tuple[str, str, int]]:
    """(digest, actual sha256, length) of every item whose bytes do not hash to its digest."""
    bad = []
    for d, data in items:
        actual = hashlib.sha256(data).hexdigest()
        if actual != d:
            bad.append((d, actual, len(data)))
    return bad


async def _verify(items: Sequence[tuple[str, bytes | memoryview]], *, where: str) -> None:
    """Raise IntegrityError naming the first item whose sha256 is not its digest (as `base.verify_blob` does);
    a large batch is hashed in a worker thread."""
    if sum(len(data) for _, data in items) >= _THREAD_HASH_BYTES:
        bad = await anyio.to_thread.run_sync(_mismatches, items)
    else:
        bad = _mismatches(items)
    if bad:
        d, actual, n = bad[0]
        raise IntegrityError(f"{where}: blob {d} has sha256 {actual} ({n} bytes); corrupt or truncated")


async def _run_all(jobs: Iterable[Callable[[], Awaitable[None]]]) -> None:
    """Run `jobs` concurrently (each bounds itself); raise the first error itself, not an ExceptionGroup.
    Jobs that have not started when one fails do nothing."""
    errors: list[Exception] = []

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        if errors:
            return
        try:
            await job()
        except Exception as e:
            errors.append(e)

    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(one, job)
    if errors:
        raise errors[0]


class RedisStore(BlobStore):
    """Blobs and manifests in one Redis database or one Redis Cluster, under one key prefix; see the module
    docstring."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        prefix: str = DEFAULT_PREFIX,
        chunk_size: int = DEFAULT_CHUNK_BYTES,
        url: str = "redis://",
    ) -> None:
        """Wrap a client (a `Redis` or a `RedisCluster`) created with `decode_responses=False`; prefer
        `RedisStore.open(url)`."""
        if not 0 < chunk_size <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK_BYTES}], got {chunk_size}")
        self.cluster = isinstance(client, RedisCluster)
        if self.cluster and ("{" in prefix or "}" in prefix):
            raise ValueError(
                f"prefix {prefix!r} holds a brace: in a Redis Cluster it would be the hash tag of every key, "
                f"putting the whole store in one slot"
            )
        self._r: Any = client
        self.prefix = prefix
        self.chunk_size = chunk_size
        self.url = url
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._commit = client.register_script(_COMMIT_LUA)
        if isinstance(client, RedisCluster):
            kwargs = client.get_connection_kwargs()
            connection_class = kwargs.get("connection_class", aioredis.Connection)
        else:
            kwargs, connection_class = client.connection_pool.connection_kwargs, client.connection_pool.connection_class
        self._lanes = Lanes.for_client(connection_class, kwargs, float(kwargs.get("socket_timeout") or DEFAULT_TIMEOUT_S))

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_size: int = DEFAULT_CHUNK_BYTES,
        ping: bool = True,
    ) -> RedisStore:
        """Connect to `url` (`redis://` or `rediss://`); the query may set `prefix`, `timeout` (seconds),
        `chunk_size`, `lease_ttl` (seconds), `allow_eviction=1` and `cluster=1` (the url names any one node of
        a Redis Cluster; the others are discovered). With `ping`, an unreachable server (or cluster) raises
        StoreUnavailable here, within ~`timeout_s`, and a server that may evict keys raises StoreError."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("prefix", DEFAULT_PREFIX)
        timeout_s = float(query.pop("timeout", timeout_s))
        chunk_size = int(query.pop("chunk_size", chunk_size))
        lease_ttl_s = float(query.pop("lease_ttl", DEFAULT_LEASE_TTL_S))
        allow_eviction = _flag(query.pop("allow_eviction", "0"))
        cluster = _flag(query.pop("cluster", "0"))
        options: dict[str, Any] = {
            "socket_connect_timeout": timeout_s,
            "socket_timeout": timeout_s,
            "decode_responses": False,
        }
        client: aioredis.Redis | RedisCluster
        if cluster:
            if parts.path.strip("/") not in ("", "0"):
                raise ValueError(f"a Redis Cluster has only database 0, got {parts.path!r} in {url!r}")
            client_url = urlunsplit(parts._replace(path="", query=urlencode(query)))
            # One quick retry (a failover, a moved slot map); not redis-py's default of 3 with backoff up to
            # seconds, so a cluster that is down fails fast.
            retry = Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1)
            client = RedisCluster.from_url(client_url, retry=retry, **options)
        else:
            client_url = urlunsplit(parts._replace(query=urlencode(query)))
            client = aioredis.Redis.from_url(client_url, retry_on_timeout=False, **options)
        try:
            store = cls(client, prefix=prefix, chunk_size=chunk_size, url=url)
        except BaseException:
            await client.aclose()
            raise
        store.lease_ttl_s = lease_ttl_s
        if ping:
            try:
                await store._call("ping", store._ping)
                await store._check_eviction(allow_eviction)
            except BaseException:
                await client.aclose()
                raise
        return store

    async def _ping(self) -> None:
        if self.cluster:
            await self._r.initialize()  # discovers the nodes and the slot map
            await self._r.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            await self._r.ping()

    async def _check_eviction(self, allow: bool) -> None:
        nodes: list[Any] = self._r.get_primaries() if self.cluster else [None]
        for node in nodes:
            where = self.url if node is None else f"{self.url} (node {node.name})"
            try:
                if node is None:
                    reply: dict[Any, Any] = await self._r.config_get("maxmemory-policy")
                else:
                    reply = await self._r.config_get("maxmemory-policy", target_nodes=node)
            except ResponseError as e:  # CONFIG renamed or disabled (managed Redis): cannot check
                logger.warning("%s: cannot read maxmemory-policy (%s); make sure it is noeviction", where, e)
                continue
            except (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError) as e:
                raise StoreUnavailable(f"{where}: config get failed: {e}") from e
            raw = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy", b"noeviction"))
            policy = raw.decode() if isinstance(raw, bytes) else str(raw)
            if policy == "noeviction":
                continue
            if not allow:
                raise StoreError(
                    f"{where}: maxmemory-policy is {policy!r}, so Redis may evict stored sessions; set it to "
                    f"noeviction, or add ?allow_eviction=1 to the store url to accept losing sessions"
                )
            logger.warning("%s: maxmemory-policy is %r; sessions may be evicted (allowed by the url)", where, policy)

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

    def session_keys(self, session_id: str) -> list[str]:
        """The keys of one session (manifest, lease, fence): one hash tag, so one cluster slot."""
        return [self._manifest_key(session_id), self._lease_key(session_id), self._fence_key(session_id)]

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
        except RedisClusterException as e:  # no reachable node, slots not covered
            raise StoreUnavailable(f"{self.url}: {op} failed: redis cluster: {e}") from e
        except ReplyError as e:  # an error reply on a bulk lane
            raise StoreUnavailable(f"{self.url}: {op} failed: redis error: {e}") from e

    async def _scan(self, pattern: str) -> list[bytes]:
        async def scan() -> list[bytes]:
            if not self.cluster:
                return [k async for k in self._r.scan_iter(match=pattern, count=1000)]
            await self._r.initialize()  # the node list (a no-op once known; after ping=False or a failure, not)
            keys: list[bytes] = []
            for node in self._r.get_primaries():  # each primary holds its own slots' keys
                keys += [k async for k in self._r.scan_iter(match=pattern, count=1000, target_nodes=node)]
            return keys

        return await self._call(f"scan {pattern}", scan)

    @asynccontextmanager
    async def _pipeline(self) -> AsyncIterator[Any]:
        # Never MULTI: a cluster pipeline then splits the commands by node and sends to all nodes at once.
        async with self._r.pipeline(transaction=False) as pipe:
            yield pipe

    async def _pipelined(self, op: str, build: Callable[[Any], object]) -> list[Any]:
        """One non-transactional pipeline: `build(pipe)` queues commands; their replies, in order."""

        async def run() -> list[Any]:
            async with self._pipeline() as pipe:
                build(pipe)
                return list(await pipe.execute())

        return await self._call(op, run)

    # --- blobs -------------------------------------------------------------------------------------------

    async def put_blob(self, digest: str, data: bytes) -> bool:
        return digest in await self.put_blobs({digest: data})

    async def put_blobs(
        self, blobs: Mapping[str, bytes], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        """SET NX of each blob of at most `chunk_size` bytes; a larger blob (unless its meta key exists) as
        chunks, then its meta key with SET NX once every chunk is acknowledged. Through the bulk lanes where the
        connection allows (redis_bulk.py), else pipelines of about `PIPELINE_BYTES`; at most `max_in_flight` at
        once either way. Unless `verified`, each batch is hashed before it is sent (IntegrityError: nothing of
        that batch is written) and a large blob before any of its chunks."""
        for d in blobs:
            check_digest(d)
        written: set[str] = set()
        if not blobs:
            return written
        now = time.time()
        await self._call("touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(blobs, now)))
        where = f"put into {self.url}"
        large = [d for d, data in blobs.items() if len(data) > self.chunk_size]
        if large and not verified:
            await _verify([(d, blobs[d]) for d in large], where=where)
        if large:
            metas = await self._pipelined("exists", lambda pipe: [pipe.exists(self._meta_key(d)) for d in large])
            large = [d for d, n in zip(large, metas, strict=True) if not n]
        items: list[Item] = []
        for d, data in blobs.items():
            if len(data) <= self.chunk_size:
                items.append((self._blob_key(d), data, None if verified else d, True))
        for d in large:  # chunks are overwritten (not NX): a dead writer may have left chunks of another size
            view = memoryview(blobs[d])
            for i in range(-(-len(view) // self.chunk_size)):
                items.append((self._chunk_key(d, i), view[i * self.chunk_size : (i + 1) * self.chunk_size], None, False))
        ok = await self._set_many("put blobs", items, max_in_flight)
        skip = len(self.prefix) + len("blob:")
        written.update(key[skip:] for (key, _, _, nx), r in zip(items, ok, strict=True) if nx and r)
        if large:  # only now, every chunk acknowledged, does a chunked blob become visible
            metas_ok = await self._pipelined(
                "put chunked blobs",
                lambda pipe: [
                    pipe.set(self._meta_key(d), f"{-(-len(blobs[d]) // self.chunk_size)} {len(blobs[d])}", nx=True)
                    for d in large
                ],
            )
            written.update(d for d, r in zip(large, metas_ok, strict=True) if r)
        faults.point("redis.blobs.sent")
        return written

    async def get_blob(self, digest: str) -> bytes:
        return (await self.get_blobs([digest]))[digest]

    async def get_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> dict[str, bytes]:
        """One GET per blob (bulk lanes or pipelines, at most `max_in_flight` at once); the chunk records of
        the blobs that were absent; then the chunks of the chunked ones. Every blob is verified."""
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]
        values = await self._get_many("get blobs", [self._blob_key(d) for d in wanted], wanted, max_in_flight)
        out = {d: v for d, v in zip(wanted, values, strict=True) if v is not None}
        absent = [d for d in wanted if d not in out]
        if absent:
            metas = await self._pipelined("get blobs", lambda pipe: [pipe.get(self._meta_key(d)) for d in absent])
            for d, meta in zip(absent, metas, strict=True):
                if meta is None:
                    raise BlobNotFound(d)
                out[d] = await self._get_chunked(d, meta, max_in_flight)
        return {d: out[d] for d in wanted}

    async def _get_chunked(self, digest: str, meta: bytes, max_in_flight: int) -> bytes:
        try:
            n_str, total_str = meta.decode().split()
            n, total = int(n_str), int(total_str)
            if n < 1 or total < 0:
                raise ValueError("negative")
        except (UnicodeDecodeError, ValueError) as e:
            raise IntegrityError(f"{self.url}: blob {digest} has a bad chunk record {meta[:64]!r}") from e
        keys = [self._chunk_key(digest, i) for i in range(n)]
        chunks = await self._get_many(f"get chunked blob {digest}", keys, [None] * n, max_in_flight)
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise IntegrityError(f"{self.url}: blob {digest} is truncated: chunks {missing[:8]} of {n} missing")
        data = b"".join(c for c in chunks if c is not None)
        if len(data) != total:
            raise IntegrityError(f"{self.url}: blob {digest} has {len(data)} bytes in chunks, expected {total}")
        await _verify([(digest, data)], where=self.url)
        return data

    # --- bulk transport: lanes, or redis-py pipelines as the fallback ---------------------------------------

    async def _set_many(self, op: str, items: list[Item], max_in_flight: int) -> list[bool]:
        """SET (NX where the item says) of every item; True where it was written. An item with a digest is
        hashed before its batch is sent."""
        results: list[Any] = [REDIRECTED] * len(items)
        if self._lanes is not None:
            hashing = any(d is not None for _, _, d, _ in items)  # then as many lanes as a load: each hashes
            results = await self._on_lanes(
                op, [key for key, *_ in items], lambda lane, idx: lane.set_many([items[i] for i in idx], PIPELINE_BYTES),
                min(max_in_flight, LOAD_LANES if hashing else SAVE_LANES),
            )
        todo = [i for i, r in enumerate(results) if r == REDIRECTED]
        if todo:  # no lanes, or a cluster moved a slot: redis-py follows redirects
            limit = anyio.Semaphore(max(1, max_in_flight))

            def job(batch: list[int]) -> Callable[[], Awaitable[None]]:
                def build(pipe: Any) -> None:
                    for i in batch:
                        key, value, _, nx = items[i]
                        pipe.set(key, value, nx=nx)

                async def run() -> None:
                    async with limit:
                        checks = [(d, value) for _, value, d, _ in (items[i] for i in batch) if d is not None]
                        await _verify(checks, where=f"put into {self.url}")
                        got = await self._pipelined(op, build)
                    for i, r in zip(batch, got, strict=True):
                        results[i] = r

                return run

            await _run_all(map(job, _batches(todo, [len(items[i][1]) for i in range(len(items))], PIPELINE_BYTES)))
        return [bool(r) for r in results]

    async def _get_many(
        self, op: str, keys: list[str], digests: Sequence[str | None], max_in_flight: int
    ) -> list[bytes | None]:
        """GET of every key, None where absent; a value whose digest is given is verified (IntegrityError)."""
        results: list[Any] = [REDIRECTED] * len(keys)
        if self._lanes is not None:
            where = self.url
            results = await self._on_lanes(
                op, keys,
                lambda lane, idx: lane.get([keys[i] for i in idx], [digests[i] for i in idx], PIPELINE_BYTES, where),
                min(max_in_flight, LOAD_LANES),
            )
        todo = [i for i, r in enumerate(results) if r == REDIRECTED]
        if todo:
            limit = anyio.Semaphore(max(1, max_in_flight))
            per = max(1, PIPELINE_BYTES // max(1, self.chunk_size // 8))

            def job(batch: list[int]) -> Callable[[], Awaitable[None]]:
                async def run() -> None:
                    async with limit:
                        got = await self._pipelined(op, lambda pipe: [pipe.get(keys[i]) for i in batch])
                    found = [(digests[i], v) for i, v in zip(batch, got, strict=True) if v is not None]
                    await _verify([(d, v) for d, v in found if d is not None], where=self.url)
                    for i, v in zip(batch, got, strict=True):
                        results[i] = v

                return run

            await _run_all(job(todo[i : i + per]) for i in range(0, len(todo), per))
        return results

    async def _on_lanes(
        self, op: str, keys: list[str], work: Callable[[Lane, list[int]], list[Any]], lanes: int
    ) -> list[Any]:
        """`work(lane, indices)` in worker threads, one lane each: the keys grouped by the server that holds
        them, each group dealt round-robin over `lanes` lanes in all (at least one per server). The
        per-key results, in order."""
        assert self._lanes is not None
        pool = self._lanes
        groups: dict[tuple[str, int], list[int]] = {}
        if self.cluster:
            await self._call(op, self._r.initialize)  # the slot map (a no-op once known)
            for i, key in enumerate(keys):
                node = self._r.get_node_from_key(key)
                groups.setdefault((node.host, int(node.port)), []).append(i)
        elif keys:
            kw = self._r.connection_pool.connection_kwargs
            groups[(kw.get("host", "localhost"), int(kw.get("port", 6379)))] = list(range(len(keys)))
        per_group = -(-max(1, lanes) // max(1, len(groups)))
        results: list[Any] = [None] * len(keys)

        def one(addr: tuple[str, int], idx: list[int]) -> None:
            lane = pool.take(*addr)
            try:
                got = work(lane, idx)
            except BaseException:
                lane.close()  # its state is unknown: replies may be unread
                raise
            pool.give(*addr, lane)
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        def job(addr: tuple[str, int], idx: list[int]) -> Callable[[], Awaitable[None]]:
            return lambda: anyio.to_thread.run_sync(one, addr, idx)

        parts = [(a, idx[j::per_group]) for a, idx in groups.items() for j in range(min(per_group, len(idx)))]
        await self._call(op, lambda: _run_all(job(a, idx) for a, idx in parts))
        return results

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]
        keys = [k for d in wanted for k in (self._blob_key(d), self._meta_key(d))]  # one EXISTS per key: two slots
        counts: list[Any] = [REDIRECTED] * len(keys)
        if self._lanes is not None:
            counts = await self._on_lanes("has blobs", keys, lambda lane, idx: lane.exists([keys[i] for i in idx]), 1)
        todo = [i for i, n in enumerate(counts) if n == REDIRECTED]
        if todo:
            got = await self._pipelined("has blobs", lambda pipe: [pipe.exists(keys[i]) for i in todo])
            for i, n in zip(todo, got, strict=True):
                counts[i] = n
        return {d for i, d in enumerate(wanted) if counts[2 * i] or counts[2 * i + 1]}

    async def delete_blob(self, digest: str) -> bool:
        check_digest(digest)

        async def delete() -> bool:
            meta = await self._r.get(self._meta_key(digest))
            # The meta key goes first so the blob is never visible with chunks missing. (A cluster client
            # splits a multi-key DEL by slot.)
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
            await self._call("touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(present, now)))

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        wanted = [check_digest(d) for d in digests]
        if not wanted:
            return set()
        cutoff = time.time() - within_s
        scores = await self._call("touch times", lambda: self._r.zmscore(self._times_key, wanted))
        return {d for d, t in zip(wanted, scores, strict=True) if t is not None and float(t) >= cutoff}

    async def recent_blobs(self, within_s: float) -> set[str]:
        now = time.time()

        def build(pipe: Any) -> None:
            pipe.zremrangebyscore(self._times_key, "-inf", now - max(within_s, _TIMES_RETENTION_S))
            pipe.zrangebyscore(self._times_key, now - within_s, "+inf")

        return {m.decode() for m in (await self._pipelined("recent blobs", build))[1]}

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
        keys = self.session_keys(session_id)
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
        blob_sizes = await self._pipelined("stats", lambda pipe: [pipe.strlen(k) for k in blob_keys])
        manifest_sizes = await self._pipelined("stats", lambda pipe: [pipe.strlen(k) for k in manifest_keys])
        return StoreStats(
            num_blobs=len(await self.list_blobs()),
            blob_bytes=sum(map(int, blob_sizes)),
            num_manifests=len(manifest_keys),
            manifest_bytes=sum(map(int, manifest_sizes)),
        )

    async def close(self) -> None:
        if self._lanes is not None:
            self._lanes.close()
        await self._r.aclose()
