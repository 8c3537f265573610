"""Redis store throughput by blob size, against redis-benchmark on the same private server, interleaved.

    python bench/store_redis.py [--mib 64] [--rounds 5] [--cluster] [--profile]

Starts a private redis-server (or, with ``--cluster``, a 3-node Redis Cluster on loopback) from
tests/redis_server.py. This VM's CPUs are shared and their speed swings within a minute, so every round measures
raw and store back to back: redis-benchmark SET/GET of 100 KB and of 1 MB values (50 clients, its default; the
round's raw figure is the better of the two sizes), then for each blob size ``--mib`` MiB of random blobs
written the way ``SnapshotStore.save`` does (``has_blobs``, ``touch_blobs`` of the present ones, ``put_blobs``
of the missing ones) and read back with ``get_blobs`` (sha256-verified), through a fresh ``RedisStore`` each
time. Prints JSON: medians over rounds of MB/s (10^6 bytes) and of the per-round ratios store / raw.
``--profile`` prints a cProfile of one save and one load of 80 KiB blobs instead. ``--without-sha256`` (analysis
only) replaces the store's hash checks by a no-op, so the difference shows what hashing costs here.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import importlib.util
import json
import os
import pstats
import re
import resource
import shutil
import statistics
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
RAW_SIZES = (100_000, 1_000_000)  # redis-benchmark value sizes; a round's raw figure is the better of the two


def redis_helpers() -> Any:
    """tests/redis_server.py, imported by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_bench_redis_server", REPO / "tests" / "redis_server.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sha256_MBps(size: int = 528384, total: int = 64 << 20) -> float:
    """sha256 speed of one thread here: every byte saved or loaded is hashed once by the store."""
    data = [os.urandom(size) for _ in range(total // size)]
    t = time.perf_counter()
    for b in data:
        hashlib.sha256(b).digest()
    return round(len(data) * size / (time.perf_counter() - t) / 1e6)


def server_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the redis-server processes have used so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


def redis_benchmark(
    port: int, pids: list[int], size: int, total_mb: int, cluster: bool, fresh: bool = False
) -> dict[str, Any]:
    """SET and GET of `size`-byte values (50 clients, redis-benchmark's default): MB/s, and CPU seconds per GB
    of redis-benchmark itself and of the server(s).

    redis-benchmark's plain SET overwrites one key ("key:__rand_int__") again and again and its GET reads that
    one value: the server reuses one allocation that stays in cache. A store never does that (every blob is a
    new key; a load reads distinct values), so with `fresh` the keys are drawn from a keyspace (`-r`): SET
    allocates a new value per key like a save, and GET reads a keyspace of distinct values filled first by a
    SET of five times as many requests (99.3% of keys present). The caller flushes these keys after."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    n = max(100, total_mb * 1_000_000 // size)
    space = ["-r", str(n // 5 if fresh else 0)] if fresh else []
    res: dict[str, Any] = {}
    for op in ("set", "get"):
        cmd = [exe, "-p", str(port), "-t", op, "-d", str(size), "-n", str(n), "-q", *space,
               *(["--cluster"] if cluster else [])]
        if fresh and op == "set":
            cmd[cmd.index("-r") + 1] = str(10**8)  # every SET a new key
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        s0 = server_cpu_s(pids)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        gb = n * size / 1e9
        m = re.search(rf"{op.upper()}: ([\d.]+) requests per second", out.replace("\r", "\n"))
        if m:
            res[op] = round(float(m.group(1)) * size / 1e6)
            res[f"{op}_client_cpu_s_per_GB"] = round((c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / gb, 2)
            res[f"{op}_server_cpu_s_per_GB"] = round((server_cpu_s(pids) - s0) / gb, 2)
        if fresh and op == "set":  # fill the GET keyspace: 5x its size in random SETs
            fill = [exe, "-p", str(port), "-t", "set", "-d", str(size), "-n", str(n), "-q", *space,
                    *(["--cluster"] if cluster else [])]
            subprocess.run(fill, capture_output=True, check=True)
    return res


def flush_benchmark_keys(ports: list[int]) -> None:
    """Drop redis-benchmark's keys ("key:*") so they do not weigh on the next measurement."""
    import redis

    for port in ports:
        r = redis.Redis(port=port)
        try:
            pipe = r.pipeline(transaction=False)
            for k in r.scan_iter(match="key:*", count=1000):
                pipe.delete(k)  # one key per DEL: a cluster node refuses keys of several slots in one
            pipe.execute()
        finally:
            r.close()


HASH_SAVES = False
"""--hash-saves: put_blobs hashes every blob again (verified=False); the engine names blobs by hashing them and
saves with verified=True, which is the default here."""


async def save_like_snapshot_store(store: RedisStore, blobs: dict[str, bytes]) -> None:
    """What SnapshotStore.save does with the blobs of a snapshot (the manifest commit is a few KiB more)."""
    stored = await store.has_blobs(blobs)
    await store.touch_blobs(stored)
    await store.put_blobs({d: b for d, b in blobs.items() if d not in stored}, verified=not HASH_SAVES)


async def one_size(url: str, pids: list[int], size: int, total: int) -> dict[str, float]:
    """Save and load MB/s of `total` bytes of random `size`-byte blobs, with this process's and the server(s)'
    CPU seconds per GB; the blobs are deleted after."""
    blobs = {}
    for _ in range(max(1, total // size)):
        b = os.urandom(size)
        blobs[digest(b)] = b
    gb = sum(map(len, blobs.values())) / 1e9
    out: dict[str, float] = {}

    def account(op: str, wall: float, client: float, server: float) -> None:
        out[f"{op}_MBps"] = gb * 1e3 / wall
        out[f"{op}_client_cpu_s_per_GB"] = client / gb
        out[f"{op}_server_cpu_s_per_GB"] = server / gb

    store = await RedisStore.open(url)
    try:
        t, c, sv = time.perf_counter(), time.process_time(), server_cpu_s(pids)
        await save_like_snapshot_store(store, blobs)
        account("save", time.perf_counter() - t, time.process_time() - c, server_cpu_s(pids) - sv)
    finally:
        await store.close()
    store = await RedisStore.open(url)
    try:
        t, c, sv = time.perf_counter(), time.process_time(), server_cpu_s(pids)
        got = await store.get_blobs(list(blobs))
        account("load", time.perf_counter() - t, time.process_time() - c, server_cpu_s(pids) - sv)
        assert got.keys() == blobs.keys()
        for d in blobs:  # keep the server's memory bounded between rounds
            await store.delete_blob(d)
    finally:
        await store.close()
    return out


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
    ap.add_argument("--mib", type=int, default=64, help="MiB written per blob size and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cluster", action="store_true", help="a 3-node Redis Cluster on loopback")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--hash-saves", action="store_true", help="put_blobs(verified=False): hash every blob saved")
    ap.add_argument(
        "--without-sha256", action="store_true",
        help="analysis only: replace the store's hash checks by a no-op, to show what they cost (the store "
        "itself always verifies)",
    )
    args = ap.parse_args()
    global HASH_SAVES
    HASH_SAVES = args.hash_saves
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
        if args.without_sha256:
            from kda_sessions.storage.backends import redis_bulk, redis_io

            async def no_check(items: Any, *, where: str) -> None:
                pass

            def no_check_bulk(items: Any, *, where: str) -> None:
                pass

            redis_io.verify = no_check  # type: ignore[assignment]
            redis_bulk.check_digests = no_check_bulk
        if args.profile:
            anyio.run(profile, url, args.mib * 1048576)
            return
        pids = [p.pid for p in procs]
        rounds: list[dict[Any, Any]] = []
        for _ in range(args.rounds):
            raw = {f"{d // 1000}KB": redis_benchmark(ports[0], pids, d, 1000, args.cluster) for d in RAW_SIZES}
            fresh = {}
            for d in RAW_SIZES:
                fresh[f"{d // 1000}KB"] = redis_benchmark(ports[0], pids, d, 1000, args.cluster, fresh=True)
                flush_benchmark_keys(ports)
            rnd: dict[Any, Any] = {
                "raw": raw,
                "raw_set": max(r.get("set", 0) for r in raw.values()),
                "raw_get": max(r.get("get", 0) for r in raw.values()),
                "fresh": fresh,
                "fresh_set": max(r.get("set", 0) for r in fresh.values()),
                "fresh_get": max(r.get("get", 0) for r in fresh.values()),
            }
            for kib in SIZES_KIB:
                rnd[kib] = anyio.run(one_size, url, pids, kib * 1024, args.mib * 1048576)
            rounds.append(rnd)

        def med(xs: Any, digits: int = 2) -> float:
            return round(statistics.median(xs), digits)

        rows = []
        for kib in SIZES_KIB:
            row: dict[str, Any] = {"blob_KiB": kib}
            for key in rounds[0][kib]:
                row[key] = med((r[kib][key] for r in rounds), 0 if key.endswith("MBps") else 2)
            if rounds[0]["raw_set"]:
                row["save_of_raw_set"] = med(r[kib]["save_MBps"] / r["raw_set"] for r in rounds)
                row["load_of_raw_get"] = med(r[kib]["load_MBps"] / r["raw_get"] for r in rounds)
            if rounds[0]["fresh_set"]:
                row["save_of_fresh_set"] = med(r[kib]["save_MBps"] / r["fresh_set"] for r in rounds)
                row["load_of_fresh_get"] = med(r[kib]["load_MBps"] / r["fresh_get"] for r in rounds)
            rows.append(row)
        raw_rows = {
            size: {key: med((r["raw"][size][key] for r in rounds), 0 if key in ("set", "get") else 2)
                   for key in rounds[0]["raw"][size]}
            for size in rounds[0]["raw"]
        }
        print(json.dumps({
            "store": "cluster of 3" if args.cluster else "single redis-server",
            "sha256_checks": not args.without_sha256,
            "mib_per_size": args.mib,
            "rounds": args.rounds,
            "redis_benchmark": {
                "set_MBps_median": med((r["raw_set"] for r in rounds), 0),
                "get_MBps_median": med((r["raw_get"] for r in rounds), 0),
                "by_value_size": raw_rows,
            },
            "redis_benchmark_fresh_keys": {
                "set_MBps_median": med((r["fresh_set"] for r in rounds), 0),
                "get_MBps_median": med((r["fresh_get"] for r in rounds), 0),
                "by_value_size": {
                    size: {key: med((r["fresh"][size][key] for r in rounds), 0 if key in ("set", "get") else 2)
                           for key in rounds[0]["fresh"][size]}
                    for size in rounds[0]["fresh"]
                },
            },
            "saves_hash": HASH_SAVES,
            "sizes": rows,
            "sha256_one_thread_MBps": sha256_MBps(),
            "cpus": os.cpu_count(),
            "loadavg_after": os.getloadavg(),
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
