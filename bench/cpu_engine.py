"""``tiny`` on this CPU through the Engine, beside ``HybridModel.step`` alone and the machine's floor.

    python bench/cpu_engine.py [--threads auto,1,2] [--reps 5] [--out FILE]

For each torch thread count (``OMP_NUM_THREADS`` of the process and ``EngineConfig.cpu_threads`` of the engine's
step thread; ``auto``: neither set, the engine's default as a user gets it) and each path, a fresh process: ``fast`` (the CPU paths of
``model/kda.py`` and ``model/mla.py``: fused projections, absorbed MLA decode) and ``reference`` (every attention
layer's ``fast_cpu`` off: separate linears and the kernels' naive twins, the path the fast one is tested against),
``compiled`` (``fast`` with ``EngineConfig.cpu_compile``: one-sequence decode steps as one torch.compile'd function)
and ``compiled-bf16`` (that, reading bfloat16 matmul weights: ``cpu_compile_weights="bfloat16"``):
- ``engine_decode``: one session holding 1,024 tokens generates 64 (greedy, ``ignore_eos``); tokens/s of the
  fastest of ``--reps`` runs, the process's CPU time per token in that run (all threads: less sensitive to other
  jobs on the machine than the wall time), the share of its wall time spent inside ``HybridModel.step`` and the
  step thread's torch threads.
- ``engine_prefill``: one fresh session appends 4,096 tokens (the engine runs them in steps of its prefill budget).
- ``engine_open_s``: from ``Engine.open`` to a first generated token (for the compiled paths, the compile; the
  inductor cache is whatever ``TORCHINDUCTOR_CACHE_DIR`` holds).
- ``step_decode``: ``HybridModel.step`` alone, one token per step at 1,024 tokens of context, as the engine calls it,
  on the process's torch threads: wall and CPU time (all threads) of the best block.
- ``ops``: torch operators per decode step (every ``aten::`` call the profiler records, nested ones included) and
  the matmuls among them: a count that does not depend on the machine's load.
- ``floor``: measured in the same process: a float32 matmul's GFLOP/s (512 x 512 x 512) and a 256 MiB copy's
  GB/s (read + write); decode's floor is the float32 weights read once per token at that rate, prefill's the
  FLOPs per token (2 x parameters) at that matmul rate.

The machine is shared: every figure is the best of ``--reps`` and comes with the 1-minute load average read
just before it (``os.getloadavg``), so a reader can tell a quiet run from a contended one.

    python bench/cpu_engine.py --against REF [--rounds 6] [--reps 3]

A/B against git ``REF`` in one process, for a change too small to see across runs on a shared machine: the library
at REF is exported beside the working tree's (renamed ``kda_ref``), an engine of each (default settings, ``tiny``)
runs ``--reps`` 64-token greedy generations at 1K context in turn, ``--rounds`` times, alternating which goes first;
tokens/s (best, median) and CPU ms a token of each, the load range, and whether both generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

PATHS = ["reference", "fast", "compiled", "compiled-bf16"]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def floor(model: Any) -> dict[str, Any]:
    import torch

    a = torch.randn(512, 512)
    best = min(_timed(lambda: a @ a) for _ in range(20))
    gflops = 2 * 512**3 / best / 1e9
    src = torch.randn(64 * common.MIB)  # 256 MiB of float32
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    gbs = 2 * src.numel() * 4 / best / 1e9
    params = common.model_params(model)
    return {"matmul_gflops": round(gflops, 1), "copy_gbs": round(gbs, 2), "params_M": round(params / 1e6, 2),
            "decode_floor_tok_s": round(gbs * 1e9 / (params * 4)), "prefill_floor_tok_s": round(gflops * 1e9 / (2 * params)),
            "load": _load()}


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def step_decode(model: Any, reps: int) -> dict[str, Any]:
    import torch
    from model_cpu import PooledRunner

    r = PooledRunner(model, 1, 1024 + (reps + 1) * 64 + 2)
    nxt = r.feed([0], [common.random_tokens(1024, seed=1)]).argmax(-1).tolist()
    best, best_cpu, load = float("inf"), float("inf"), _load()
    with torch.no_grad():
        for i in range(reps + 1):
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(64):
                nxt = r.feed([0], [nxt]).argmax(-1).tolist()
            if i:  # the first block warms up
                s, best_cpu = time.perf_counter() - t, min(best_cpu, time.process_time() - cpu)
                if s < best:
                    best, load = s, _load()
    return {"context": 1024, "ms_per_step": round(1000 * best / 64, 2), "cpu_ms_per_step": round(1000 * best_cpu / 64, 2),
            "tok_per_s": round(64 / best, 1), "load": load}


def ops_per_step(model: Any) -> dict[str, Any]:
    from model_cpu import PooledRunner
    from torch.profiler import profile

    r = PooledRunner(model, 1, 1200)
    nxt = r.feed([0], [common.random_tokens(1024, seed=1)]).argmax(-1).tolist()
    for _ in range(3):  # the first steps build what the rest reuse (fused weights, float16 packs)
        nxt = r.feed([0], [nxt]).argmax(-1).tolist()
    with profile() as prof:
        for _ in range(10):
            nxt = r.feed([0], [nxt]).argmax(-1).tolist()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    mm = sum(e.count for e in events if e.key in ("aten::mm", "aten::bmm", "aten::addmm"))
    return {"aten_calls": sum(e.count for e in events) // 10, "matmuls": mm // 10,
            "self_cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 10 / 1000, 2)}


async def engine_runs(reps: int, path: str, cpu_threads: int | None) -> dict[str, Any]:
    import torch

    import kda_sessions as ks
    from kda_sessions.model import HybridModel

    inside = {"s": 0.0}
    step = HybridModel.step

    def timed_step(self: HybridModel, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return step(self, *args)
        finally:
            inside["s"] += time.perf_counter() - t

    HybridModel.step = timed_step  # type: ignore[method-assign]
    toks = [(i * 31) % 250 for i in range(4096)]
    dec: dict[str, Any] = {"context": 1024, "tok_per_s": 0.0}
    pre: dict[str, Any] = {"tokens": 4096, "tok_per_s": 0.0}
    compiled = path.startswith("compiled")
    t = time.perf_counter()
    async with await ks.Engine.open(model="tiny", store="memory:", device="cpu", cpu_threads=cpu_threads,
                                    cpu_compile=compiled,
                                    cpu_compile_weights="bfloat16" if path == "compiled-bf16" else "model") as engine:
        set_fast(engine.model, path != "reference")
        s = await engine.create_session()
        await s.append(toks[:16])
        await s.generate(max_tokens=1, ignore_eos=True)
        opened = round(time.perf_counter() - t, 2)
        await engine.delete_session(s.id)
        dec["step_threads"] = engine.core.runner.cpu_threads or torch.get_num_threads()
        for _ in range(reps + 1):
            s = await engine.create_session()
            load = _load()
            t = time.perf_counter()
            await s.append(toks)
            rate = 4096 / (time.perf_counter() - t)
            if rate > pre["tok_per_s"]:
                pre.update(tok_per_s=round(rate), load=load)
            await engine.delete_session(s.id)
            s = await engine.create_session()
            await s.append(toks[:1024])
            load, inside["s"] = _load(), 0.0
            t, cpu = time.perf_counter(), time.process_time()
            r = await s.generate(max_tokens=64, ignore_eos=True)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            n = len(r.token_ids)
            if n / wall > dec["tok_per_s"]:
                dec.update(tok_per_s=round(n / wall, 1), ms_per_token=round(1000 * wall / n, 2),
                           cpu_ms_per_token=round(1000 * cpu / n, 2), in_step=round(inside["s"] / wall, 3), load=load)
            await engine.delete_session(s.id)
        runner = engine.core.runner
        tuner = runner.step_threads
        lane = tuner.lanes.get(1) if tuner is not None else None
        dec["decode_threads"] = lane.current if lane is not None else runner.cpu_decode_threads
        if lane is not None:  # the median step the choice rests on, per count
            dec["decode_step_ms"] = {str(k): round(1000 * v, 2) for k, v in sorted(lane.figure.items())}
    return {"engine_decode": dec, "engine_prefill": pre, "engine_open_s": opened}


def export_ref(ref: str, into: Path) -> str:
    """The library at git ``ref`` as package ``kda_ref`` under ``into`` (its kernels and storage inside it, as the
    editable install maps them; every ``kda_sessions`` name in its sources renamed), importable beside this tree's."""
    name = "kda_ref"
    tar = subprocess.run(["git", "archive", ref, "kda_sessions", "kernels", "storage"], cwd=common.REPO,
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    pkg = into / name
    (into / "kda_sessions").rename(pkg)
    for part in ("kernels", "storage"):
        (into / part).rename(pkg / part)
    for f in pkg.rglob("*.py"):
        f.write_text(f.read_text().replace("kda_sessions", name))
    return name


async def against(ref_pkg: str, rounds: int, reps: int) -> dict[str, Any]:
    import importlib

    import kda_sessions

    libs = {"ref": importlib.import_module(ref_pkg), "tree": kda_sessions}
    toks = [(i * 31) % 250 for i in range(1024)]
    engines = {k: await lib.Engine.open(model="tiny", store="memory:", device="cpu") for k, lib in libs.items()}
    rates: dict[str, list[float]] = {k: [] for k in libs}
    cpu: dict[str, list[float]] = {k: [] for k in libs}
    out: dict[str, list[int]] = {}
    loads = []
    try:
        for e in engines.values():  # warm-up
            s = await e.create_session()
            await s.append(toks[:16])
            await s.generate(max_tokens=8, ignore_eos=True)
            await e.delete_session(s.id)
        for r in range(rounds):
            for k in (["ref", "tree"] if r % 2 == 0 else ["tree", "ref"]):
                for _ in range(reps):
                    s = await engines[k].create_session()
                    await s.append(toks)
                    loads.append(_load())
                    t, c = time.perf_counter(), time.process_time()
                    res = await s.generate(max_tokens=64, ignore_eos=True)
                    wall, c = time.perf_counter() - t, time.process_time() - c
                    rates[k].append(len(res.token_ids) / wall)
                    cpu[k].append(1000 * c / len(res.token_ids))
                    out[k] = res.token_ids
                    await engines[k].delete_session(s.id)
    finally:
        for e in engines.values():
            await e.close()
    summary: dict[str, Any] = {"context": 1024, "tokens": 64, "runs_each": rounds * reps,
                               "load": [min(loads), max(loads)], "same_tokens": out["ref"] == out["tree"]}
    for k in libs:
        v = sorted(rates[k])
        summary[k] = {"best_tok_s": round(v[-1], 1), "median_tok_s": round(v[len(v) // 2], 1),
                      "min_cpu_ms_per_token": round(min(cpu[k]), 3), "median_cpu_ms_per_token": round(sorted(cpu[k])[len(v) // 2], 3)}
    return summary


def set_fast(model: Any, on: bool) -> None:
    for m in model.modules():  # attention layers and dense FFNs
        if hasattr(m, "fast_cpu"):
            m.fast_cpu = on


def child(reps: int, path: str, auto: bool) -> dict[str, Any]:
    import anyio
    import torch

    from kda_sessions.model import load_model

    threads = torch.get_num_threads()
    out: dict[str, Any] = {"threads": "auto" if auto else threads, "path": path}
    # the engine first, as a user's process runs it: before this thread runs torch on several threads (its OpenMP
    # team would leave the step thread's more threads than cores: EngineConfig.cpu_decode_threads)
    out.update(anyio.run(engine_runs, reps, path, None if auto else threads))
    model = load_model("tiny")
    set_fast(model, path != "reference")
    out["floor"] = floor(model)
    if path.startswith("compiled"):
        model.compile_cpu_decode(torch.bfloat16 if path == "compiled-bf16" else None)
    out["step_decode"] = step_decode(model, reps)
    out["ops"] = ops_per_step(model)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=lambda s: s.split(","), default=["auto", "1", "2"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--paths", default="reference,fast,compiled", help=f"comma-separated, of {PATHS}")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--against", metavar="REF", help="A/B of the default engine against git REF, in one process")
    p.add_argument("--rounds", type=int, default=6, help="with --against: rounds of --reps runs each")
    args = p.parse_args()
    if args.against:
        import tempfile

        import anyio

        with tempfile.TemporaryDirectory() as d:
            sys.path.insert(0, d)
            ref = export_ref(args.against, Path(d))
            res = anyio.run(against, ref, args.rounds, args.reps)
        common.emit({"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "against": args.against,
                     **res}, args.out)
        return
    if args.child:
        print(json.dumps(child(args.reps, args.child, "OMP_NUM_THREADS" not in os.environ)))
        return
    result: dict[str, Any] = {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "runs": []}
    for n in args.threads:
        for path in args.paths.split(","):
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            if n != "auto":
                env["OMP_NUM_THREADS"] = n
            res = subprocess.run([sys.executable, __file__, "--child", path, "--reps", str(args.reps)], env=env,
                                 capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{path} at {n} threads failed:\n{res.stderr[-3000:]}")
            result["runs"].append(json.loads(res.stdout.strip().splitlines()[-1]))
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
