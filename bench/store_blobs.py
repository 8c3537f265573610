"""Disk store throughput by blob size against dd on the same folder, interleaved in one run.

    python bench/store_blobs.py [--dir /tmp] [--mib 32] [--rounds 5]
    python bench/store_blobs.py --save-pipeline [--mib 96] [--rounds 5]

This VM's disk and CPUs are shared and their speed swings several-fold within a minute, so every round
measures dd and the store back to back on the same bytes count: ``dd bs=1M conv=fdatasync`` of ``--mib``, then
``DiskStore.put_blobs`` of ``--mib`` of random blobs (one pack file at these counts, or loose files below
``PACK_MIN_BLOBS``); the page cache is dropped (needs root; said in the output), a cold ``dd`` read of the dd
file, the cache dropped again, then a cold ``get_blobs`` (sha256-verified) of the store's blobs. The JSON gives
the medians over rounds of each figure and of the per-round ratio store / dd.

``--save-pipeline``: the engine's save of ``--mib`` of full KV pages (tiny-random's pool filled with random
values), both ways, alternating which goes first, each into a fresh store folder beside ``dd`` of the same bytes:
``sequential`` encodes every page (copy + sha256 on threads: `PageCodec.encode`) and then writes them
(`put_blobs`, one pack), as saves did before streaming; ``streamed`` hands each chunk of pages to the store as it
is made (`BlobStream`, `put_blob_stream`: one pack written chunk by chunk). Durable at the end either way.
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

import kda_sessions as ks
from kda_sessions.storage import BlobStream, digest
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


async def save_pipeline(folder: str, mib: int, rounds: int) -> dict[str, object]:
    work = tempfile.mkdtemp(dir=folder)
    try:
        async with await ks.Engine.open(store=f"disk:{work}/engine", num_pages=4096) as eng:
            codec = eng.io.codec
            for kv in codec.pools.kv:
                kv.normal_()
            pages = list(range(1, 1 + min(4000, mib * 1048576 // codec.page_bytes)))
            nbytes = len(pages) * (codec.page_bytes + len(codec.header))

            async def sequential(store: DiskStore) -> None:
                blobs = await anyio.to_thread.run_sync(codec.encode, pages)
                await store.put_blobs(dict(blobs), verified=True)

            async def streamed(store: DiskStore) -> None:
                stream = BlobStream(len(pages))

                def produce() -> None:
                    for chunk in codec.encode_chunks(pages):
                        stream.put(chunk)
                    stream.close()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, produce)
                    await store.put_blob_stream(stream, verified=True)

            rows = []
            for i in range(rounds):
                row: dict[str, float] = {}
                order = [("sequential", sequential), ("streamed", streamed)]
                for name, fn in order if i % 2 == 0 else order[::-1]:
                    drop_cache()
                    store = await DiskStore.open(os.path.join(work, f"{name}-{i}"))
                    t = time.perf_counter()
                    await fn(store)
                    row[name] = nbytes / (time.perf_counter() - t) / 1e6
                    shutil.rmtree(store.root)
                drop_cache()
                row["dd_write"] = dd_write(os.path.join(work, "dd.bin"), nbytes >> 20)
                rows.append(row)
        return {
            "pages": len(pages), "page_KiB": round(codec.page_bytes / 1024, 1), "MB": round(nbytes / 1e6, 1),
            **{f"{k}_MBps": round(statistics.median(r[k] for r in rows)) for k in rows[0]},
            "streamed_over_sequential": round(statistics.median(r["streamed"] / r["sequential"] for r in rows), 2),
            "streamed_over_dd": round(statistics.median(r["streamed"] / r["dd_write"] for r in rows), 2),
            "rounds": [{k: round(v) for k, v in r.items()} for r in rows],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes-kib", default="80,256,516,2048")
    ap.add_argument("--pack-min-blobs", type=int, default=None, help=f"default {PACK_MIN_BLOBS}; a huge value = loose files")
    ap.add_argument("--save-pipeline", action="store_true", help="an engine save of --mib of pages, sequential vs streamed")
    args = ap.parse_args()
    if args.save_pipeline:
        print(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": os.cpu_count(),
            "loadavg_at_start": os.getloadavg(), **anyio.run(save_pipeline, args.dir, args.mib, args.rounds),
        }, indent=1))
        return
    sizes = [int(k) * 1024 for k in args.sizes_kib.split(",")]
    rows = [anyio.run(one_size, args.dir, s, args.mib, args.rounds, args.pack_min_blobs) for s in sizes]
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(), "mib": args.mib, "sizes": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
