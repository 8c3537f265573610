"""Redis store throughput by blob size, against redis-benchmark on the same private server in the same run.

    python bench/store_redis.py [--mib 128] [--repeat 3] [--cluster] [--profile]

Starts a private redis-server (or, with ``--cluster``, a 3-node Redis Cluster on loopback) from
tests/redis_server.py, measures raw SET/GET bandwidth of large values with redis-benchmark, then for each blob
size writes ``--mib`` MiB of random blobs the way ``SnapshotStore.save`` does (``has_blobs``, ``touch_blobs`` of
the present ones, ``put_blobs`` of the missing ones) and reads them back with ``get_blobs`` (sha256-verified),
through a fresh ``RedisStore`` each time. Prints JSON: MB/s (10^6 bytes) per size, best of ``--repeat``, and
each as a fraction of redis-benchmark's SET / GET figure. ``--profile`` prints a cProfile of one save and one
load of the 80 KiB size instead.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from kda_sessions.storage import digest
from kda_sessions.storage.backends.redis import RedisStore

REPO = Path(__file__).resolve().parent.parent
SIZES_KIB = (80, 516, 2048, 98304)  # a tiny-random page, a Kimi-Linear page, 2 MiB, a 96 MiB (chunked) blob


def redis_helpers() -> Any:
    """tests/redis_server.py, imported by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_bench_redis_server", REPO / "tests" / "redis_server.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def redis_benchmark(port: int, size: int, total_mb: int, cluster: bool) -> dict[str, float]:
    """SET and GET MB/s of `size`-byte values (50 clients, redis-benchmark's default)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    n = max(100, total_mb * 1_000_000 // size)
    cmd = [exe, "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n), "-q"]
    out = subprocess.run([*cmd, "--cluster"] if cluster else cmd, capture_output=True, text=True, check=True).stdout
    res: dict[str, float] = {}
    for line in out.replace("\r", "\n").splitlines():
        m = re.match(r"\s*(SET|GET): ([\d.]+) requests per second", line)
        if m:
            res[m.group(1).lower()] = round(float(m.group(2)) * size / 1e6)
    return res


async def save_like_snapshot_store(store: RedisStore, blobs: dict[str, bytes]) -> None:
    """What SnapshotStore.save does with the blobs of a snapshot (the manifest commit is a few KiB more)."""
    stored = await store.has_blobs(blobs)
    await store.touch_blobs(stored)
    await store.put_blobs({d: b for d, b in blobs.items() if d not in stored})


async def one_size(url: str, size: int, total: int, repeat: int) -> dict[str, Any]:
    best_put = best_get = 0.0
    for _ in range(repeat):
        blobs = {}
        for _ in range(max(1, total // size)):
            b = os.urandom(size)
            blobs[digest(b)] = b
        nbytes = sum(map(len, blobs.values()))
        store = await RedisStore.open(url)
        try:
            t = time.perf_counter()
            await save_like_snapshot_store(store, blobs)
            best_put = max(best_put, nbytes / (time.perf_counter() - t) / 1e6)
        finally:
            await store.close()
        store = await RedisStore.open(url)
        try:
            t = time.perf_counter()
            got = await store.get_blobs(list(blobs))
            best_get = max(best_get, nbytes / (time.perf_counter() - t) / 1e6)
            assert got.keys() == blobs.keys()
            del got
            for d in blobs:  # keep the server's memory bounded between rounds
                await store.delete_blob(d)
        finally:
            await store.close()
    return {"blob_KiB": size // 1024, "blobs": max(1, total // size), "save_MBps": round(best_put),
            "load_MBps": round(best_get)}


async def profile(url: str, total: int) -> None:
    blobs = {}
    for _ in range(total // (80 * 1024)):
        b = os.urandom(80 * 1024)
        blobs[digest(b)] = b
    store = await RedisStore.open(url)
    prof = cProfile.Profile()
    prof.enable()
    await save_like_snapshot_store(store, blobs)
    await store.get_blobs(list(blobs))
    prof.disable()
    await store.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128, help="MiB written per blob size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cluster", action="store_true", help="a 3-node Redis Cluster on loopback")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rs = redis_helpers()
    tmp = Path(tempfile.mkdtemp(prefix="store-redis-"))
    if args.cluster:
        ports, procs = rs.start_redis_cluster(tmp)
        url = f"redis://127.0.0.1:{ports[0]}?cluster=1"
    else:
        port, proc = rs.start_redis_server(tmp)
        ports, procs = [port], [proc]
        url = f"redis://127.0.0.1:{port}/0"
    try:
        if args.profile:
            anyio.run(profile, url, args.mib * 1048576)
            return
        raw = {f"{d // 1000}KB": redis_benchmark(ports[0], d, 300, args.cluster) for d in (100_000, 1_000_000)}
        rows = [anyio.run(one_size, url, kib * 1024, args.mib * 1048576, args.repeat) for kib in SIZES_KIB]
        raw_set = max(r.get("set", 0) for r in raw.values())
        raw_get = max(r.get("get", 0) for r in raw.values())
        for row in rows:
            row["save_of_raw_set"] = round(row["save_MBps"] / raw_set, 2) if raw_set else None
            row["load_of_raw_get"] = round(row["load_MBps"] / raw_get, 2) if raw_get else None
        print(json.dumps({
            "store": "cluster of 3" if args.cluster else "single redis-server",
            "redis_benchmark_MBps": raw,
            "sizes": rows,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }, indent=1))
    finally:
        if args.cluster:
            rs.stop_redis_cluster(procs)
        else:
            rs.stop_redis_server(procs[0])
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
