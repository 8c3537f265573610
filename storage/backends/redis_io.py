"""How RedisStore talks to Redis: redis-py calls with typed errors, pipelines, SCAN over every primary, and
SET / GET / EXISTS of many keys at once, over the bulk lanes (redis_bulk.py) where the connection allows and
through redis-py pipelines otherwise (TLS, unix sockets) and for whatever a cluster redirected.

Pipelines carry about `PIPELINE_BYTES` of values (small pipelines keep the client's copies in cache and let the
server work while the next one is packed), up to `max_in_flight` at once on separate connections; a batch is
hashed (in a worker thread) before it is sent, and read batches are hashed before they are returned. Connection
errors, timeouts and error replies become StoreUnavailable.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import IntegrityError, StoreUnavailable
from .redis_bulk import REDIRECTED, Item, Lane, Lanes, ReplyError

PIPELINE_BYTES = 2 * 1024 * 1024
"""Roughly how many value bytes one pipeline (or one lane's batch) carries. Measured (bench/store_redis.py):
64 MiB pipelines ran at a third of the speed of 1-2 MiB ones, which keep the client's copies in cache."""
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


def batches(todo: list[int], sizes: Sequence[int], max_bytes: int) -> Iterator[list[int]]:
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


def _mismatches(items: Sequence[tuple[str, bytes | memoryview]]) -> list[tuple[str, str, int]]:
    """(digest, actual sha256, length) of every item whose bytes do not hash to its digest."""
    bad = []
    for d, data in items:
        actual = hashlib.sha256(data).hexdigest()
        if actual != d:
            bad.append((d, actual, len(data)))
    return bad


async def verify(items: Sequence[tuple[str, bytes | memoryview]], *, where: str) -> None:
    """Raise IntegrityError naming the first item whose sha256 is not its digest (as `base.verify_blob` does);
    a large batch is hashed in a worker thread."""
    if sum(len(data) for _, data in items) >= _THREAD_HASH_BYTES:
        bad = await anyio.to_thread.run_sync(_mismatches, items)
    else:
        bad = _mismatches(items)
    if bad:
        d, actual, n = bad[0]
        raise IntegrityError(f"{where}: blob {d} has sha256 {actual} ({n} bytes); corrupt or truncated")


async def run_all(jobs: Iterable[Callable[[], Awaitable[None]]]) -> None:
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


class RedisIO:
    """One client (a `Redis` or a `RedisCluster`, `decode_responses=False`) and, for plain TCP, its lanes."""

    def __init__(self, client: aioredis.Redis | RedisCluster, url: str, timeout_s: float) -> None:
        self.r: Any = client
        self.url = url
        self.cluster = isinstance(client, RedisCluster)
        if isinstance(client, RedisCluster):
            kwargs = client.get_connection_kwargs()
            connection_class = kwargs.get("connection_class", aioredis.Connection)
        else:
            kwargs, connection_class = client.connection_pool.connection_kwargs, client.connection_pool.connection_class
        self.lanes = Lanes.for_client(connection_class, kwargs, float(kwargs.get("socket_timeout") or timeout_s))

    async def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        await self.r.aclose()

    async def call(self, op: str, fn: Callable[[], Awaitable[_T]]) -> _T:
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

    async def scan(self, pattern: str) -> list[bytes]:
        async def scan() -> list[bytes]:
            if not self.cluster:
                return [k async for k in self.r.scan_iter(match=pattern, count=1000)]
            await self.r.initialize()  # the node list (a no-op once known; after ping=False or a failure, not)
            keys: list[bytes] = []
            for node in self.r.get_primaries():  # each primary holds its own slots' keys
                keys += [k async for k in self.r.scan_iter(match=pattern, count=1000, target_nodes=node)]
            return keys

        return await self.call(f"scan {pattern}", scan)

    @asynccontextmanager
    async def pipeline(self) -> AsyncIterator[Any]:
        # Never MULTI: a cluster pipeline then splits the commands by node and sends to all nodes at once.
        async with self.r.pipeline(transaction=False) as pipe:
            yield pipe

    async def pipelined(self, op: str, build: Callable[[Any], object]) -> list[Any]:
        """One non-transactional pipeline: `build(pipe)` queues commands; their replies, in order."""

        async def run() -> list[Any]:
            async with self.pipeline() as pipe:
                build(pipe)
                return list(await pipe.execute())

        return await self.call(op, run)

    async def set_many(self, op: str, items: list[Item], max_in_flight: int) -> list[bool]:
        """SET (NX where the item says) of every item; True where it was written. An item with a digest is
        hashed before its batch is sent."""
        results: list[Any] = [REDIRECTED] * len(items)
        if self.lanes is not None:
            hashing = any(d is not None for _, _, d, _ in items)  # then as many lanes as a load: each hashes
            results = await self.on_lanes(
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
                        await verify(checks, where=f"put into {self.url}")
                        got = await self.pipelined(op, build)
                    for i, r in zip(batch, got, strict=True):
                        results[i] = r

                return run

            await run_all(map(job, batches(todo, [len(items[i][1]) for i in range(len(items))], PIPELINE_BYTES)))
        return [bool(r) for r in results]

    async def get_many(
        self, op: str, keys: list[str], digests: Sequence[str | None], max_in_flight: int, value_bytes: int
    ) -> list[bytes | None]:
        """GET of every key, None where absent; a value whose digest is given is verified (IntegrityError).
        `value_bytes` (a guess of a value's size) sizes the fallback's pipelines."""
        results: list[Any] = [REDIRECTED] * len(keys)
        if self.lanes is not None:
            where = self.url
            results = await self.on_lanes(
                op, keys,
                lambda lane, idx: lane.get([keys[i] for i in idx], [digests[i] for i in idx], PIPELINE_BYTES, where),
                min(max_in_flight, LOAD_LANES),
            )
        todo = [i for i, r in enumerate(results) if r == REDIRECTED]
        if todo:
            limit = anyio.Semaphore(max(1, max_in_flight))
            per = max(1, PIPELINE_BYTES // max(1, value_bytes))

            def job(batch: list[int]) -> Callable[[], Awaitable[None]]:
                async def run() -> None:
                    async with limit:
                        got = await self.pipelined(op, lambda pipe: [pipe.get(keys[i]) for i in batch])
                    found = [(digests[i], v) for i, v in zip(batch, got, strict=True) if v is not None]
                    await verify([(d, v) for d, v in found if d is not None], where=self.url)
                    for i, v in zip(batch, got, strict=True):
                        results[i] = v

                return run

            await run_all(job(todo[i : i + per]) for i in range(0, len(todo), per))
        return results

    async def get_many_into(
        self, op: str, keys: list[str], targets: Sequence[Sequence[memoryview]], digests: Sequence[str],
        max_in_flight: int,
    ) -> list[Any] | None:
        """`Lane.get_into` of every key over the bulk lanes (per key True, False, None or REDIRECTED, as there);
        None when this connection has no lanes (TLS, unix socket)."""
        if self.lanes is None:
            return None
        where = self.url
        return await self.on_lanes(
            op, keys,
            lambda lane, idx: lane.get_into(
                [keys[i] for i in idx], [targets[i] for i in idx], [digests[i] for i in idx], PIPELINE_BYTES, where
            ),
            min(max_in_flight, LOAD_LANES),
        )

    async def on_lanes(
        self, op: str, keys: list[str], work: Callable[[Lane, list[int]], list[Any]], lanes: int
    ) -> list[Any]:
        """`work(lane, indices)` in worker threads, one lane each: the keys grouped by the server that holds
        them, each group dealt round-robin over `lanes` lanes in all (at least one per server). The
        per-key results, in order."""
        assert self.lanes is not None
        pool = self.lanes
        groups: dict[tuple[str, int], list[int]] = {}
        if self.cluster:
            await self.call(op, self.r.initialize)  # the slot map (a no-op once known)
            for i, key in enumerate(keys):
                node = self.r.get_node_from_key(key)
                if node is None:
                    raise StoreUnavailable(f"{self.url}: {op} failed: redis cluster: no node serves the slot of {key}")
                groups.setdefault((node.host, int(node.port)), []).append(i)
        elif keys:
            kw = self.r.connection_pool.connection_kwargs
            groups[(kw.get("host", "localhost"), int(kw.get("port", 6379)))] = list(range(len(keys)))
        per_group = -(-max(1, lanes) // max(1, len(groups)))
        results: list[Any] = [None] * len(keys)

        def one(addr: tuple[str, int], idx: list[int]) -> None:
            lane, pooled = pool.take(*addr)
            try:
                got = work(lane, idx)
            except ConnectionError:  # reset, broken pipe, closed; not a timeout (that would double the wait)
                lane.close()
                if not pooled:
                    raise
                # An idle connection the server dropped (a restart, its idle timeout): once more on a new one.
                # Every lane command is idempotent (SET NX, chunk SETs of the same bytes, GET, EXISTS).
                lane, _ = pool.take(*addr, fresh=True)
                try:
                    got = work(lane, idx)
                except BaseException:
                    lane.close()
                    raise
            except BaseException:
                lane.close()  # its state is unknown: replies may be unread
                raise
            pool.give(*addr, lane)
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        def job(addr: tuple[str, int], idx: list[int]) -> Callable[[], Awaitable[None]]:
            return lambda: anyio.to_thread.run_sync(one, addr, idx)

        parts = [(a, idx[j::per_group]) for a, idx in groups.items() for j in range(min(per_group, len(idx)))]
        await self.call(op, lambda: run_all(job(a, idx) for a, idx in parts))
        return results

    async def exists_many(self, op: str, groups: Sequence[tuple[str, ...]]) -> list[int]:
        """How many keys of each group exist, one EXISTS per group; in a cluster a group's keys must share a
        slot (the lanes route a group by its first key)."""
        counts: list[Any] = [REDIRECTED] * len(groups)
        if self.lanes is not None:
            first = [g[0] for g in groups]
            counts = await self.on_lanes(op, first, lambda lane, idx: lane.exists([groups[i] for i in idx]), 1)
        todo = [i for i, n in enumerate(counts) if n == REDIRECTED]
        if todo:
            got = await self.pipelined(op, lambda pipe: [pipe.exists(*groups[i]) for i in todo])
            for i, n in zip(todo, got, strict=True):
                counts[i] = n
        return [int(n) for n in counts]
