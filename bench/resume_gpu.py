"""Save and resume through ``Engine`` on a CUDA device, beside the raw bandwidth of the same path and re-prefill.

    python3 bench/resume_gpu.py --out $OUT/resume_gpu.json            # on the device (see docs/benchmarks.md)
    python bench/resume_gpu.py --device cpu --contexts 2048 --shape tiny  # checks the script on a CPU

Models (``--shape``, several separated by commas), weights random (content does not change what a snapshot
costs), byte tokens:
  kimi  Kimi-Linear-48B-A3B's attention shapes, so its snapshot is exactly that model's size (20 KDA layers of
        32 heads x 128 x 128 fp32 state: 42 MB; 7 MLA layers of 512 + 64 bf16 latents: 7.9 KiB a token, pages of
        64 tokens = 504 KiB), D 2304, one small dense FFN (width 1024) instead of the MoE, so its prefill is
        faster than the 48B model's: the resume / re-prefill ratios here understate the real one;
  kimi48b  the whole Kimi-Linear-48B-A3B shape (bench/prefill_48b.py's model: 256 experts, top 8, vocabulary
        163,840 with the rows above the byte tokens zeroed): the same snapshot as ``kimi``, the real re-prefill
        (``kimi48b-quick``: its 4-layer narrow twin, to check the script on a CPU);
  2b    bench/e2e_gpu.py's 2 B hybrid (D 2048, 12 KDA layers of 16 heads x 128: 12.6 MB of state; 4 MLA layers:
        288 KiB pages; MoE of 16 experts, 2 a token, 1 shared; vocabulary 272 here, the byte tokens);
  tiny  the built-in tiny-random, to check the script.
A session's snapshot holds its pages, the head's state and one state per interval checkpoint (every
``checkpoint_interval_pages`` = 256 pages: 7 at 128K), ``snapshot`` gives the split.

For each context N (random byte tokens):
  prefill     a fresh session: ``append(N)`` + ``generate(1)``: the re-prefill time to first token, the second
              of two (the first of the process at N, of other tokens so that the prefix index holds none of
              the second's, compiles kernel variants: ``prefill_first_of_process_s``);
  save        ``save()`` of that session to a ``disk:`` store on the device's disk (durable when it returns);
  ram         the session dropped from the engine (slot and pages freed), blobs still in the RAM tier:
              ``resume`` + ``generate(1)``;
  disk_warm   a NEW engine (no RAM tier) on the same store, files in the page cache: ``resume`` + ``generate(1)``;
  disk_cold   the same after dropping the page cache (where the machine allows it).
Each resume row also gives the seconds spent in the store's ``load_blobs_into`` (read + sha256 into pinned
staging) and in the page codec's ``restore`` (those reads + queueing the device copies); ``encode_pages_s`` is the
bulk encode a save starts with (gather, copy to host, blobs, sha256) timed on its own before the save; the save
overlaps it with the write (blobs streamed into one pack), and ``save_marks_s`` gives the seconds from the save's
start to the first hit of each of the store's write steps (storage/faults.py: ``disk.blob.written`` = every blob
and the pack index written, ``disk.blob.fsynced``, ..., ``disk.manifest.done``) and of the producer's
(``stream.announce``: the pack's bound, at once; ``stream.close``: every blob put). ``save_spans_s``: per stage,
[first start, last end] from the save's start and ``busy`` seconds summed over threads: ``d2h`` (gather + copy
into pinned memory, a chunk at a time), ``page_hash`` (each page blob joined and hashed), ``small_hash`` (states,
partial pages, tokens encoded and hashed), ``write`` (the pack's write syscalls; ``write_GBps`` over its span),
``fsync`` (``disk.blob.written`` to ``disk.blob.fsynced``), ``commit`` (pack renamed to manifest durable).
Raw bandwidth of the same paths, same run: ``h2d`` (memcpy of the snapshot's bytes into pinned memory + one
host-to-device copy), ``read_warm`` / ``read_cold`` (the store's files read with 8 threads, page cache warm /
dropped), ``write_fdatasync`` (dd of the snapshot's size, one fdatasync at the end), and sha256 on 1 and on all
cores. ``*_GBps`` are 10^9 bytes / s of the snapshot's bytes.
``--write-sweep`` (in the run, at the largest snapshot's size) and ``--sweep-only GB`` (alone, no model) measure
the disk's durable-write ceiling beside the store's own pack writer (`write_sweep`): dd, O_DIRECT pwrites by 1-8
threads of 4-64 MiB blocks (one file, fallocated, a file per thread), and ``PackSet.write_stream``.
``--single-prefill``: one prefill per context, the process's first at that length, as the re-prefill figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import kda_sessions as ks
from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel
from kda_sessions.model.loader import BUILTIN_DIR
from kda_sessions.sessions import page_io, store_io
from kda_sessions.storage import SnapshotStore, faults
from kda_sessions.storage.backends import disk_pack
from kda_sessions.tokenizer import ByteTokenizer, builtin_template

KIMI_SHAPE: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 1024,
    "num_experts": 0,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}

E2E_2B_SHAPE: dict[str, Any] = {  # bench/e2e_gpu.py's config_dict("hybrid", quick=False, dense=False)
    # but the byte tokenizer's vocabulary (e2e_gpu's is 32768): the bench decodes its replies with that
    # tokenizer, which refuses ids above 271; a snapshot does not depend on the vocabulary
    "vocab_size": 272,
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 16,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 17) if i % 4],
        "full_attn_layers": [4, 8, 12, 16],
        "num_heads": 16,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}
SHAPES: dict[str, dict[str, Any]] = {
    "kimi": KIMI_SHAPE, "kimi48b": {}, "kimi48b-quick": {}, "2b": E2E_2B_SHAPE, "tiny": {},
}


def build_model(shape: str, device: str, dtype: torch.dtype) -> HybridModel:
    """The model of ``shape``: ``kimi48b`` (``-quick``: its 4-layer narrow twin, to check the script on a CPU) is
    bench/prefill_48b.py's whole model, MoE included, built in bf16; the others by `build_small`."""
    if shape.startswith("kimi48b"):
        import prefill_48b

        return prefill_48b.build_model(prefill_48b.config_48b(quick=shape.endswith("-quick")), device)
    return build_small(shape, device, dtype)


def build_small(shape: str, device: str, dtype: torch.dtype) -> HybridModel:
    """Random weights on ``device``, by the tiny-random rules (norms 1, A in [1, 16], projections of std
    1 / sqrt(fan_in)), drawn there from a seeded generator."""
    cfg = json.loads((BUILTIN_DIR / "tiny-random.json").read_text())
    cfg.update(SHAPES[shape])
    config = ModelConfig.model_validate(cfg)
    with torch.device("meta"):
        model = HybridModel(config)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g, device=device)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.5 - 2.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g, device=device) * std)
        for name, b in model.named_buffers():
            assert not b.is_meta, f"buffer {name} left on meta"
    return model.to(dtype).eval()


async def engine(model: HybridModel, store: str, ram_bytes: int, pages: int) -> ks.Engine:
    config = ks.EngineConfig(num_pages=pages, ram_tier_bytes=ram_bytes, max_active_sessions=4)
    snapshots = await SnapshotStore.open(store, ram_bytes=ram_bytes)
    return ks.Engine(model, "resume-bench", ByteTokenizer(), builtin_template(), snapshots, config, store)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def timed(coro: Any) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = await coro
    sync()
    return time.perf_counter() - t0, out


class Phases:
    """Seconds spent inside the steps of a resume, summed over calls: wraps methods on the instances of one
    engine. ``store_read``: the store's ``load_blobs_into`` (read + verify, into pinned staging), ``page_restore``:
    the page codec's ``restore`` (those reads plus queueing the device copies), ``load_pages``: all head pages
    (the partial one and the wait for the copies too), ``state``: the head state blob into its slot (read,
    pinned copy, device copy), ``restore_head``: those two, run together, ``load_session``: lease, manifest,
    tokens, ``manifest``: its read and validation, ``lease``, ``make_resident``: slot, pages, restore_head,
    ``run_locked``: calls on a worker thread under the pools' mutex (zeroing the slot, the partial page),
    ``decode_tokens``: the token blob checked and turned into a list."""

    def __init__(self, eng: ks.Engine) -> None:
        self.s: dict[str, float] = {}
        io = eng.io
        for name, obj, attr in (
            ("store_read", io.snapshots, "load_blobs_into"), ("page_restore", io.codec, "restore"),
            ("load_pages", io, "_load_pages"), ("state", io, "_restore_state"), ("restore_head", io, "restore_head"),
            ("load_session", io, "load_session"), ("manifest", io.snapshots, "load_manifest"),
            ("lease", io.snapshots, "acquire_lease"), ("make_resident", eng.manager.residency, "make_resident"),
            ("run_locked", io.pools, "run_locked"),
        ):
            if hasattr(obj, attr):
                self._wrap(name, obj, attr)
        self.s["decode_tokens"] = 0.0
        decode = store_io.decode_tokens

        def timed_decode(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return decode(*args)
            finally:
                self.s["decode_tokens"] += time.perf_counter() - t0

        store_io.decode_tokens = timed_decode  # type: ignore[assignment]
        self._decode = decode

    def _wrap(self, name: str, obj: Any, attr: str) -> None:
        fn = getattr(obj, attr)
        self.s[name] = 0.0

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.s[name] += time.perf_counter() - t0

        setattr(obj, attr, timed)
        self._undo = [*getattr(self, "_undo", []), (obj, attr)]

    def close(self) -> None:
        for obj, attr in getattr(self, "_undo", []):
            delattr(obj, attr)  # the instance attribute: the class's method shows through again
        store_io.decode_tokens = self._decode  # type: ignore[assignment]


class SaveTimeline:
    """The stages of one save, as ``save_spans_s`` (module docstring) and ``save_marks_s`` report them: wraps the
    page codec's staging of one engine, the module functions that hash blobs and write pack bytes, the store's
    fault points and the stream's announce / close, until ``close``."""

    def __init__(self, eng: ks.Engine) -> None:
        self.calls: dict[str, list[tuple[float, float, int]]] = {}
        self.marks: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._wrap(eng.io.codec, "_stage", "d2h")
        self._wrap(page_io, "_join_digest", "page_hash")
        self._wrap(store_io, "_encode_hash", "small_hash")
        self._wrap(disk_pack, "write_all", "write", sized=True)
        for name in ("announce", "close"):
            fn = getattr(store_io.BlobStream, name)

            def mark(stream: Any, *args: Any, _fn: Any = fn, _name: str = f"stream.{name}") -> Any:
                self.marks.setdefault(_name, time.perf_counter())
                return _fn(stream, *args)

            setattr(store_io.BlobStream, name, mark)
            self._undo.append((store_io.BlobStream, name, fn))
        faults.hook = lambda name: self.marks.setdefault(name, time.perf_counter())  # the first hit of each point
        self.t0 = time.perf_counter()

    def _wrap(self, obj: Any, attr: str, key: str, sized: bool = False) -> None:
        fn = getattr(obj, attr)
        calls = self.calls.setdefault(key, [])

        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:  # list.append is atomic: the hash threads share the list
                calls.append((t, time.perf_counter(), len(args[1]) if sized else 0))

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, None if isinstance(obj, page_io.PageCodec) else fn))

    def close(self) -> None:
        faults.hook = None
        for obj, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(obj, attr)  # the instance attribute: the class's method shows through again
            else:
                setattr(obj, attr, fn)

    def report(self) -> tuple[dict[str, float], dict[str, Any]]:
        """(save_marks_s, save_spans_s), seconds from the save's start."""
        at = lambda t: round(t - self.t0, 4)  # noqa: E731
        spans: dict[str, Any] = {}
        for key, calls in self.calls.items():
            if calls:
                data = [c for c in calls if c[2] != disk_pack.HEADER_BYTES] or calls  # from the first blob on
                a, b = min(c[0] for c in data), max(c[1] for c in calls)
                spans[key] = {"from": at(a), "to": at(b), "busy": round(sum(c[1] - c[0] for c in calls), 4),
                              "calls": len(calls)}
                if key == "write":
                    nbytes = sum(c[2] for c in calls)
                    spans[key].update(MB=round(nbytes / 1e6, 1), GBps=round(nbytes / (b - a) / 1e9, 2))
        m = self.marks
        for key, first, last in (("fsync", "disk.blob.written", "disk.blob.fsynced"),
                                 ("commit", "disk.blob.linked", "disk.manifest.done")):
            if first in m and last in m:
                spans[key] = {"from": at(m[first]), "to": at(m[last])}
        return {k: at(v) for k, v in sorted(m.items(), key=lambda kv: kv[1])}, spans


async def resume_first_token(eng: ks.Engine, sid: str) -> dict[str, Any]:
    phases = Phases(eng)
    try:
        sync()
        t0 = time.perf_counter()
        s = await eng.resume(sid)
        sync()
        t1 = time.perf_counter()
        r = await s.generate(max_tokens=1, ignore_eos=True)
        sync()
        t2 = time.perf_counter()
    finally:
        phases.close()
    assert r.usage.prefill_tokens <= 1, r.usage
    return {
        "resume_s": round(t1 - t0, 4), "first_token_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
        "in_s": {k: round(v, 4) for k, v in phases.s.items()},
    }


async def ram_resumes(eng: ks.Engine, sid: str, times: int) -> dict[str, Any]:
    """``times`` resumes from the RAM tier (forgotten between them): the median's row, with every total."""
    runs = []
    for _ in range(times):
        runs.append(await resume_first_token(eng, sid))
        assert await eng.default.forget(sid)
    runs.sort(key=lambda r: r["total_s"])
    return {**runs[len(runs) // 2], "totals_s": [r["total_s"] for r in runs]}


def hash_speed(device_threads: int) -> dict[str, float]:
    """GB/s of sha256 over 256 MiB in 512 KiB buffers, on 1 thread and on ``device_threads`` threads."""
    bufs = [os.urandom(1 << 19)] * 512
    out = {}
    for threads in (1, device_threads):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda b: hashlib.sha256(b).digest(), bufs))
        out[f"sha256_{threads}t_GBps"] = round(len(bufs) * len(bufs[0]) / (time.perf_counter() - t0) / 1e9, 2)
    return out


def raw_h2d(nbytes: int, device: str) -> float:
    """Seconds to copy ``nbytes`` of pageable host memory into pinned memory and on to the device."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        pinned.copy_(src)
        dst.copy_(pinned, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def raw_read(root: Path) -> tuple[float, int]:
    """Seconds to read every file under ``root`` with 8 threads (1 MiB preads), and the bytes read."""
    files = [p for p in root.rglob("*") if p.is_file()]

    def read(path: Path) -> int:
        n = 0
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        total = sum(ex.map(read, files))
    return time.perf_counter() - t0, total


@dataclass
class Redis:
    """A private redis-server of this run: its url, port, and redis-benchmark (None if absent)."""

    url: str
    port: int
    benchmark: str | None
    env: dict[str, str] | None


@contextlib.contextmanager
def start_redis(tmp: Path) -> Iterator[Redis | None]:
    """A private redis-server (tests/redis_server.py: $KDA_REDIS_SERVER or PATH), or None without one."""
    helpers = common.redis_helpers()
    if helpers.REDIS_SERVER is None:
        yield None
        return
    port, proc = helpers.start_redis_server(tmp / "redis")
    sibling = Path(helpers.REDIS_SERVER).with_name("redis-benchmark")
    bench = str(sibling) if sibling.exists() else shutil.which("redis-benchmark")
    try:
        yield Redis(f"redis://127.0.0.1:{port}/0?prefix=bench:", port, bench, helpers.redis_env())
    finally:
        helpers.stop_redis_server(proc)


async def copy_session(src_url: str, dst_url: str, sid: str) -> None:
    """The stored session ``sid`` (manifest and blobs) from one store into another."""
    src, dst = await SnapshotStore.open(src_url), await SnapshotStore.open(dst_url)
    try:
        m = await src.load_manifest(sid)
        await dst.save(m, await src.load_blobs(m.blob_digests()), verified=True)
    finally:
        await src.close()
        await dst.close()


def raw_get(port: int, keys: list[bytes], threads: int = 8, depth: int = 16) -> tuple[float, int]:
    """Seconds to GET ``keys`` over ``threads`` plain sockets, ``depth`` GETs in flight on each, every value
    received into one reused buffer (no parsing beyond the bulk header, no hash, no copy out), and the bytes."""

    def run(part: list[bytes]) -> int:
        n = 0
        buf = bytearray(8 << 20)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for i in range(0, len(part), depth):
                batch = part[i : i + depth]
                sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in batch))
                for _ in batch:
                    line = b""
                    while not line.endswith(b"\r\n"):
                        line += sock.recv(1)
                    if line == b"$-1\r\n":  # no such key: a blob larger than a chunk is stored in parts
                        continue
                    size = int(line[1:-2]) + 2
                    view = memoryview(buf)[:size]
                    while view:
                        view = view[sock.recv_into(view):]
                    n += size - 2
        return n

    parts = [keys[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(run, parts))
    return time.perf_counter() - t0, total


def redis_benchmark_get(r: Redis, size: int, total: int) -> float | None:
    """GB/s of redis-benchmark GETs of ``size``-byte values (50 clients, its default), ``total`` bytes."""
    if r.benchmark is None:
        return None
    n = max(100, total // size)
    out = subprocess.run([r.benchmark, "-p", str(r.port), "-t", "get", "-d", str(size), "-n", str(n), "-q"],
                         capture_output=True, text=True, check=True, env=r.env).stdout
    m = re.search(r"GET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    return round(float(m.group(1)) * size / 1e9, 2) if m else None


async def redis_row(model: HybridModel, disk_store: str, sid: str, pages: int, r: Redis) -> dict[str, Any]:
    """Resume + first token from Redis (a new engine, no RAM tier), beside GETs of the same keys and
    redis-benchmark."""
    await copy_session(disk_store, r.url, sid)
    eng = await engine(model, r.url, ram_bytes=0, pages=pages)
    try:
        row: dict[str, Any] = await resume_first_token(eng, sid)
        m = await eng.io.snapshots.load_manifest(sid)
        assert await eng.default.forget(sid)
    finally:
        await eng.close()
    keys = [f"bench:blob:{d}".encode() for d in sorted(m.blob_digests())]
    t, nbytes = raw_get(r.port, keys)
    row["raw"] = {"get_same_keys_GBps": round(nbytes / t / 1e9, 2), "redis_benchmark_get_GBps":
                  redis_benchmark_get(r, 516096, min(nbytes, 1 << 30))}
    return row


def _direct_raw(folder: Path, nbytes: int, threads: int, block: int, mode: str, src: memoryview) -> float:
    """GB/s of ``nbytes`` written in ``block``-byte pwrites by ``threads`` threads, then fsynced: ``mode`` "one"
    (one file, extended by the writes), "prealloc" (one file, fallocated first), "files" (a file per thread),
    each with O_DIRECT; "buffered": one file through the page cache."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    count = nbytes // block
    local = threading.local()

    def buf() -> memoryview:
        if not hasattr(local, "buf"):
            m = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
            m[:] = src[:block]
            local.buf = memoryview(m)
        return local.buf  # type: ignore[no-any-return]

    direct = 0 if mode == "buffered" else os.O_DIRECT
    nfiles = threads if mode == "files" else 1
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct
    os.sync()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: buf(), range(threads * 4)))  # buffers filled before the clock starts
        t0 = time.perf_counter()
        fds = [os.open(folder / f"f{i}", flags, 0o644) for i in range(nfiles)]
        try:
            if mode == "prealloc":
                os.posix_fallocate(fds[0], 0, count * block)
            per = count // nfiles

            def put(i: int) -> None:
                f, k = (i // per, i % per) if nfiles > 1 else (0, i)
                os.pwrite(fds[f], buf(), k * block)

            list(pool.map(put, range(per * nfiles)))
            list(pool.map(os.fsync, fds))
        finally:
            for fd in fds:
                os.close(fd)
        t = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    return round(per * nfiles * block / t / 1e9, 2)


def write_sweep(root: Path, nbytes: int) -> dict[str, Any]:
    """The disk's durable-write ceiling beside the store's own pack writer, ``nbytes`` each, GB/s (10^9 B/s):
    ``dd_fdatasync`` (dd bs=1M conv=fdatasync, first and last), ``direct`` (`_direct_raw`: O_DIRECT pwrites by
    threads x block MiB, one file / fallocated / a file per thread; one buffered row), and ``pack``: one pack of
    504 KiB blobs by the store's own ``PackSet.write_stream`` (temp file, writes with 1 MiB early writeback,
    fsync, rename, folder fsync), twice."""
    size = 516096
    count = nbytes // size
    src = memoryview(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy().data.cast("B"))
    per_src = len(src) // size
    blobs = [(f"{i:064x}", src[(i % per_src) * size : (i % per_src + 1) * size]) for i in range(count)]
    out: dict[str, Any] = {"bytes": count * size, "dir": str(root)}
    dd = ["if=/dev/zero", f"of={root / 'dd.bin'}", "bs=1M", f"count={nbytes >> 20}", "conv=fdatasync"]
    out["dd_fdatasync_first"] = round(common._dd(dd) / 1e3, 2)
    (root / "dd.bin").unlink(missing_ok=True)
    direct: dict[str, Any] = {}
    grid = [(t, b, "prealloc") for b in (4, 16, 64) for t in (1, 2, 4, 8)]
    grid += [(t, 16, "one") for t in (1, 4, 8)] + [(t, 16, "files") for t in (2, 4, 8)] + [(4, 16, "buffered")]
    for t, b, mode in grid:
        try:
            direct[f"{mode}_t{t}_{b}MiB"] = _direct_raw(root / "direct", count * size, t, b << 20, mode, src)
        except OSError as e:
            direct[f"{mode}_t{t}_{b}MiB"] = f"{type(e).__name__}: {e}"
    out["direct"] = direct
    pack: dict[str, Any] = {}
    folder = root / "sweep"
    for _ in range(2):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        ps = disk_pack.PackSet(folder)
        os.sync()
        t0 = time.perf_counter()
        ps.write_stream((blobs[i : i + 130] for i in range(0, count, 130)), lambda i: None, "tmp-")
        pack.setdefault("buffered", []).append(round(count * size / (time.perf_counter() - t0) / 1e9, 2))
    shutil.rmtree(folder, ignore_errors=True)
    out["pack"] = pack
    out["dd_fdatasync_last"] = round(common._dd(dd) / 1e3, 2)
    (root / "dd.bin").unlink(missing_ok=True)
    return out


async def one_context(
    model: HybridModel, shape: str, n: int, device: str, root: Path, redis: Redis | None, sweep: bool,
    save_only: bool = False, single_prefill: bool = False,
) -> dict[str, Any]:
    folder = root / f"store-{shape}-{n}"
    store = f"disk:{folder}"
    pages = n // 64 + 64
    row: dict[str, Any] = {"shape": shape, "tokens": n}
    eng = await engine(model, store, ram_bytes=max(8 << 30, n * (16 << 10)), pages=pages)  # the whole snapshot
    try:
        keys = ("prefill_first_of_process_s", "prefill_first_token_s")[save_only or single_prefill :]
        for key in keys:  # compiles by the first
            s = await eng.create_session()
            seed = n if key == "prefill_first_token_s" else n + 1  # other tokens: no index entry of theirs is shared
            t, _ = await timed(s.append(common.random_tokens(n, seed=seed)))
            t2, _ = (0.0, None) if save_only else await timed(s.generate(max_tokens=1, ignore_eos=True))
            if single_prefill:
                row["prefill_is_first_of_process"] = True
            row[key] = round(t + t2, 3)
            if key == "prefill_first_of_process_s":
                assert await eng.default.forget(s.id)
        st = s.state
        t, encoded = await timed(asyncio.to_thread(eng.io.codec.encode, st.pages[: st.num_cached // 64]))
        row["encode_pages_s"] = round(t, 4)  # gather + copy to host + blobs + sha256, what save's build does
        del encoded
        eng.pages.digests.clear()  # so that the save encodes every page again
        timeline = SaveTimeline(eng)
        try:
            t, res = await timed(s.save())
        finally:
            timeline.close()
        row["save_marks_s"], row["save_spans_s"] = timeline.report()
        m = await eng.io.snapshots.load_manifest(s.id)
        states = {m.head.state_blob} | {cp.state_blob for cp in m.checkpoints}
        row["snapshot"] = {"pages": len(m.head.pages), "states": len(states),
                           "interval_checkpoints": sum(cp.name.startswith("__at-") for cp in m.checkpoints)}
        snap = res.bytes_written
        row["snapshot_MB"] = round(snap / 1e6, 1)
        row["save_s"] = round(t, 4)
        row["save_GBps"] = round(snap / t / 1e9, 2)
        sid = s.id
        if not save_only:
            assert await eng.default.forget(sid)  # slot and pages freed; the store and the RAM tier keep it
            row["ram"] = await ram_resumes(eng, sid, 3)
    finally:
        await eng.close()
    if save_only:
        dd = ["if=/dev/zero", f"of={root / 'dd.bin'}", "bs=1M", f"count={snap >> 20}", "conv=fdatasync"]
        row["raw"] = {"write_fdatasync_GBps": round(common._dd(dd) / 1e3, 2)}
        (root / "dd.bin").unlink()
        return row
    eng = await engine(model, store, ram_bytes=0, pages=pages)
    try:
        row["disk_warm"] = await resume_first_token(eng, sid)
        assert await eng.default.forget(sid)
        row["cache_dropped"] = common.drop_page_cache()
        if row["cache_dropped"]:
            row["disk_cold"] = await resume_first_token(eng, sid)
    finally:
        await eng.close()
    if redis is not None:
        try:
            row["redis"] = await redis_row(model, store, sid, pages, redis)
        except Exception as e:  # the other rows still count
            row["redis_error"] = f"{type(e).__name__}: {e}"
    h2d = raw_h2d(snap, device)
    read_warm, nread = raw_read(folder)
    raw: dict[str, Any] = {"h2d_GBps": round(snap / h2d / 1e9, 2), "read_warm_GBps": round(nread / read_warm / 1e9, 2)}
    if common.drop_page_cache():
        read_cold, _ = raw_read(folder)
        raw["read_cold_GBps"] = round(nread / read_cold / 1e9, 2)
    raw["write_fdatasync_GBps"] = round(
        common._dd(["if=/dev/zero", f"of={root / 'dd.bin'}", "bs=1M", f"count={snap >> 20}", "conv=fdatasync"]) / 1e3, 2
    )
    (root / "dd.bin").unlink()
    if sweep:
        try:
            raw["pack_write"] = write_sweep(root, snap)
        except Exception as e:
            raw["pack_write"] = f"{type(e).__name__}: {e}"
    row["raw"] = raw
    row["save_of_raw_write"] = round(row["save_GBps"] / raw["write_fdatasync_GBps"], 2)
    for tier, path_GBps in (("ram", raw["h2d_GBps"]), ("disk_warm", min(raw["h2d_GBps"], raw["read_warm_GBps"])),
                            ("disk_cold", min(raw["h2d_GBps"], raw.get("read_cold_GBps", 0.0)))):
        if tier in row and path_GBps:
            got = snap / row[tier]["resume_s"] / 1e9
            row[tier]["resume_GBps"] = round(got, 2)
            row[tier]["of_raw_path"] = round(got / path_GBps, 2)
    if "redis" in row and "raw" in row["redis"]:
        got = snap / row["redis"]["resume_s"] / 1e9
        row["redis"]["resume_GBps"] = round(got, 2)
        raw_get = row["redis"]["raw"].get("get_same_keys_GBps")
        if raw_get:
            row["redis"]["of_raw_path"] = round(got / min(raw_get, raw["h2d_GBps"]), 2)
    row["prefill_over_ram_resume"] = round(row["prefill_first_token_s"] / row["ram"]["total_s"], 1)
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="kimi", help=f"one or more of {','.join(SHAPES)}, separated by commas")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--budget", type=float, default=240.0, help="start no new context after this many seconds")
    ap.add_argument("--warmup", type=int, default=16384, help="tokens of an untimed prefill first (0: none)")
    ap.add_argument("--write-sweep", action="store_true", help="the disk's write ceiling beside the store's pack "
                    "writer at the largest snapshot's size (`write_sweep`: raw.pack_write)")
    ap.add_argument("--save-only", action="store_true", help="per context one prefill (no token generated) and "
                    "its save, beside dd: no resumes, no re-prefill")
    ap.add_argument("--single-prefill", action="store_true", help="one prefill per context, the first of the "
                    "process at that length (kernel variants compiled inside it), as the re-prefill figure: a 1M row "
                    "in one device call")
    ap.add_argument("--sweep-only", type=float, metavar="GB", help="only `write_sweep` of this many GB (no model)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.sweep_only:
        with tempfile.TemporaryDirectory(dir=os.environ.get("RESUME_BENCH_DIR")) as tmp:
            sweep = write_sweep(Path(tmp), int(args.sweep_only * 1e9))
            common.emit({"machine": common.machine(), "write_sweep": sweep}, args.out)
        return
    t0 = time.monotonic()
    dtype = torch.bfloat16
    shapes = args.shape.split(",")
    if unknown := set(shapes) - set(SHAPES):
        ap.error(f"unknown shape(s) {sorted(unknown)}; choose from {sorted(SHAPES)}")
    result: dict[str, Any] = {
        "machine": common.machine(), "shapes": shapes, "dtype": str(dtype),
        "hash": hash_speed(os.cpu_count() or 1), "rows": [],
    }
    contexts = [int(x) for x in args.contexts.split(",")]
    with tempfile.TemporaryDirectory(dir=os.environ.get("RESUME_BENCH_DIR")) as tmp, start_redis(Path(tmp)) as redis:
        if redis is None:
            result["redis"] = "no redis-server (PATH or $KDA_REDIS_SERVER)"
        for shape in shapes:
            if time.monotonic() - t0 > args.budget:
                result.setdefault("skipped", []).extend(f"{shape}:{n}" for n in contexts)
                continue
            model = build_model(shape, args.device, dtype)
            if args.warmup:  # kernels compiled before any timed prefill
                eng = await engine(model, "memory:", ram_bytes=0, pages=args.warmup // 64 + 64)
                try:
                    s = await eng.create_session()
                    await s.append(common.random_tokens(args.warmup, seed=1))
                    await s.generate(max_tokens=2, ignore_eos=True)
                finally:
                    await eng.close()
            for n in contexts:
                if time.monotonic() - t0 > args.budget:
                    result.setdefault("skipped", []).append(f"{shape}:{n}")
                    continue
                sweep = args.write_sweep and shape == shapes[0] and n == max(contexts)
                row = await one_context(
                    model, shape, n, args.device, Path(tmp), redis, sweep, args.save_only, args.single_prefill
                )
                row["elapsed_s"] = round(time.monotonic() - t0, 1)
                result["rows"].append(row)
                common.emit(result, args.out)
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    common.emit(result, args.out)


if __name__ == "__main__":
    asyncio.run(main())
