"""Redis faults: kill -9 redis-server (AOF, appendfsync always) while a worker saves, restart it on the same
port and dir: every acked save loads, no manifest references a missing blob; while it is down calls fail fast
with StoreUnavailable. A server that may evict keys is refused unless the url allows it."""

from __future__ import annotations

import random
import time

import pytest
from redis_server import REDIS_SERVER, start_redis_server
from rel_helpers import Verifier, dangling_references, read_log, wait_for

import kda_sessions as ks
from kda_sessions.storage import StoreError, open_store

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not on PATH")


def _kill9(proc) -> None:
    proc.kill()
    proc.wait()


# redis-server kill -9 and restarts while the worker saves: 1 in the default run, 3 with -m slow
@pytest.mark.parametrize("outages", [1, pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"{n}-outages")
async def test_kill9_redis_during_saves_loses_no_acked_save(tmp_path, engine_zygote, outages):
    data = tmp_path / "redis"
    port, proc = start_redis_server(data, appendfsync="always")
    url = f"redis://127.0.0.1:{port}/0?timeout=1&lease_ttl=2"
    rng = random.Random(3)
    z = engine_zygote
    v = Verifier()
    fast_failures = 0
    in_step = False
    try:
        log = tmp_path / "worker0.log"
        pid = z.start({"store": url, "log": str(log), "sessions": 4, "rounds": 0, "seed": 3, "fault": None})
        assert wait_for(log, "ready", pid)
        probe = await open_store(url)
        for _ in range(outages):
            time.sleep(rng.uniform(0.3, 1.0))
            _kill9(proc)
            t0 = time.monotonic()
            with pytest.raises(ks.StoreUnavailable):
                await probe.get_manifest("sess0")
            fast_failures += time.monotonic() - t0 < 1.0
            time.sleep(0.3)
            _, proc = start_redis_server(data, port=port, appendfsync="always")
        time.sleep(1.0)  # let the worker save again after the last restart
        z.kill(pid)
        v.feed(read_log(log))
        log = tmp_path / "worker1.log"
        pid = z.start({"store": url, "log": str(log), "sessions": 4, "rounds": 0, "seed": 4, "fault": None,
                       "verify_only": True})
        z.wait(pid)
        in_step = True
        v.feed(read_log(log))
        await probe.close()
        print(f"\nredis kill -9: {outages} outages, {fast_failures} fast StoreUnavailable, counts {v.counts}")
        assert v.problems == []
        assert v.counts["resumed_at_ack"] + v.counts["resumed_in_flight"] == 4
        assert fast_failures == outages
        assert await dangling_references(url) == []
    finally:
        if not in_step:  # failed midway: the shared zygote's answers may be out of step, a fresh one replaces it
            z.close()
        _kill9(proc)


async def test_evicting_redis_is_refused_unless_allowed(tmp_path):
    port, proc = start_redis_server(tmp_path / "lru", extra_args=("--maxmemory-policy", "allkeys-lru"))
    try:
        with pytest.raises(StoreError, match="allow_eviction"):
            await open_store(f"redis://127.0.0.1:{port}/0")
        store = await open_store(f"redis://127.0.0.1:{port}/0?allow_eviction=1")
        await store.close()
    finally:
        _kill9(proc)
