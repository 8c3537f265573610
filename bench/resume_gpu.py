"""Save and resume through ``Engine`` on a CUDA device, beside the raw bandwidth of the same path and re-prefill.

    python3 bench/resume_gpu.py --out $OUT/resume_gpu.json            # on the device (see docs/benchmarks.md)
    python bench/resume_gpu.py --device cpu --contexts 2048 --shape tiny  # checks the script on a CPU

The model (``--shape kimi``) has Kimi-Linear-48B-A3B's attention shapes, so its snapshot is exactly that model's
size (20 KDA layers of 32 heads x 128 x 128 fp32 state, 7 MLA layers of 512 + 64 bf16 latents: 7.9 KiB a token,
pages of 64 tokens = 504 KiB), D 2304, with one small dense FFN (width 1024) instead of the MoE and a byte
vocabulary; weights random (content does not change what a snapshot costs). Its prefill is therefore faster than
the 48B model's: the resume / re-prefill ratios here understate the real one.

For each context N (random byte tokens):
  prefill     a fresh session: ``append(N)`` + ``generate(1)``: the re-prefill time to first token;
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
and the pack index written, ``disk.blob.fsynced``, ..., ``disk.manifest.done``).
Raw bandwidth of the same paths, same run: ``h2d`` (memcpy of the snapshot's bytes into pinned memory + one
host-to-device copy), ``read_warm`` / ``read_cold`` (the store's files read with 8 threads, page cache warm /
dropped), ``write_fdatasync`` (dd of the snapshot's size, one fdatasync at the end), and sha256 on 1 and on all
cores. ``*_GBps`` are 10^9 bytes / s of the snapshot's bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import kda_sessions as ks
from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel
from kda_sessions.model.loader import BUILTIN_DIR
from kda_sessions.storage import SnapshotStore, faults
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


def build_model(shape: str, device: str, dtype: torch.dtype) -> HybridModel:
    """Random weights on ``device``, by the tiny-random rules (norms 1, A in [1, 16], projections of std
    1 / sqrt(fan_in)), drawn there from a seeded generator."""
    cfg = json.loads((BUILTIN_DIR / "tiny-random.json").read_text())
    if shape == "kimi":
        cfg.update(KIMI_SHAPE)
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
    """Seconds spent inside the store's ``load_blobs_into`` (read + verify, into the pool or pinned staging)
    and the page codec's ``restore`` (all full pages: those reads plus queueing the device copies), summed
    over calls: wraps the two on the instances of one engine."""

    def __init__(self, eng: ks.Engine) -> None:
        self.store_s = self.pages_s = 0.0
        snapshots, codec = eng.io.snapshots, eng.io.codec
        load_into, restore = snapshots.load_blobs_into, codec.restore

        async def timed_load_into(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await load_into(*args)
            finally:
                self.store_s += time.perf_counter() - t0

        async def timed_restore(*args: Any) -> None:
            t0 = time.perf_counter()
            try:
                await restore(*args)
            finally:
                self.pages_s += time.perf_counter() - t0

        snapshots.load_blobs_into = timed_load_into  # type: ignore[method-assign]
        codec.restore = timed_restore  # type: ignore[method-assign]


async def resume_first_token(eng: ks.Engine, sid: str) -> dict[str, float]:
    phases = Phases(eng)
    sync()
    t0 = time.perf_counter()
    s = await eng.resume(sid)
    sync()
    t1 = time.perf_counter()
    r = await s.generate(max_tokens=1, ignore_eos=True)
    sync()
    t2 = time.perf_counter()
    assert r.usage.prefill_tokens <= 1, r.usage
    return {
        "resume_s": round(t1 - t0, 4), "first_token_s": round(t2 - t1, 4), "total_s": round(t2 - t0, 4),
        "in_store_read_s": round(phases.store_s, 4), "in_page_restore_s": round(phases.pages_s, 4),
    }


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


async def one_context(model: HybridModel, n: int, device: str, root: Path) -> dict[str, Any]:
    store = f"disk:{root / f'store-{n}'}"
    pages = n // 64 + 64
    row: dict[str, Any] = {"tokens": n}
    eng = await engine(model, store, ram_bytes=8 << 30, pages=pages)
    try:
        s = await eng.create_session()
        t, _ = await timed(s.append(common.random_tokens(n, seed=n)))
        t2, _ = await timed(s.generate(max_tokens=1, ignore_eos=True))
        row["prefill_first_token_s"] = round(t + t2, 3)
        st = s.state
        t, encoded = await timed(asyncio.to_thread(eng.io.codec.encode, st.pages[: st.num_cached // 64]))
        row["encode_pages_s"] = round(t, 4)  # gather + copy to host + blobs + sha256, what save's build does
        del encoded
        eng.pages.digests.clear()  # so that the save encodes every page again
        marks: dict[str, float] = {}
        faults.hook = lambda name: marks.setdefault(name, time.perf_counter())  # the first hit of each point
        t_start = time.perf_counter()
        try:
            t, res = await timed(s.save())
        finally:
            faults.hook = None
        row["save_marks_s"] = {k: round(v - t_start, 4) for k, v in marks.items()}
        snap = res.bytes_written
        row["snapshot_MB"] = round(snap / 1e6, 1)
        row["save_s"] = round(t, 4)
        row["save_GBps"] = round(snap / t / 1e9, 2)
        sid = s.id
        assert await eng.default.forget(sid)  # slot and pages freed; the store and the RAM tier keep it
        row["ram"] = await resume_first_token(eng, sid)
    finally:
        await eng.close()
    eng = await engine(model, store, ram_bytes=0, pages=pages)
    try:
        row["disk_warm"] = await resume_first_token(eng, sid)
        assert await eng.default.forget(sid)
        row["cache_dropped"] = common.drop_page_cache()
        if row["cache_dropped"]:
            row["disk_cold"] = await resume_first_token(eng, sid)
    finally:
        await eng.close()
    h2d = raw_h2d(snap, device)
    read_warm, nread = raw_read(root / f"store-{n}")
    raw: dict[str, Any] = {"h2d_GBps": round(snap / h2d / 1e9, 2), "read_warm_GBps": round(nread / read_warm / 1e9, 2)}
    if common.drop_page_cache():
        read_cold, _ = raw_read(root / f"store-{n}")
        raw["read_cold_GBps"] = round(nread / read_cold / 1e9, 2)
    raw["write_fdatasync_GBps"] = round(
        common._dd(["if=/dev/zero", f"of={root / 'dd.bin'}", "bs=1M", f"count={snap >> 20}", "conv=fdatasync"]) / 1e3, 2
    )
    (root / "dd.bin").unlink()
    row["raw"] = raw
    row["save_of_raw_write"] = round(row["save_GBps"] / raw["write_fdatasync_GBps"], 2)
    for tier, path_GBps in (("ram", raw["h2d_GBps"]), ("disk_warm", min(raw["h2d_GBps"], raw["read_warm_GBps"])),
                            ("disk_cold", min(raw["h2d_GBps"], raw.get("read_cold_GBps", 0.0)))):
        if tier in row and path_GBps:
            got = snap / row[tier]["resume_s"] / 1e9
            row[tier]["resume_GBps"] = round(got, 2)
            row[tier]["of_raw_path"] = round(got / path_GBps, 2)
    row["prefill_over_ram_resume"] = round(row["prefill_first_token_s"] / row["ram"]["total_s"], 1)
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["kimi", "tiny"], default="kimi")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--budget", type=float, default=240.0, help="start no new context after this many seconds")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.monotonic()
    dtype = torch.bfloat16
    model = build_model(args.shape, args.device, dtype)
    result: dict[str, Any] = {
        "machine": common.machine(), "shape": args.shape, "dtype": str(dtype),
        "hash": hash_speed(os.cpu_count() or 1), "rows": [],
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("RESUME_BENCH_DIR")) as tmp:
        for n in [int(x) for x in args.contexts.split(",")]:
            if time.monotonic() - t0 > args.budget:
                result.setdefault("skipped", []).append(n)
                continue
            result["rows"].append(await one_context(model, n, args.device, Path(tmp)))
            common.emit(result, args.out)
    common.emit(result, args.out)


if __name__ == "__main__":
    asyncio.run(main())
