"""Disk store throughput by blob size: where the per-file cost stops dominating.

    python bench/store_blobs.py [--dir /tmp] [--mib 32]

Writes random blobs of several sizes through ``DiskStore.put_blobs`` (one batch, made durable with one
syncfs), drops the page cache (needs root; said in the output), reads them back cold with ``get_blobs``
(sha256-verified), and prints JSON with MB/s per size next to dd's raw figures for the same folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import anyio

from kda_sessions.storage import digest
from kda_sessions.storage.backends.disk import DiskStore


def drop_cache() -> bool:
    return os.system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null") == 0


def dd(folder: str, mib: int) -> dict[str, float]:
    path = os.path.join(folder, "dd.bin")
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"], check=True, capture_output=True)
    write = mib * 1048576 / (time.perf_counter() - t) / 1e6
    drop_cache()
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    read = mib * 1048576 / (time.perf_counter() - t) / 1e6
    os.unlink(path)
    return {"dd_write_fdatasync_MBps": round(write), "dd_read_cold_MBps": round(read)}


async def one(folder: str, size: int, total: int) -> dict[str, float]:
    blobs = {}
    for _ in range(max(1, total // size)):
        b = os.urandom(size)
        blobs[digest(b)] = b
    nbytes = sum(map(len, blobs.values()))
    store = await DiskStore.open(tempfile.mkdtemp(dir=folder))
    t = time.perf_counter()
    await store.put_blobs(blobs)
    put = nbytes / (time.perf_counter() - t) / 1e6
    cold = drop_cache()
    store = await DiskStore.open(store.root)
    t = time.perf_counter()
    await store.get_blobs(list(blobs))
    get = nbytes / (time.perf_counter() - t) / 1e6
    return {"blob_KiB": size // 1024, "blobs": len(blobs), "put_MBps": round(put), "get_MBps": round(get), "cold": cold}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=32)
    args = ap.parse_args()
    total = args.mib * 1048576
    rows = [anyio.run(one, args.dir, kib * 1024, total) for kib in (80, 256, 516, 2048)]
    print(json.dumps({"raw": dd(args.dir, 512), "sizes": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
