"""Decode through the public API at the Kimi-Linear-48B-A3B shape: ``Session.generate`` through ``Engine``, next
to the floor set by the bytes a step must read, the graph replays of the bare step, and the profiler's kernels.

Parts, each written to ``--out`` as it ends:
  engine    for each BATCHxCONTEXT of ``--cases``: BATCH fresh sessions, ``append`` CONTEXT random byte ids each
            (concurrently), one warm-up ``generate`` (captures the graph of that batch and width), then three
            times ``generate(1)`` and ``generate(1 + --steps)`` on every session at once (``ignore_eos``):
            the time per step is the difference of their medians over ``--steps`` (host work, sampling and
            detokenising included); with ``--decode-ahead off,on`` both settings of ``EngineConfig.decode_ahead``,
            alternated in each case, and with ``--sampling greedy,nucleus,...`` each sampling setting (``SAMPLINGS``)
            alternated too; with ``--host-times`` the host's parts of a step (``host_timers``: calls a
            token, median, 90th percentile and longest call, total a token); with ``--turns N,...`` agents' turns
            (``turn_times``: ``append`` N ids then ``generate(1)``, ms to the first token);
  replay    ``decode_48b.decode_case`` for ``--replay-cases``: back-to-back graph replays of ``model.decode`` over
            random pools (no prefill, so 1M fits in the time), in each of ``--replay-modes`` (``decode_48b``'s);
  profile   the eager step at 1 x ``--profile-context`` (8K) under the torch profiler (``decode_48b.profile_case``),
            with KDA's fused decode (``KDAAttention.fused_decode``) and with the separate kernels it replaces:
            kernels per step, top kernels;
            and the top kernels of graphed ``generate`` steps through the Engine (1 x ``--engine-profile-context``),
            (under the profiler a step stretches, 2.71 ms against 1.90 at 1 x 128K on an H100, so its timeline
            says little about where ``generate`` idles between steps: compare the step with the replay instead);
  prefill_2b  with ``--prefill-2b N``: the 2 B hybrid bench model of ``bench/e2e_gpu.py`` prefills N tokens through
            ``Engine`` (``append`` + ``generate(1)``, after a warm-up that compiles), tokens/s.

The floor (``decode_48b.floor_bytes``): every non-routed weight once, the chosen experts, latent KV, KDA states read
and written, at 4.8 TB/s. Model: ``prefill_48b.build_model`` (random bf16 weights built on the device).

    PYTHONUNBUFFERED=1 python3 bench/decode_engine_48b.py --prefill-2b 131072 --out $OUT/de.json   # on the device
    python bench/decode_engine_48b.py --quick --device cpu                                      # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_48b import decode_case, floor_bytes, profile_case
from prefill_48b import build_model, config_48b, prefill_once

from kda_sessions.api import Engine, open_snapshots
from kda_sessions.config import ModelConfig
from kda_sessions.engine.config import EngineConfig
from kda_sessions.model import HybridModel
from kda_sessions.model.kda import KDAAttention
from kda_sessions.tokenizer import ByteTokenizer, builtin_template

T0 = time.time()
P = 64


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class BenchTokenizer(ByteTokenizer):
    """The byte tokenizer, decoding ids past its vocabulary as nothing: a sampled (not greedy) draw from the random
    model may pick any of its ids (the lm_head rows past the tokenizer's are zero, not -inf)."""

    def decode(self, ids, *, skip_special: bool = False) -> str:  # type: ignore[no-untyped-def]
        return super().decode([i for i in ids if i < self.vocab_size], skip_special=skip_special)


async def open_engine(model: HybridModel, sessions: int, tokens: int, name: str) -> Engine:
    """An Engine over ``model`` with room for ``sessions`` sessions of ``tokens`` tokens each, memory store."""
    config = EngineConfig(max_active_sessions=sessions, num_pages=sessions * (-(-tokens // P) + 8) + 64, page_size=P,
                          max_checkpoints_in_memory=1)
    snapshots = await open_snapshots("memory:", config)
    return Engine(model, name, BenchTokenizer(), builtin_template(), snapshots, config)


SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "nucleus": {"temperature": 0.7, "top_p": 0.95},
    "top-k": {"temperature": 0.7, "top_k": 50},
    "seeded": {"temperature": 0.7, "top_p": 0.95, "seed": 0},
    "greedy-stop": {"temperature": 0.0, "stop": ["<|never|>"]},
    "nucleus-stop": {"temperature": 0.7, "top_p": 0.95, "stop": ["<|never|>"]},
    "nucleus-top5": {"temperature": 0.7, "top_p": 0.95, "logprobs": True, "top_logprobs": 5},
}
"""``--sampling``'s settings: greedy (the default), the nucleus and top-k settings agents commonly run, the
nucleus one with a seed (each session its own: ``seed`` + its index), which draws on a generator of its own, and
greedy and nucleus with a ``stop`` string (as OpenAI clients often send; one the random model never writes), which
the host looks for in every step's text, and nucleus with the 5 top logprobs of every token."""


async def generate_all(sessions: list, n: int, sampling: str = "greedy") -> float:
    """Seconds for ``generate(n)`` on every session at once (``SAMPLINGS[sampling]``, no early stop)."""
    kw = SAMPLINGS[sampling]
    t = time.perf_counter()
    replies = await asyncio.gather(*(
        s.generate(max_tokens=n, ignore_eos=True, **{**kw, **({"seed": kw["seed"] + i} if "seed" in kw else {})})
        for i, s in enumerate(sessions)))
    sync()
    assert all(r.usage.completion_tokens == n for r in replies), [r.usage.completion_tokens for r in replies]
    return time.perf_counter() - t


HOST_TIMED = [  # (module, class name or None, attribute): the host's parts of a graphed decode step
    ("kda_sessions.engine.runner", "Runner", "_launch"), ("kda_sessions.engine.runner", "Runner", "_finish_step"),
    ("kda_sessions.engine.runner", "Runner", "_going_on"), ("kda_sessions.engine.runner", None, "sample_batch_async"),
    ("kda_sessions.engine.runner", None, "postprocess"), ("kda_sessions.model.graphs", "DecodeGraphs", "_fill"),
    ("kda_sessions.model.graphs", "DecodeGraphs", "_feed"), ("kda_sessions.engine.sampler", "PendingSample", "result"),
    ("torch.cuda", "CUDAGraph", "replay"), ("kda_sessions.engine.undo", "StepUndo", "save"),
    ("kda_sessions.engine.postprocess", None, "hit_stop"),
]


@contextlib.contextmanager
def host_timers(durations: dict[str, list[float]]):
    """While open, every call of ``HOST_TIMED``'s functions appends its wall time (s) to ``durations`` under
    "Class.attribute" (a call's time includes any wait for the device or for the GIL)."""
    patched = []
    for mod_name, cls_name, attr in HOST_TIMED:
        owner = importlib.import_module(mod_name)
        if cls_name is not None:
            owner = getattr(owner, cls_name)
        fn = owner.__dict__[attr] if cls_name is not None else getattr(owner, attr)
        label = f"{cls_name or mod_name.rsplit('.', 1)[-1]}.{attr}"

        def timed(*a, __fn=fn, __label=label, **k):
            t = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                durations.setdefault(__label, []).append(time.perf_counter() - t)

        setattr(owner, attr, timed)
        patched.append((owner, attr, fn))
    try:
        yield
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)


def host_summary(durations: dict[str, list[float]], tokens: int) -> dict[str, dict[str, float]]:
    """Per timed function: calls a token, median / 90th percentile / longest call and total a token, us."""
    out = {}
    for label, d in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
        q = statistics.quantiles(d, n=10) if len(d) > 1 else [d[0]] * 9
        out[label] = {"calls_per_token": round(len(d) / tokens, 2), "median_us": round(statistics.median(d) * 1e6, 1),
                      "p90_us": round(q[8] * 1e6, 1), "max_us": round(max(d) * 1e6, 1),
                      "us_per_token": round(sum(d) / tokens * 1e6, 1)}
    return out


async def engine_case(engine: Engine, model: HybridModel, batch: int, L: int, steps: int,
                      ahead: tuple[bool, ...] = (False,), host_times: bool = False,
                      samplings: tuple[str, ...] = ("greedy",), capture_ab: bool = False,
                      turns: tuple[int, ...] = (), turn_profiles: tuple[int, ...] = (),
                      turn_befores: tuple[str, ...] = ("pending", "graphs")) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(L + batch)
    sessions = [await engine.create_session() for _ in range(batch)]
    t = time.perf_counter()
    await asyncio.gather(*(s.append(torch.randint(0, 256, (L,), generator=gen).tolist()) for s in sessions))
    sync()
    prefill_s = time.perf_counter() - t
    await generate_all(sessions, 2)  # captures the graphs of this batch and page-table width
    variants = [(a, smp) for smp in samplings for a in ahead]

    def label(a: bool, smp: str) -> str:
        return ("on" if a else "off") + ("" if samplings == ("greedy",) else f"/{smp}")

    one: dict[str, list[float]] = {label(*v): [] for v in variants}
    many: dict[str, list[float]] = {label(*v): [] for v in variants}
    for _ in range(3):  # medians: a call now and then also pays for other engine work (a checkpoint trim)
        for a, smp in variants:  # alternated, for an A/B within one run
            engine.runner.decode_ahead = a
            one[label(a, smp)].append(await generate_all(sessions, 1, smp))
            many[label(a, smp)].append(await generate_all(sessions, 1 + steps, smp))
    by = {k: (statistics.median(many[k]) - statistics.median(one[k])) / steps * 1e3 for k in one}
    step_ms = by[label(*variants[0])]
    host: dict[str, Any] = {}
    if host_times:  # one more generate(1 + steps) per setting, its host calls timed
        for a, smp in variants:
            engine.runner.decode_ahead = a
            durations: dict[str, list[float]] = {}
            with host_timers(durations):
                await generate_all(sessions, 1 + steps, smp)
            host[label(a, smp)] = host_summary(durations, batch * (1 + steps))
    requests: dict[str, float] = {}
    if capture_ab:  # a chat turn checkpoints its session twice (its input's end, its reply's end): state to host
        times: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(5):
            for mode in times:
                engine.runner.pools.async_capture = mode == "async"
                t = time.perf_counter()
                await asyncio.gather(*(s.send("go on", max_tokens=8, ignore_eos=True) for s in sessions))
                sync()
                times[mode].append(time.perf_counter() - t)
        engine.runner.pools.async_capture = True
        requests = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    turns_ms = await turn_times(sessions, turns, befores=turn_befores) if turns else {}
    profiles = {str(n): await turn_profile(sessions, n) for n in turn_profiles}
    floor = floor_bytes(model, batch, L)
    for s in sessions:
        await engine.delete_session(s.id)
    captures: dict[str, Any] = ({"gpu_gb_allocated": round(torch.cuda.memory_allocated() / 1e9, 2),
                                 "gpu_gb_reserved": round(torch.cuda.memory_reserved() / 1e9, 2)}
                                if torch.cuda.is_available() else {})
    captures |= {name: {"count": g.captures, "s": round(g.capture_s, 2)}
                for name, g in (("decode", engine.runner.graphs), ("prefill", engine.runner.prefill_graphs))
                if g is not None}
    return {"batch": batch, "context": L, "prefill_s": round(prefill_s, 2), "step_ms": round(step_ms, 3),
            "tok_per_s": round(batch * 1e3 / step_ms, 1), "floor_ms": round(floor["floor_ms"], 3),
            "floor_over_step": round(floor["floor_ms"] / step_ms, 3), "floor_bytes": floor,
            "step_ms_decode_ahead": {k: round(v, 3) for k, v in by.items()},
            "steps_queued_ahead": engine.runner.steps_ahead, **({"host_us": host} if host_times else {}),
            **({"chat_turn_ms_by_capture": requests} if capture_ab else {}),
            **({"first_token_ms_after_append": turns_ms} if turns else {}),
            **({"turn_profiles": profiles} if profiles else {}),
            "graph_captures_so_far": captures}


async def turn_profile(sessions: list, n: int, top: int = 25) -> dict[str, Any]:
    """One turn of ``turn_times`` (append n ids, generate(1)) under the torch profiler: its wall time, the device's
    busy time (kernels and copies), the kernels launched and the top kernels; the host's launch calls."""
    from torch.profiler import ProfilerActivity, profile

    ids = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for _ in sessions]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        await asyncio.gather(*(s.append(x) for s, x in zip(sessions, ids)))
        await generate_all(sessions, 1)
        wall = time.perf_counter() - t
    rows, host = [], {}
    busy = kernels = 0.0
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            busy += us
            kernels += e.count
            rows.append({"name": e.key[:90], "calls": e.count, "us": round(us, 1)})
        elif e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                       "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"):
            host[e.key] = {"calls": e.count, "us": round(e.cpu_time_total, 1)}
    rows.sort(key=lambda r: -r["us"])
    ops = sorted((e for e in prof.key_averages() if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA),
                 key=lambda e: -e.self_cpu_time_total)
    host_top = [{"name": e.key[:60], "calls": e.count, "self_us": round(e.self_cpu_time_total, 1)} for e in ops[:15]]
    return {"wall_ms": round(wall * 1e3, 2), "device_busy_ms": round(busy / 1e3, 2), "device_ops": int(kernels),
            "host_calls": host, "top": rows[:top], "host_top": host_top}


async def turn_times(sessions: list, turns: tuple[int, ...], reps: int = 3,
                     befores: tuple[str, ...] = ("pending", "graphs")) -> dict[str, float]:
    """An agent's turn on every session at once: ``append`` N ids (a tool's output), then ``generate(1)``: ms to
    the first token, median of ``reps``. N 0: ``generate(1)`` right after another (its prompt is the pending token
    alone), with that token run as a decode row (the library) and as a one-token prefill (``pending-as-prefill``,
    as before ``scheduler.pending_token_only``); N > 1 also with the KDA prefill reading its offsets back from the
    device each layer (``offsets-from-device``, as before 9f70b6e), and 1 < N <= ``mla.ABSORBED_MAX_TOKENS`` with
    the MLA prefill decompressing the cached rows (``mla-decompressed``, as before); N > 0 with the prefill step
    run eagerly, not replayed from a CUDA graph (``prefill-eager``: ``PrefillGraphs.accepts`` off; the offsets
    and mla variants run eagerly too); N > 16 with the MoE kernels' 64-row blocks from 257 pairs on
    (``moe-bm64``: ``triton_moe.SMALL_BLOCK_PAIRS_PER_EXPERT`` 0; its own prefill graphs, captured in the
    untimed round); N > 0 with the absorbed MLA's other head block (``mla-block32`` or ``mla-block64``:
    ``kernels.mla.HEAD_BLOCK``; its own prefill graphs too); N > 0 with the Gluon split kernel's head blocks of 64
    on the queries-on-N form (``mla-queries-on-n``: ``paged_decode_gluon.QUERIES_ON_M`` off; its own prefill graphs
    too); N > ``mla.ABSORBED_MAX_TOKENS`` with the decompressed MLA prefill's blocks unsplit (``mla-unsplit``: one
    program a query tile and head, ``prefill.SPLIT_TARGET_PROGRAMS`` 0); ``befores`` picks of the eight. Each variant runs once untimed first (graph captures, compiles)."""
    from kda_sessions.engine import scheduler as scheduler_module
    from kda_sessions.kernels import mla as mla_kernels
    from kda_sessions.kernels.mla import paged_decode_gluon, prefill
    from kda_sessions.kernels.moe import triton_moe
    from kda_sessions.model import kda as kda_module
    from kda_sessions.model import mla as mla_module
    from kda_sessions.model.prefill_graphs import PrefillGraphs

    gen = torch.Generator().manual_seed(7)
    real, chunk, absorbed = scheduler_module.pending_token_only, kda_module.chunk_kda, mla_module.ABSORBED_MAX_TOKENS
    accepts = PrefillGraphs.accepts

    def chunk_reading_offsets(*a: Any, **k: Any) -> Any:  # as before 9f70b6e: offsets read back from the device
        return chunk(*a, **{**k, "cu_seqlens_cpu": None})

    variants = [(n, "") for n in turns]
    if "pending" in befores and 0 in turns:
        variants.append((0, " pending-as-prefill"))
    if "offsets" in befores:
        variants += [(n, " offsets-from-device") for n in turns if n > 1]
    if "mla" in befores:
        variants += [(n, " mla-decompressed") for n in turns if 1 < n <= absorbed]
    if "graphs" in befores:
        variants += [(n, " prefill-eager") for n in turns if n > 0]
    if "moe" in befores:
        variants += [(n, " moe-bm64") for n in turns if n > 16]
    block, other_block = mla_kernels.HEAD_BLOCK, 32 if mla_kernels.HEAD_BLOCK == 64 else 64
    if "mla-block" in befores:
        variants += [(n, f" mla-block{other_block}") for n in turns if n > 0]
    if "mla-qm" in befores:
        variants += [(n, " mla-queries-on-n") for n in turns if n > 0]
    if "mla-split" in befores:
        variants += [(n, " mla-unsplit") for n in turns if n > absorbed]
    split_target = prefill.SPLIT_TARGET_PROGRAMS
    queries_on_m = paged_decode_gluon.QUERIES_ON_M
    runner = sessions[0].manager.core.runner
    graphs, small = runner.prefill_graphs, triton_moe.SMALL_BLOCK_PAIRS_PER_EXPERT

    def more_graphs(before: str) -> PrefillGraphs | None:
        return (PrefillGraphs(runner.model, runner.pools.tensors, capture_lock=runner.pools.mutex,
                              mempool=runner.graphs.mempool) if graphs is not None and before in befores else None)

    alt, alt_block, alt_qm = more_graphs("moe"), more_graphs("mla-block"), more_graphs("mla-qm")
    times: dict[str, list[float]] = {}
    for rep in range(reps + 1):
        for n, before in variants:
            if before in (" offsets-from-device", " mla-decompressed", " prefill-eager"):
                PrefillGraphs.accepts = lambda self, num_new, starts: False  # type: ignore[method-assign]
            if before == " moe-bm64":
                triton_moe.SMALL_BLOCK_PAIRS_PER_EXPERT = 0
                runner.prefill_graphs = alt
            if before == f" mla-block{other_block}":  # its own graphs, captured with that block in the first round
                mla_kernels.HEAD_BLOCK = other_block
                runner.prefill_graphs = alt_block
            if before == " mla-queries-on-n":
                paged_decode_gluon.QUERIES_ON_M = False
                runner.prefill_graphs = alt_qm
            if before == " pending-as-prefill":
                scheduler_module.pending_token_only = lambda w: False
            if before == " offsets-from-device":
                kda_module.chunk_kda = chunk_reading_offsets
            if before == " mla-decompressed":
                mla_module.ABSORBED_MAX_TOKENS = 0
            if before == " mla-unsplit":
                prefill.SPLIT_TARGET_PROGRAMS = 0
            try:
                t = time.perf_counter()
                if n:
                    await asyncio.gather(*(s.append(torch.randint(0, 256, (n,), generator=gen).tolist())
                                           for s in sessions))
                await generate_all(sessions, 1)
                if rep:
                    times.setdefault(f"{n}{before}", []).append(time.perf_counter() - t)
            finally:
                scheduler_module.pending_token_only, kda_module.chunk_kda = real, chunk
                PrefillGraphs.accepts = accepts  # type: ignore[method-assign]
                triton_moe.SMALL_BLOCK_PAIRS_PER_EXPERT, runner.prefill_graphs = small, graphs
                mla_module.ABSORBED_MAX_TOKENS = absorbed
                mla_kernels.HEAD_BLOCK = block
                paged_decode_gluon.QUERIES_ON_M = queries_on_m
                prefill.SPLIT_TARGET_PROGRAMS = split_target
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}


async def engine_profile(engine: Engine, L: int, steps: int, top: int = 20) -> dict[str, Any]:
    """Top kernels of graphed decode steps through ``generate`` (batch 1, context L), per step, and the profiled
    step's span (first start to last end over the step count: the profiler stretches a step)."""
    from torch.profiler import ProfilerActivity, profile

    s = await engine.create_session()
    await s.append(torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(5)).tolist())
    await generate_all([s], 2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await generate_all([s], steps)
    await engine.delete_session(s.id)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            rows.append({"name": e.key[:100], "calls_per_step": round(e.count / steps, 2),
                         "us_per_step": round(us / steps, 1)})
    rows.sort(key=lambda r: -r["us_per_step"])
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / steps if spans else 0.0
    return {"steps": steps, "kernels_per_step": round(sum(r["calls_per_step"] for r in rows), 1),
            "device_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
            "profiled_span_us_per_step": round(span, 1), "top": rows[:top]}


def set_fused_decode(model: HybridModel, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, KDAAttention):
            m.fused_decode = on


def config_2b(quick: bool) -> ModelConfig:
    """The hybrid 2 B bench model of ``bench/e2e_gpu.py`` (imported late: that script sets up its own imports)."""
    from e2e_gpu import config_dict

    return ModelConfig.from_dict(config_dict("hybrid", quick, False))


async def prefill_2b(N: int, quick: bool, device: str) -> dict[str, Any]:
    model = build_model(config_2b(quick), device)
    engine = await open_engine(model, 1, max(N, 8192 if not quick else 512), "e2e-2b-random")
    try:
        # compiles every prefill kernel variant (first, middle and last chunks, MLA prefill's blocks), as
        # prefill_48b does: a warm-up of one chunk left ~9 s of JIT inside the timed run (3,463 tok/s at 32K
        # against 106,000 warm, 2026-12-02)
        await prefill_once(engine, 40960 if not quick else 256, seed=0)
        # twice: the first N-token prefill of a process still compiles a few variants; the second is the rate
        first, pre = await prefill_once(engine, N, seed=N)
        dt, pre = await prefill_once(engine, N, seed=N + 1)
    finally:
        await engine.close()
    return {"N": N, "prefill_tokens": pre, "s": round(dt, 2), "tok_per_s": round(N / dt),
            "first_s": round(first, 2), "first_tok_per_s": round(N / first)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a small shape and contexts, to check the script")
    ap.add_argument("--cases", default="1x8192,1x131072,8x32768", help="Engine cases, BATCHxCONTEXT")
    ap.add_argument("--replay-cases", default="1x8192,1x131072,1x1048576,8x32768,32x32768")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per Engine case")
    ap.add_argument("--decode-ahead", default="on", choices=["off", "on", "off,on", "on,off"],
                    help="EngineConfig.decode_ahead in the Engine cases (on: the library default); two settings alternate "
                         "in each case")
    ap.add_argument("--sampling", default="greedy",
                    help=f"sampling settings of the Engine cases, alternated in each case with the decode-ahead ones: "
                         f"comma-separated of {', '.join(SAMPLINGS)} (SAMPLINGS)")
    ap.add_argument("--capture-ab", action="store_true",
                    help="also chat turns of 8 tokens (each checkpoints its session twice) with the states' copies to the "
                         "host waited for and not (Pools.async_capture), alternated")
    ap.add_argument("--turns", default="",
                    help="also agents' turns in each Engine case: append N ids then generate(1), ms to the first token, "
                         "for each comma-separated N (0: generate right after generate; also timed with the pending "
                         "token run as a one-token prefill, as before)")
    ap.add_argument("--turn-befores", default="pending,graphs",
                    help="the 'before' variants --turns also times (turn_times): of pending, offsets, mla, graphs, moe, "
                         "mla-block, mla-qm, mla-split")
    ap.add_argument("--turn-profile", default="", help="also profile one turn of each comma-separated N (turn_profile)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=0,
                    help="the longest chunk a prefill graph takes (prefill_graphs.PREFILL_GRAPH_MAX_TOKENS; 0: the "
                         "library's)")
    ap.add_argument("--prefill-graph-batch", type=int, default=0,
                    help="the most sequences of a prefill graph (prefill_graphs.PREFILL_GRAPH_MAX_BATCH; 0: the "
                         "library's)")
    ap.add_argument("--host-times", action="store_true",
                    help="also time the host's parts of a step in each Engine case (``host_timers``): one more "
                         "generate per decode-ahead setting")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed per replay case")
    ap.add_argument("--replay-modes", default="fused",
                    help="decode_48b modes timed in each replay case, e.g. fused,old-all,fused@2,old-all@2 for an "
                         "A/B of the step's options in the same process as the Engine cases")
    ap.add_argument("--prefill-2b", type=int, default=0, help="also prefill the 2 B bench model N tokens (0: no)")
    ap.add_argument("--profile-kda", default="separate,fused",
                    help="eager profiles at 1 x 8K, KDA decode 'separate' and/or 'fused' (the library's), in order")
    ap.add_argument("--profile-context", type=int, default=8192, help="context of the eager profiles (batch 1)")
    ap.add_argument("--engine-profile-context", type=int, default=8192,
                    help="context of the profile of generate's graphed steps (batch 1)")
    ap.add_argument("--layers", type=int, default=None,
                    help="only the first N layers at the real width (16 fits an 80 GB card)")
    ap.add_argument("--budget", type=float, default=420.0, help="start no new part after this many seconds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.prefill_graph_tokens:
        from kda_sessions.model import prefill_graphs

        prefill_graphs.PREFILL_GRAPH_MAX_TOKENS = args.prefill_graph_tokens
    if args.prefill_graph_batch:
        from kda_sessions.model import prefill_graphs

        prefill_graphs.PREFILL_GRAPH_MAX_BATCH = args.prefill_graph_batch
    res: dict[str, Any] = {"machine": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv)}

    def dump() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(res, indent=1))

    def part(name: str, fn) -> None:
        if time.time() - T0 > args.budget:
            res.setdefault("errors", {})[name] = "skipped: time budget"
            return
        try:
            res[name] = fn()
            log(f"{name}: {json.dumps(res[name])[:2000]}")
        except Exception as e:
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            log(f"{name} failed: {traceback.format_exc()}")
        dump()

    def cases(spec: str) -> list[tuple[int, int]]:
        out = [tuple(int(v) for v in c.split("x")) for c in spec.split(",") if c]
        return [(b, min(L, 300) if args.quick else L) for b, L in out]  # type: ignore[misc]

    t = time.perf_counter()
    model = build_model(config_48b(args.quick, args.layers), args.device)
    res["build_s"] = round(time.perf_counter() - t, 1)
    res["params_b"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    log(f"built {res['params_b']} B parameters in {res['build_s']} s")

    ahead = tuple(v == "on" for v in args.decode_ahead.split(","))
    samplings = tuple(v for v in args.sampling.split(",") if v)
    if not samplings or any(v not in SAMPLINGS for v in samplings):
        ap.error(f"--sampling: comma-separated of {', '.join(SAMPLINGS)}, got {args.sampling!r}")

    async def engine_parts() -> None:
        todo = cases(args.cases)
        turn_room = 4 * (2 + len(args.turn_befores.split(","))) * sum(  # every variant's turns, 3 timed rounds + 1
            int(v) + 1 for v in args.turns.split(",") if v)
        engine = await open_engine(model, max(b for b, _ in todo), max(L for _, L in todo) + args.steps + 8 + turn_room,
                                   "kimi-linear-48b-shape-random")
        try:
            for b, L in todo:
                try:
                    r = await engine_case(engine, model, b, L, args.steps, ahead, args.host_times, samplings,
                                          args.capture_ab, tuple(int(v) for v in args.turns.split(",") if v),
                                          tuple(int(v) for v in args.turn_profile.split(",") if v),
                                          tuple(v for v in args.turn_befores.split(",") if v))
                    res.setdefault("engine", []).append(r)
                    log(f"engine {b}x{L}: {json.dumps({k: v for k, v in r.items() if k != 'floor_bytes'})}")
                except Exception as e:
                    res.setdefault("errors", {})[f"engine {b}x{L}"] = f"{type(e).__name__}: {e}"
                    log(traceback.format_exc())
                dump()
            if cuda:
                try:
                    L = min(args.engine_profile_context, todo[0][1])
                    res[f"engine_profile_1x{L}"] = await engine_profile(engine, L, 16)
                except Exception as e:
                    res.setdefault("errors", {})["engine_profile"] = f"{type(e).__name__}: {e}"
                dump()
        finally:
            await engine.close()

    asyncio.run(engine_parts())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        for on in [m == "fused" for m in args.profile_kda.split(",") if m]:
            set_fused_decode(model, on)
            L = args.profile_context if not args.quick else 256
            part(f"profile_eager_1x{L}_kda_{'fused' if on else 'separate'}",
                 lambda L=L: profile_case(model, L, args.device, top=30))
        set_fused_decode(model, True)
    for b, L in cases(args.replay_cases):
        part(f"replay_{b}x{L}", lambda b=b, L=L: decode_case(model, b, L, args.replay_modes.split(","), args.reps,
                                                              args.device))
    if args.prefill_2b:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        part("prefill_2b", lambda: asyncio.run(prefill_2b(args.prefill_2b if not args.quick else 600, args.quick,
                                                           args.device)))
    dump()


if __name__ == "__main__":
    main()
