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

Blobs move over bulk lanes (redis_bulk.py: blocking sockets in worker threads, hand-framed SET NX and GET, no
copies in Python) where the connection is plain TCP, else through redis-py pipelines (redis_io.py); either way
a batch is hashed before it is sent unless the caller hashed it (`verified`), every blob read is hashed, and a
chunked blob's meta key is written only after every chunk is acknowledged. The url is parsed and the server
checked in redis_conn.py; the session scripts are in redis_lua.py.

A manifest is committed by one Lua script that checks the lease and the stored generation (compare-and-set)
and writes the manifest and the lease together. At connect, a server whose `maxmemory-policy` may evict keys
(anything but `noeviction`) is refused (StoreError): an evicted blob is a lost session; in a cluster every
primary is checked. `?allow_eviction=1` overrides this for caches you can afford to lose. `?lease_ttl=SECONDS`
sets the lease lifetime.

Connection errors and timeouts become StoreUnavailable; the timeouts are short so an unreachable server
fails fast.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from .. import faults
from ..blobs import is_digest
from ..errors import BlobNotFound, IntegrityError, ManifestNotFound, SessionBusy, SnapshotConflict
from .base import DEFAULT_MAX_IN_FLIGHT, BlobStore, StoreStats, check_digest, check_session_id
from .redis_bulk import REDIRECTED, Item
from .redis_conn import DEFAULT_PREFIX, DEFAULT_TIMEOUT_S, StoreUrl, check_server
from .redis_io import RedisIO, verify
from .redis_lua import ACQUIRE_LUA, COMMIT_LUA, RELEASE_LUA

MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
"""Blobs above this are chunked. Small enough that a large blob's chunks spread over connections (and cluster
nodes) and stay cache-friendly; stored blobs of any earlier chunk size read the same (the meta key says)."""
_TIMES_RETENTION_S = 24 * 3600.0


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


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
        timeout_s: float = DEFAULT_TIMEOUT_S,
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
        self._io = RedisIO(client, url, timeout_s)
        self.prefix = prefix
        self.chunk_size = chunk_size
        self.url = url
        self._acquire = client.register_script(ACQUIRE_LUA)
        self._release = client.register_script(RELEASE_LUA)
        self._commit = client.register_script(COMMIT_LUA)

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
        u = StoreUrl.parse(url, timeout_s=timeout_s, chunk_size=chunk_size)
        client = u.client()
        try:
            store = cls(client, prefix=u.prefix, chunk_size=u.chunk_size, url=url, timeout_s=u.timeout_s)
        except BaseException:
            await client.aclose()
            raise
        store.lease_ttl_s = u.lease_ttl_s
        if ping:
            try:
                await check_server(store._io, u.allow_eviction)
            except BaseException:
                await store.close()
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
        await self._io.call("touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(blobs, now)))
        where = f"put into {self.url}"
        large = [d for d, data in blobs.items() if len(data) > self.chunk_size]
        if large and not verified:
            await verify([(d, blobs[d]) for d in large], where=where)
        if large:
            metas = await self._io.pipelined("exists", lambda pipe: [pipe.exists(self._meta_key(d)) for d in large])
            large = [d for d, n in zip(large, metas, strict=True) if not n]
        items: list[Item] = []
        for d, data in blobs.items():
            if len(data) <= self.chunk_size:
                items.append((self._blob_key(d), data, None if verified else d, True))
        for d in large:  # chunks are overwritten (not NX): a dead writer may have left chunks of another size
            view = memoryview(blobs[d])
            for i in range(-(-len(view) // self.chunk_size)):
                items.append((self._chunk_key(d, i), view[i * self.chunk_size : (i + 1) * self.chunk_size], None, False))
        ok = await self._io.set_many("put blobs", items, max_in_flight)
        skip = len(self.prefix) + len("blob:")
        written.update(key[skip:] for (key, _, _, nx), r in zip(items, ok, strict=True) if nx and r)
        if large:  # only now, every chunk acknowledged, does a chunked blob become visible
            metas_ok = await self._io.pipelined(
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
        keys = [self._blob_key(d) for d in wanted]
        values = await self._io.get_many("get blobs", keys, wanted, max_in_flight, self.chunk_size // 8)
        out = {d: v for d, v in zip(wanted, values, strict=True) if v is not None}
        absent = [d for d in wanted if d not in out]
        if absent:
            metas = await self._io.pipelined("get blobs", lambda pipe: [pipe.get(self._meta_key(d)) for d in absent])
            for d, meta in zip(absent, metas, strict=True):
                if meta is None:
                    raise BlobNotFound(d)
                out[d] = await self._get_chunked(d, meta, max_in_flight)
        return {d: out[d] for d in wanted}

    async def get_blobs_into(
        self, targets: Sequence[tuple[str, Sequence[memoryview]]], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> list[int]:
        """As `BlobStore.get_blobs_into`, with no bytes object in between where the bulk lanes serve: each value
        is received straight into its buffers and hashed there. Blobs stored in chunks, keys a cluster redirects
        and connections without lanes take the default path (`get_blobs`, then a copy)."""
        for d, _ in targets:
            check_digest(d)
        if not targets:
            return []
        keys = [self._blob_key(d) for d, _ in targets]
        got = await self._io.get_many_into(
            "get blobs", keys, [bufs for _, bufs in targets], [d for d, _ in targets], max_in_flight
        )
        if got is None:
            return await super().get_blobs_into(targets, max_in_flight=max_in_flight)
        bad = [i for i, r in enumerate(got) if r is False]
        rest = [i for i, r in enumerate(got) if r is None or r == REDIRECTED]
        if rest:  # chunked (or absent: BlobNotFound) or redirected
            later = await super().get_blobs_into([targets[i] for i in rest], max_in_flight=max_in_flight)
            bad += [rest[j] for j in later]
        return sorted(bad)

    async def _get_chunked(self, digest: str, meta: bytes, max_in_flight: int) -> bytes:
        try:
            n_str, total_str = meta.decode().split()
            n, total = int(n_str), int(total_str)
            if n < 1 or total < 0:
                raise ValueError("negative")
        except (UnicodeDecodeError, ValueError) as e:
            raise IntegrityError(f"{self.url}: blob {digest} has a bad chunk record {meta[:64]!r}") from e
        keys = [self._chunk_key(digest, i) for i in range(n)]
        chunks = await self._io.get_many(f"get chunked blob {digest}", keys, [None] * n, max_in_flight, total // n)
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise IntegrityError(f"{self.url}: blob {digest} is truncated: chunks {missing[:8]} of {n} missing")
        data = b"".join(c for c in chunks if c is not None)
        if len(data) != total:
            raise IntegrityError(f"{self.url}: blob {digest} has {len(data)} bytes in chunks, expected {total}")
        await verify([(digest, data)], where=self.url)
        return data

    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        wanted = [check_digest(d) for d in dict.fromkeys(digests)]
        if not self.cluster:  # one EXISTS of both keys per blob
            counts = await self._io.exists_many("has blobs", [(self._blob_key(d), self._meta_key(d)) for d in wanted])
            return {d for d, n in zip(wanted, counts, strict=True) if n}
        # The two keys hash to different slots: one EXISTS each.
        groups = [(k,) for d in wanted for k in (self._blob_key(d), self._meta_key(d))]
        counts = await self._io.exists_many("has blobs", groups)
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

        return await self._io.call(f"delete blob {digest}", delete)

    async def list_blobs(self) -> list[str]:
        skip = len(self.prefix) + len("blob:")
        names = {k.decode()[skip:] for k in await self._io.scan(f"{_glob_escape(self.prefix)}blob:*")}
        out = {n for n in names if is_digest(n)}
        out.update(n[:-5] for n in names if n.endswith(":meta") and is_digest(n[:-5]))
        return sorted(out)

    async def touch_blobs(self, digests: Iterable[str]) -> None:
        present = await self.has_blobs(digests)
        if present:
            now = time.time()
            await self._io.call("touch blobs", lambda: self._r.zadd(self._times_key, dict.fromkeys(present, now)))

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        wanted = [check_digest(d) for d in digests]
        if not wanted:
            return set()
        cutoff = time.time() - within_s
        scores = await self._io.call("touch times", lambda: self._r.zmscore(self._times_key, wanted))
        return {d for d, t in zip(wanted, scores, strict=True) if t is not None and float(t) >= cutoff}

    async def recent_blobs(self, within_s: float) -> set[str]:
        now = time.time()

        def build(pipe: Any) -> None:
            pipe.zremrangebyscore(self._times_key, "-inf", now - max(within_s, _TIMES_RETENTION_S))
            pipe.zrangebyscore(self._times_key, now - within_s, "+inf")

        return {m.decode() for m in (await self._io.pipelined("recent blobs", build))[1]}

    # --- manifests ---------------------------------------------------------------------------------------

    async def put_manifest(self, session_id: str, data: bytes) -> None:
        key = self._manifest_key(session_id)
        await self._io.call(f"put manifest {session_id}", lambda: self._r.set(key, data))

    async def get_manifest(self, session_id: str) -> bytes:
        key = self._manifest_key(session_id)
        data = await self._io.call(f"get manifest {session_id}", lambda: self._r.get(key))
        if not isinstance(data, bytes):  # None: absent (the client never decodes responses)
            raise ManifestNotFound(session_id)
        return data

    async def list_manifests(self) -> list[str]:
        keys = await self._io.scan(f"{_glob_escape(self.prefix)}manifest:{{*}}")
        skip = len(self.prefix) + len("manifest:{")
        return sorted(k.decode()[skip:-1] for k in keys)

    async def delete_manifest(self, session_id: str) -> bool:
        key = self._manifest_key(session_id)
        return bool(await self._io.call(f"delete manifest {session_id}", lambda: self._r.delete(key)))

    # --- leases ------------------------------------------------------------------------------------------

    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        keys = [self._lease_key(session_id), self._fence_key(session_id)]
        ok, value = await self._io.call(
            f"lease {session_id}", lambda: self._acquire(keys=keys, args=[owner, max(1, int(ttl_s * 1000))])
        )
        if not ok:
            raise SessionBusy(f"session {session_id!r} is held by another writer (lease {value.decode()!r})")
        return int(value)

    async def release_lease(self, session_id: str, owner: str) -> bool:
        key = self._lease_key(session_id)
        return bool(await self._io.call(f"release lease {session_id}", lambda: self._release(keys=[key], args=[owner])))

    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        keys = self.session_keys(session_id)
        args: list[Any] = [data, expected_generation, owner, max(1, int(ttl_s * 1000))]
        faults.point("redis.manifest.before")
        ok, value = await self._io.call(f"commit manifest {session_id}", lambda: self._commit(keys=keys, args=args))
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
            k for k in await self._io.scan(f"{_glob_escape(self.prefix)}blob:*") if not k.endswith(b":meta")
        ]
        manifest_keys = await self._io.scan(f"{_glob_escape(self.prefix)}manifest:{{*}}")
        blob_sizes = await self._io.pipelined("stats", lambda pipe: [pipe.strlen(k) for k in blob_keys])
        manifest_sizes = await self._io.pipelined("stats", lambda pipe: [pipe.strlen(k) for k in manifest_keys])
        return StoreStats(
            num_blobs=len(await self.list_blobs()),
            blob_bytes=sum(map(int, blob_sizes)),
            num_manifests=len(manifest_keys),
            manifest_bytes=sum(map(int, manifest_sizes)),
        )

    async def close(self) -> None:
        await self._io.close()
