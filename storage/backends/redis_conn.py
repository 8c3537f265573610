"""Opening a Redis store url: its query options, the redis-py client (one server or a Redis Cluster), and the
checks made at connect (the server answers; it may not evict keys)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import StoreError, StoreUnavailable
from .base import DEFAULT_LEASE_TTL_S
from .redis_io import RedisIO

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kda:"
DEFAULT_TIMEOUT_S = 5.0


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class StoreUrl:
    """A store url taken apart: what RedisStore reads from its query, and the url left for redis-py."""

    client_url: str
    prefix: str
    timeout_s: float
    chunk_size: int
    lease_ttl_s: float
    allow_eviction: bool
    cluster: bool

    @classmethod
    def parse(cls, url: str, *, timeout_s: float, chunk_size: int) -> StoreUrl:
        """The query may set `prefix`, `timeout` (seconds), `chunk_size`, `lease_ttl` (seconds),
        `allow_eviction=1` and `cluster=1`; the rest (db, credentials, `protocol`, ...) goes to redis-py."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        cluster = _flag(query.pop("cluster", "0"))
        opts: dict[str, Any] = {
            "prefix": query.pop("prefix", DEFAULT_PREFIX),
            "timeout_s": float(query.pop("timeout", timeout_s)),
            "chunk_size": int(query.pop("chunk_size", chunk_size)),
            "lease_ttl_s": float(query.pop("lease_ttl", DEFAULT_LEASE_TTL_S)),
            "allow_eviction": _flag(query.pop("allow_eviction", "0")),
        }
        if cluster:
            if parts.path.strip("/") not in ("", "0"):
                raise ValueError(f"a Redis Cluster has only database 0, got {parts.path!r} in {url!r}")
            parts = parts._replace(path="")
        return cls(client_url=urlunsplit(parts._replace(query=urlencode(query))), cluster=cluster, **opts)

    def client(self) -> aioredis.Redis | RedisCluster:
        """A redis-py client with short timeouts, never decoding replies."""
        options: dict[str, Any] = {
            "socket_connect_timeout": self.timeout_s,
            "socket_timeout": self.timeout_s,
            "decode_responses": False,
        }
        if self.cluster:
            # One quick retry (a failover, a moved slot map); not redis-py's default of 3 with backoff up to
            # seconds, so a cluster that is down fails fast.
            retry = Retry(ExponentialBackoff(cap=0.2, base=0.05), retries=1)
            return RedisCluster.from_url(self.client_url, retry=retry, **options)
        return aioredis.Redis.from_url(self.client_url, retry_on_timeout=False, **options)


async def check_server(io: RedisIO, allow_eviction: bool) -> None:
    """StoreUnavailable if the server (every cluster primary) does not answer; StoreError if one may evict
    keys (`maxmemory-policy` other than noeviction) unless `allow_eviction`."""

    async def ping() -> None:
        if io.cluster:
            await io.r.initialize()  # discovers the nodes and the slot map
            await io.r.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            await io.r.ping()

    await io.call("ping", ping)
    nodes: list[Any] = io.r.get_primaries() if io.cluster else [None]
    for node in nodes:
        where = io.url if node is None else f"{io.url} (node {node.name})"
        try:
            if node is None:
                reply: dict[Any, Any] = await io.r.config_get("maxmemory-policy")
            else:
                reply = await io.r.config_get("maxmemory-policy", target_nodes=node)
        except ResponseError as e:  # CONFIG renamed or disabled (managed Redis): cannot check
            logger.warning("%s: cannot read maxmemory-policy (%s); make sure it is noeviction", where, e)
            continue
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError) as e:
            raise StoreUnavailable(f"{where}: config get failed: {e}") from e
        raw = reply.get(b"maxmemory-policy", reply.get("maxmemory-policy", b"noeviction"))
        policy = raw.decode() if isinstance(raw, bytes) else str(raw)
        if policy == "noeviction":
            continue
        if not allow_eviction:
            raise StoreError(
                f"{where}: maxmemory-policy is {policy!r}, so Redis may evict stored sessions; set it to "
                f"noeviction, or add ?allow_eviction=1 to the store url to accept losing sessions"
            )
        logger.warning("%s: maxmemory-policy is %r; sessions may be evicted (allowed by the url)", where, policy)
