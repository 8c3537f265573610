"""Disk store throughput by blob size against dd on the same folder, interleaved in one run.

    python bench/store_blobs.py [--dir /tmp] [--mib 32] [--rounds 5]

This VM's disk and CPUs are shared and their speed swings several-fold within a minute, so every round
measures dd and the store back to back on the same bytes count: ``dd bs=1M conv=fdatasync`` of ``--mib``, then
``DiskStore.put_blobs`` of ``--mib`` of random blobs (one pack file at these counts, or loose files below
``PACK_MIN_BLOBS``); the page cache is dropped (needs root; said in the output), a cold ``dd`` read of the dd
file, the cache dropped again, then a cold ``get_blobs`` (sha256-verified) of the store's blobs. The JSON gives
the medians over rounds of each figure and of the per-round ratio store / dd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import anyio

from kda_sessions.storage import digest
from kda_sessions.storage.backends.disk import PACK_MIN_BLOBS, DiskStore


def drop_cache() -> bool:
    return os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null") == 0


def dd_write(path: str, mib: int) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"], check=True, capture_output=True)
    return mib * 1048576 / (time.perf_counter() - t) / 1e6


def dd_read(path: str, mib: int) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    return mib * 1048576 / (time.perf_counter() - t) / 1e6


async def one_round(folder: str, size: int, mib: int, pack_min_blobs: int | None) -> dict[str, float | bool]:
    blobs = {}
    for _ in range(max(1, mib * 1048576 // size)):
        b = os.urandom(size)
        blobs[digest(b)] = b
    nbytes = sum(map(len, blobs.values()))
    work = tempfile.mkdtemp(dir=folder)
    try:
        dd_path = os.path.join(work, "dd.bin")
        drop_cache()  # start every measurement with no dirty pages of the previous one
        row: dict[str, float | bool] = {"dd_write": dd_write(dd_path, mib)}
        store = await DiskStore.open(os.path.join(work, "store"), pack_min_blobs=pack_min_blobs)
        t = time.perf_counter()
        await store.put_blobs(blobs)
        row["put"] = nbytes / (time.perf_counter() - t) / 1e6
        row["cold"] = drop_cache()
        row["dd_read"] = dd_read(dd_path, mib)
        drop_cache()
        store = await DiskStore.open(store.root)
        t = time.perf_counter()
        got = await store.get_blobs(list(blobs))
        row["get"] = nbytes / (time.perf_counter() - t) / 1e6
        assert len(got) == len(blobs)
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def one_size(folder: str, size: int, mib: int, rounds: int, pack_min_blobs: int | None) -> dict[str, object]:
    rows = [await one_round(folder, size, mib, pack_min_blobs) for _ in range(rounds)]

    def med(key: str) -> int:
        return round(statistics.median(float(r[key]) for r in rows))

    def ratio(a: str, b: str) -> float:
        return round(statistics.median(float(r[a]) / float(r[b]) for r in rows), 2)

    n = max(1, mib * 1048576 // size)
    return {
        "blob_KiB": size // 1024, "blobs": n, "packed": n >= (pack_min_blobs or PACK_MIN_BLOBS),
        "put_MBps": med("put"), "dd_write_MBps": med("dd_write"), "put_over_dd": ratio("put", "dd_write"),
        "get_MBps": med("get"), "dd_read_MBps": med("dd_read"), "get_over_dd": ratio("get", "dd_read"),
        "cold": all(bool(r["cold"]) for r in rows),
        "rounds": [{k: round(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes-kib", default="80,256,516,2048")
    ap.add_argument("--pack-min-blobs", type=int, default=None, help=f"default {PACK_MIN_BLOBS}; a huge value = loose files")
    args = ap.parse_args()
    sizes = [int(k) * 1024 for k in args.sizes_kib.split(",")]
    rows = [anyio.run(one_size, args.dir, s, args.mib, args.rounds, args.pack_min_blobs) for s in sizes]
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(), "mib": args.mib, "sizes": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
