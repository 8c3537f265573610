"""Time to first token after resume vs after re-prefill, from the RAM tier, disk and Redis; snapshot size and
store throughput against the raw bandwidth of the same disk (dd) and Redis (redis-benchmark), one run.

    python bench/sessions_resume.py [--quick] [--out FILE]
    python bench/sessions_resume.py --inflated 2048,16384 [--device cuda] [--parse-manifest-always]

``--inflated``: only RAM-tier resumes at many pages without a prefill (`inflated_row`): seconds a page, the steps
of a resume (the manifest's parse among them) and the full garbage collections inside it.

For each model and context length N (random byte tokens, a fresh seed per N so nothing dedups):
  re-prefill  a fresh session: ``append(N tokens)`` + ``generate(max_tokens=1)``; that session is then saved
              (engine-level save: encode + hash + write);
  ram         the session is dropped from the engine through its session manager (slot and pages released)
              but its blobs stay in the engine's RAM tier: ``resume(id)`` + ``generate(max_tokens=1)``
              (``ram_tier_misses`` 0: nothing came from disk);
  disk        a NEW engine on the same ``disk:`` store, OS page cache dropped first: resume + generate(1);
  disk_warm   the same with the store's files in the page cache;
  redis       the snapshot copied into a private redis-server, a NEW engine on it: resume + generate(1).
``{tier}_resume_MBps`` is the snapshot's bytes over the resume alone (without the first token), and
``{tier}_resume_of_raw`` its ratio to the raw path of the same run: a memcpy of as many bytes (ram), the store's
files read on 2 threads cold / warm (disk / disk_warm), redis-benchmark GET of fresh keys of the snapshot's mean
blob size (redis).
Store throughput is measured on the storage layer (``SnapshotStore.save(verified=True, expected_generation=0)``, as
the engine calls it: compare-and-set under the lease, / ``load_blobs`` of the whole snapshot,
fresh store objects without a RAM tier, page cache dropped before disk reads). Disk saves: DISK_ROUNDS rounds,
each right after ``dd bs=1M conv=fdatasync`` of the snapshot's own size in the same folder (one file, one flush at
the end, like the store's one pack), into a fresh store folder; medians of MB/s and of the per-round ratios (the
512 MiB dd at the start is reported too). ``save_phases`` / ``engine_save_phases``: where one save's time goes,
in ms between consecutive marks (store calls timed around them; the disk backend's steps by its fault points,
storage/faults.py, which mark every write, fsync, rename and folder fsync). Redis: REDIS_ROUNDS rounds, each
right after redis-benchmark SET/GET of 1 MB values on the same server, with its one key and with fresh keys
(bench/store_redis.py says why both); medians of MB/s and of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import MIB, Timer

from kda_sessions.sessions import store_io as engine_snapshots
from kda_sessions.storage import SnapshotStore, faults
from kda_sessions.storage.manifest import SessionManifest

DISK_ROUNDS = 3
SAVE_CALLS = ("has_blobs", "touch_blobs", "put_blobs", "put_manifest", "commit_manifest")


class Phases:
    """Marks of one save: ``<call`` / ``call>`` around the store's calls, fault point names in between, with
    times; ``segments()`` gives the ms between consecutive marks."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []
        self.hash_s = 0.0

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def segments(self) -> list[tuple[str, float]]:
        """(``from -> to``, ms) per pair of consecutive marks; runs of one label (a loose blob each) summed."""
        out: list[tuple[str, float]] = []
        runs: list[int] = []
        for (a, ta), (b, tb) in itertools.pairwise(self.marks):
            label = f"{a} -> {b}"
            if out and out[-1][0].split(" x ")[0] == label:
                runs[-1] += 1
                out[-1] = (f"{label} x {runs[-1]}", out[-1][1] + (tb - ta) * 1e3)
            else:
                out.append((label, (tb - ta) * 1e3))
                runs.append(1)
        return [(label, round(ms, 2)) for label, ms in out]

    @contextlib.contextmanager
    def watch(self, snapshots: SnapshotStore, io: Any = None):  # type: ignore[no-untyped-def]
        """Record the calls of ``snapshots.store`` and the fault points; with ``io`` (an engine's SnapshotIO)
        also its encode step (``_build``: tensors -> bytes + sha256, the hashing summed in ``hash_s``)."""
        store = snapshots.store
        patched: list[tuple[Any, str]] = []

        def timed(obj: Any, name: str, label: str) -> None:
            fn = getattr(obj, name)

            async def call(*a: Any, **k: Any) -> Any:
                self.mark(f"<{label}")
                try:
                    return await fn(*a, **k)
                finally:
                    self.mark(f"{label}>")

            setattr(obj, name, call)
            patched.append((obj, name))

        for name in SAVE_CALLS:
            timed(store, name, name)
        real_blob = engine_snapshots.blob
        if io is not None:
            build = io._build

            def timed_build(*a: Any) -> Any:
                self.mark("<encode+hash")
                try:
                    return build(*a)
                finally:
                    self.mark("encode+hash>")

            def timed_blob(data: bytes) -> Any:
                t = time.perf_counter()
                try:
                    return real_blob(data)
                finally:
                    self.hash_s += time.perf_counter() - t

            io._build = timed_build
            patched.append((io, "_build"))
            engine_snapshots.blob = timed_blob
        faults.hook = self.mark
        try:
            yield self
        finally:
            faults.hook = None
            engine_snapshots.blob = real_blob
            for obj, name in patched:
                delattr(obj, name)  # back to the class's method


def dd_same_size(folder: Path, nbytes: int) -> float:
    """MB/s of ``dd bs=1M conv=fdatasync`` of ``nbytes`` (rounded up to MiB) into one new file in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / "dd-same.bin"
    try:
        return common._dd(["if=/dev/zero", f"of={f}", "bs=1M", f"count={-(-nbytes // MIB)}", "conv=fdatasync"])
    finally:
        f.unlink(missing_ok=True)


async def ttft_resume(eng, sid: str, row: dict[str, Any] | None = None, tier: str = "") -> tuple[float, Any]:
    """Seconds of resume + first token; with ``row``, also ``{tier}_resume_s`` (resume alone)."""
    with Timer() as t:
        s = await eng.resume(sid)
        resumed = time.perf_counter() - t.t0
        r = await s.generate(max_tokens=1, ignore_eos=True)
    if row is not None:
        row[f"{tier}_resume_s"] = resumed
    return t.s, r


def raw_memcpy_s(nbytes: int) -> float:
    """Best of 3: seconds to copy ``nbytes`` between two buffers both touched before (torch, all threads)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def raw_read_s(root: Path, cold: bool) -> tuple[float, int]:
    """Seconds to read every file under ``root`` into reused 1 MiB buffers on 2 threads (page cache dropped
    first if ``cold``), and the bytes read."""
    files = [p for p in root.rglob("*") if p.is_file()]
    if cold:
        common.drop_page_cache()

    def read(path: Path) -> int:
        buf, n = bytearray(1 << 20), 0
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        total = sum(ex.map(read, files))
    return time.perf_counter() - t0, total


async def forget(eng, sid: str) -> None:
    """Drop a session from the engine's memory (slot, pages, checkpoint states); the store keeps it."""
    assert await eng.default.forget(sid)


def tier_hits(eng) -> int:
    tier = getattr(eng.io.snapshots.store, "tier", None)
    return tier.hits if tier is not None else -1


def tier_misses(eng) -> int:
    tier = getattr(eng.io.snapshots.store, "tier", None)
    return tier.misses if tier is not None else -1


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
        os.sync()  # the save starts with no dirty pages of the prefill's process behind it
        with Phases().watch(eng.io.snapshots, eng.io) as ph, Timer() as t:
            saved = await s.save()
        row["engine_save_s"] = t.s
        row["engine_save_MBps"] = saved.bytes_written / t.s / 1e6
        row["engine_save_hash_ms"] = round(ph.hash_s * 1e3, 2)
        row["engine_save_phases"] = ph.segments()
        sid = s.id

        await forget(eng, sid)
        h0, m0 = tier_hits(eng), tier_misses(eng)
        row["ram_s"], r_ram = await ttft_resume(eng, sid, row, "ram")
        # every blob from the tier, none from disk: the figure is the RAM tier's
        row["ram_tier_hits"], row["ram_tier_misses"] = tier_hits(eng) - h0, tier_misses(eng) - m0
        row["resume_prefill_tokens"] = r_ram.usage.prefill_tokens
        row["resume_cached_tokens"] = r_ram.usage.cached_tokens
        await forget(eng, sid)
    finally:
        await eng.close()

    for tier in ("disk", "disk_warm"):  # a new engine each time: page cache dropped, then warm
        eng = await common.open_engine(model, disk_url, notes)
        try:
            if tier == "disk":
                row["disk_cache_dropped"] = common.drop_page_cache()
            row[f"{tier}_s"], r_disk = await ttft_resume(eng, sid, row, tier)
        finally:
            await eng.close()
    store_dir = root / "store"
    read_cold, nread = raw_read_s(store_dir, cold=True)
    read_warm, _ = raw_read_s(store_dir, cold=False)
    row["raw_read_cold_MBps"], row["raw_read_warm_MBps"] = nread / read_cold / 1e6, nread / read_warm / 1e6

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
    per: dict[str, list[float]] = {}
    for i in range(DISK_ROUNDS):
        os.sync()
        dd = dd_same_size(root / "dd", nbytes)
        dst = await SnapshotStore.open(f"disk:{root / 'copy'}")
        os.sync()
        # as the engine saves: blobs named by their own hash, compare-and-set under the lease
        with Phases().watch(dst) as ph, Timer() as t:
            await dst.save(manifest, blobs, verified=True, expected_generation=0)
        await dst.close()
        shutil.rmtree(root / "copy", ignore_errors=True)
        save = nbytes / t.s / 1e6
        if i == 0:
            row["save_phases"] = ph.segments()
        for key, v in {"disk_save_MBps": save, "dd_same_size_MBps": dd, "disk_save_of_dd_same_size": save / dd}.items():
            per.setdefault(key, []).append(v)
    row.update({key: statistics.median(v) for key, v in per.items()})
    row["engine_save_of_dd_same_size"] = row["engine_save_MBps"] / row["dd_same_size_MBps"]
    row["disk_save_rounds_MBps"] = [round(v) for v in per["disk_save_MBps"]]

    tokens = {"ram": r_ram.token_ids, "disk": r_disk.token_ids}
    if redis_url is not None:
        row.update(await redis_rounds(redis_url, manifest, blobs, digests))
        dst = await SnapshotStore.open(redis_url)  # the copy the new engine resumes from
        await dst.save(manifest, blobs, verified=True)
        await dst.close()
        eng = await common.open_engine(model, redis_url, notes)
        try:
            row["redis_s"], r_redis = await ttft_resume(eng, sid, row, "redis")
        finally:
            await eng.close()
        tokens["redis"] = r_redis.token_ids
    row["resumed_tokens_agree"] = len({tuple(v) for v in tokens.values()}) == 1
    # resume (without the first token) in MB/s of the snapshot, against the raw path of the same run
    row["raw_memcpy_MBps"] = nbytes / raw_memcpy_s(nbytes) / 1e6
    raw_path = {"ram": "raw_memcpy_MBps", "disk": "raw_read_cold_MBps", "disk_warm": "raw_read_warm_MBps",
                "redis": "raw_redis_sized_get_MBps"}
    for tier, raw in raw_path.items():
        if f"{tier}_s" in row:
            row[f"speedup_{tier}"] = row["reprefill_s"] / row[f"{tier}_s"]
            row[f"{tier}_resume_MBps"] = nbytes / row[f"{tier}_resume_s"] / 1e6
            if raw in row:
                row[f"{tier}_resume_of_raw"] = row[f"{tier}_resume_MBps"] / row[raw]
    return row


REDIS_ROUNDS = 3
REDIS_PIDS: list[int] = []  # the private redis-server, for store_redis.redis_benchmark's CPU accounting


async def redis_rounds(redis_url: str, manifest: Any, blobs: dict[str, bytes], digests: list[str]) -> dict[str, Any]:
    """Whole-snapshot Redis save and load, each round right after redis-benchmark SET/GET of 1 MB values on
    the same server (one key, its default, and fresh keys, as a store writes, with 1 MB values and with the
    snapshot's mean blob size): medians over REDIS_ROUNDS of
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
        # the same kind of load as the save: fresh keys, values of this snapshot's mean blob size
        sized = store_redis.redis_benchmark(port, REDIS_PIDS, nbytes // len(blobs), 500, False, fresh=True)
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
            "raw_redis_sized_set_MBps": sized["set"], "raw_redis_sized_get_MBps": sized["get"],
            "redis_save_of_sized_set": save / sized["set"], "redis_load_of_sized_get": load / sized["get"],
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
                row["disk_save_of_dd_512MiB"] = row["disk_save_MBps"] / result["raw_disk"]["write_fdatasync_MBps"]
                rows.append(row)
                print(f"# {name} {n}: {({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})}",
                      file=sys.stderr, flush=True)
            result["models"][name] = rows
    finally:
        rs.stop_redis_server(proc)
        shutil.rmtree(root, ignore_errors=True)
    return result


PHASES = (("manifest", "snapshots", "load_manifest"), ("load_session", "io", "load_session"),
          ("store_read", "snapshots", "load_blobs_into"), ("page_restore", "codec", "restore"),
          ("restore_head", "io", "restore_head"))


async def inflated_row(pages: int, device: str, reps: int, tmp: str) -> dict[str, Any]:
    """RAM-tier resume of a tiny-random session of ``pages`` full KV pages of 64 tokens with an interval checkpoint
    every 256 pages, as the engine saves one (the manifest lists each checkpoint's pages: O(pages^2 / 256)). No
    prefill: a short session is saved, then its manifest is given random page blobs of the right header, random
    tokens and the checkpoints, and committed; the session is dropped and resumed ``reps`` times from the RAM tier
    (median row). ``in_s``: seconds inside each step (`PHASES`); ``gc2``: full collections during the resume."""
    import gc
    import random

    import kda_sessions as ks
    from kda_sessions.sessions.codec import encode_tokens
    from kda_sessions.sessions.prefix_index import prefix_key
    from kda_sessions.storage.blobs import digest
    from kda_sessions.storage.manifest import CheckpointRecord, SessionManifest

    P = 64
    with tempfile.TemporaryDirectory(dir=tmp) as folder:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16  # as the GPU tests run tiny-random
        async with await ks.Engine.open(store=f"disk:{folder}", device=device, dtype=dtype, page_size=P,
                                        num_pages=pages + 64, ram_tier_bytes=64 << 30) as eng:
            s = await eng.create_session()
            await s.append(list(range(40, 40 + 2 * P)))
            await s.save()
            io, sid = eng.io, s.id
            m = await io.snapshots.load_manifest(sid)
            rng = random.Random(pages)
            tokens = [rng.randrange(256) for _ in range(pages * P)]
            blobs: dict[str, bytes] = {}

            def add(data: bytes) -> str:
                blobs[digest(data)] = data
                return digest(data)

            ds = [add(io.codec.header + rng.randbytes(io.codec.page_bytes)) for _ in range(pages)]
            st = m.head.state_blob
            cps = [CheckpointRecord(name=f"__at-{k * P}", position=k * P, state_blob=st, pages=ds[:k], created_at=time.time())
                   for k in range(256, pages, 256)]
            meta = {**m.meta, "prefix_keys": {c.name: prefix_key(tokens, c.position, P).to_json() for c in cps}}
            big = SessionManifest.model_validate({**m.model_dump(), "num_tokens": pages * P, "meta": meta,
                                                  "tokens_blob": add(encode_tokens(tokens)),
                                                  "checkpoints": [c.model_dump() for c in cps],
                                                  "head": CheckpointRecord(name="head", position=pages * P, state_blob=st,
                                                                           pages=ds, created_at=time.time()).model_dump()})
            await forget(eng, sid)
            await io.snapshots.save(big, blobs, expected_generation=m.generation, verified=True)
            row: dict[str, Any] = {"pages": pages, "page_KiB": io.codec.page_bytes / 1024,
                                   "snapshot_MB": sum(map(len, blobs.values())) / 1e6,
                                   "manifest_MB": len(await io.snapshots.store.get_manifest(sid)) / 1e6}
            blobs.clear()
            runs = []
            for _ in range(reps):
                spent: dict[str, float] = {}
                gc2: list[float] = []
                objs = {"snapshots": io.snapshots, "io": io, "codec": io.codec}
                for name, where, attr in PHASES:
                    fn = getattr(objs[where], attr)

                    async def timed(*a: Any, _fn: Any = fn, _name: str = name, _spent: dict[str, float] = spent, **k: Any) -> Any:
                        t = time.perf_counter()
                        try:
                            return await _fn(*a, **k)
                        finally:
                            _spent[_name] = _spent.get(_name, 0.0) + time.perf_counter() - t

                    setattr(objs[where], attr, timed)

                def on_gc(phase: str, info: dict[str, Any], _gc2: list[float] = gc2) -> None:
                    if info["generation"] == 2:
                        _gc2.append(time.perf_counter() * (1 if phase == "stop" else -1))

                gc.callbacks.append(on_gc)
                try:
                    with Timer() as t:
                        r = await eng.resume(sid)
                finally:
                    gc.callbacks.remove(on_gc)
                    for _, where, attr in PHASES:
                        delattr(objs[where], attr)
                assert r.state.num_cached == pages * P
                runs.append({"resume_s": t.s, "in_s": spent, "gc2": len(gc2) // 2, "gc2_s": sum(gc2)})
                await forget(eng, sid)
            runs.sort(key=lambda x: x["resume_s"])
            row.update(runs[len(runs) // 2], resume_s_all=[x["resume_s"] for x in runs],
                       tier_misses=tier_misses(eng))
            row["us_per_page"] = row["resume_s"] / pages * 1e6
            return _rounded(row)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return [_rounded(v) for v in x] if isinstance(x, list) else x


async def run_inflated(args: argparse.Namespace) -> dict[str, Any]:
    if args.parse_manifest_always:  # A/B: every load parses the stored manifest
        SnapshotStore._parse = lambda self, sid, data, remember=True: SessionManifest.loads(data)  # type: ignore[method-assign]
    rows = []
    for n in args.inflated:
        rows.append(await inflated_row(n, args.device, args.reps, args.tmp))
        print(f"# {n} pages: {rows[-1]}", file=sys.stderr, flush=True)
    return {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "inflated": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-random at 1K and 4K, wider at 1K")
    p.add_argument("--tiny-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384, 65536])
    p.add_argument("--wider-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[1024, 4096, 16384, 65536])
    p.add_argument("--wider-max", type=int, default=16384, help="skip wider-config lengths above this (time)")
    p.add_argument("--tmp", default="/tmp", help="folder for the disk store and the dd file (same disk)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--inflated", type=lambda s: [int(x) for x in s.split(",")], metavar="PAGES,...",
                   help="only RAM-tier resumes of sessions of this many pages, made without prefill (`inflated_row`)")
    p.add_argument("--device", default="cpu", help="with --inflated: the engine's device")
    p.add_argument("--reps", type=int, default=3, help="with --inflated: resumes per size (median)")
    p.add_argument("--parse-manifest-always", action="store_true", help="with --inflated: no reuse of parsed manifests")
    args = p.parse_args()
    if args.inflated:
        common.emit(anyio.run(run_inflated, args), args.out)
        return
    if args.quick:
        common.MAX_WAIT_S = 5.0
        args.tiny_sizes, args.wider_sizes = [1024, 4096], [1024]
    common.emit(anyio.run(run, args), args.out)


if __name__ == "__main__":
    main()
