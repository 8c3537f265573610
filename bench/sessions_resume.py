"""Time to first token after resume vs after re-prefill, from the RAM tier, disk and Redis; snapshot size and
store throughput against the raw bandwidth of the same disk (dd) and Redis (redis-benchmark), one run.

    python bench/sessions_resume.py [--quick] [--out FILE]

For each model and context length N (random byte tokens, a fresh seed per N so nothing dedups):
  re-prefill  a fresh session: ``append(N tokens)`` + ``generate(max_tokens=1)``; that session is then saved
              (engine-level save: encode + hash + write);
  ram         the session is dropped from the engine (slot and pages released) but its blobs stay in the
              engine's RAM tier: ``resume(id)`` + ``generate(max_tokens=1)``;
  disk        a NEW engine on the same ``disk:`` store, OS page cache dropped first: resume + generate(1);
  redis       the snapshot copied into a private redis-server, a NEW engine on it: resume + generate(1).
Store throughput is measured on the storage layer (``SnapshotStore.save(verified=True)``, as the engine calls it, /
``load_blobs`` of the whole snapshot,
fresh store objects without a RAM tier, page cache dropped before disk reads). Redis: REDIS_ROUNDS rounds, each
right after redis-benchmark SET/GET of 1 MB values on the same server, with its one key and with fresh keys
(bench/store_redis.py says why both); medians of MB/s and of the per-round ratios.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import MIB, Timer

from kda_sessions.storage import SnapshotStore


async def ttft_resume(eng, sid: str) -> tuple[float, Any]:
    with Timer() as t:
        s = await eng.resume(sid)
        r = await s.generate(max_tokens=1, ignore_eos=True)
    return t.s, r


def forget(eng, sid: str) -> None:
    """Drop a session from the engine's memory (slot, pages, checkpoint states); the store keeps it."""
    st = eng.sessions.pop(sid)
    eng._release(st, keep_checkpoint_states=False)


def tier_hits(eng) -> int:
    tier = getattr(eng.io.snapshots.store, "tier", None)
    return tier.hits if tier is not None else -1


async def one_length(model, n: int, root: Path, redis_url: str | None, notes: list[str]) -> dict[str, Any]:
    disk_url = f"disk:{root / 'store'}"
    row: dict[str, Any] = {"tokens": n}
    eng = await common.open_engine(model, disk_url, notes)
    try:
        s = await eng.create_session()
        toks = common.random_tokens(n, seed=n)
        row["quiet"] = common.wait_quiet()
        with Timer() as t:
            u = await s.append(toks)
            r0 = await s.generate(max_tokens=1, ignore_eos=True)
        row["reprefill_s"] = t.s
        row["reprefill_cores"] = t.cores
        row["reprefill_prefill_tokens"] = u.prefill_tokens + r0.usage.prefill_tokens
        row["prefill_tok_per_s"] = n / t.s
        with Timer() as t:
            saved = await s.save()
        row["engine_save_s"] = t.s
        row["engine_save_MBps"] = saved.bytes_written / t.s / 1e6
        sid = s.id

        forget(eng, sid)
        h0 = tier_hits(eng)
        row["ram_s"], r_ram = await ttft_resume(eng, sid)
        row["ram_tier_hits"] = tier_hits(eng) - h0
        row["resume_prefill_tokens"] = r_ram.usage.prefill_tokens
        row["resume_cached_tokens"] = r_ram.usage.cached_tokens
        forget(eng, sid)
    finally:
        await eng.close()

    eng = await common.open_engine(model, disk_url, notes)
    try:
        row["disk_cache_dropped"] = common.drop_page_cache()
        row["disk_s"], r_disk = await ttft_resume(eng, sid)
    finally:
        await eng.close()

    # storage layer: whole-snapshot load / save throughput
    src = await SnapshotStore.open(disk_url)
    manifest = await src.load_manifest(sid)
    digests = sorted(manifest.blob_digests())
    common.drop_page_cache()
    with Timer() as t:
        blobs = await src.load_blobs(digests)
    await src.close()
    nbytes = sum(len(b) for b in blobs.values())
    row["snapshot_MiB"] = nbytes / MIB
    row["bytes_per_token"] = nbytes / n
    row["disk_load_MBps"] = nbytes / t.s / 1e6
    dst = await SnapshotStore.open(f"disk:{root / 'copy'}")
    with Timer() as t:
        await dst.save(manifest, blobs, verified=True)  # as the engine saves: blobs named by their own hash
    await dst.close()
    row["disk_save_MBps"] = nbytes / t.s / 1e6
    shutil.rmtree(root / "copy", ignore_errors=True)

    tokens = {"ram": r_ram.token_ids, "disk": r_disk.token_ids}
    if redis_url is not None:
        row.update(await redis_rounds(redis_url, manifest, blobs, digests))
        dst = await SnapshotStore.open(redis_url)  # the copy the new engine resumes from
        await dst.save(manifest, blobs, verified=True)
        await dst.close()
        eng = await common.open_engine(model, redis_url, notes)
        try:
            row["redis_s"], r_redis = await ttft_resume(eng, sid)
        finally:
            await eng.close()
        tokens["redis"] = r_redis.token_ids
    row["resumed_tokens_agree"] = len({tuple(v) for v in tokens.values()}) == 1
    for tier in ("ram", "disk", "redis"):
        if f"{tier}_s" in row:
            row[f"speedup_{tier}"] = row["reprefill_s"] / row[f"{tier}_s"]
    return row


REDIS_ROUNDS = 3
REDIS_PIDS: list[int] = []  # the private redis-server, for store_redis.redis_benchmark's CPU accounting


async def redis_rounds(redis_url: str, manifest: Any, blobs: dict[str, bytes], digests: list[str]) -> dict[str, Any]:
    """Whole-snapshot Redis save and load, each round right after redis-benchmark SET/GET of 1 MB values on
    the same server (one key, its default, and fresh keys, as a store writes): medians over REDIS_ROUNDS of
    MB/s and of the per-round ratios. Saves go to a scratch database, flushed after each round."""
    import redis
    import store_redis

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    scratch = redis_url.rsplit("/", 1)[0] + "/15"
    nbytes = sum(len(b) for b in blobs.values())
    per: dict[str, list[float]] = {}
    for _ in range(REDIS_ROUNDS):
        one = store_redis.redis_benchmark(port, REDIS_PIDS, 1_000_000, 500, False)
        fresh = store_redis.redis_benchmark(port, REDIS_PIDS, 1_000_000, 500, False, fresh=True)
        store_redis.flush_benchmark_keys([port])
        dst = await SnapshotStore.open(scratch)
        with Timer() as t:
            await dst.save(manifest, blobs, verified=True)
        await dst.close()
        save = nbytes / t.s / 1e6
        src = await SnapshotStore.open(scratch)
        with Timer() as t:
            await src.load_blobs(digests)
        await src.close()
        load = nbytes / t.s / 1e6
        redis.Redis(port=port, db=15).flushdb()
        for key, v in {
            "redis_save_MBps": save, "redis_load_MBps": load,
            "raw_redis_set_MBps": one["set"], "raw_redis_get_MBps": one["get"],
            "raw_redis_fresh_set_MBps": fresh["set"], "raw_redis_fresh_get_MBps": fresh["get"],
            "redis_save_of_set": save / one["set"], "redis_load_of_get": load / one["get"],
            "redis_save_of_fresh_set": save / fresh["set"], "redis_load_of_fresh_get": load / fresh["get"],
        }.items():
            per.setdefault(key, []).append(v)
    return {key: statistics.median(v) for key, v in per.items()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    notes: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="ksbench_resume_", dir=args.tmp))
    result: dict[str, Any] = {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "notes": notes}
    rs = common.redis_helpers()
    port, proc = rs.start_redis_server(root / "redis")
    REDIS_PIDS[:] = [proc.pid]
    try:
        result["raw_disk"] = common.raw_disk_bandwidth(root / "dd", mib=128 if args.quick else 512)
        result["raw_redis"] = common.raw_redis_bandwidth(port, total_mb=50 if args.quick else 200)
        models: dict[str, Any] = {"tiny-random": ("tiny-random", args.tiny_sizes, None)}
        if args.wider_sizes:
            models["wider"] = (common.build_wider(root / "wider-model"), args.wider_sizes, args.wider_max)
        result["models"] = {}
        for name, (model, sizes, limit) in models.items():
            rows = []
            for i, n in enumerate(sizes):
                if limit is not None and n > limit:
                    est = rows[-1]["reprefill_s"] * n / rows[-1]["tokens"] if rows else None
                    notes.append(f"{name} at {n} tokens skipped: re-prefill alone would take about "
                                 f"{est:.0f} s or more (linear estimate from {rows[-1]['tokens']})" if est else
                                 f"{name} at {n} tokens skipped")
                    continue
                t0 = time.perf_counter()
                # a different redis db per row keeps each engine's view small; the server is private
                row = await one_length(model, n, root / f"{name}-{n}", f"redis://127.0.0.1:{port}/{i % 16}", notes)
                row["row_wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"# {name} {n}: {({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})}",
                      file=sys.stderr, flush=True)
            result["models"][name] = rows
    finally:
        rs.stop_redis_server(proc)
        shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-random at 1K and 4K, wider at 1K")
    p.add_argument("--tiny-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384, 65536])
    p.add_argument("--wider-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[1024, 4096, 16384, 65536])
    p.add_argument("--wider-max", type=int, default=16384, help="skip wider-config lengths above this (time)")
    p.add_argument("--tmp", default="/tmp", help="folder for the disk store and the dd file (same disk)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.quick:
        common.MAX_WAIT_S = 5.0
        args.tiny_sizes, args.wider_sizes = [1024, 4096], [1024]
    common.emit(anyio.run(run, args), args.out)


if __name__ == "__main__":
    main()
