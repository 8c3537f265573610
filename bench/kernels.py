# ruff: noqa: B023, E402  (lambdas are timed inside the iteration that made them; imports follow the shim)
"""Kernel benchmark on a CUDA device: correctness against the naive twins at Kimi shapes, and timings side by
side with fla-core (when importable). Prints one JSON document; ``--out FILE`` also writes it there.

    python bench/kernels.py --out $OUT/kernels.json [--quick] [--only check,chunk,decode,mla,mlasweep,tune]
        [--warm-procs 6] [--fla-bg] [--old PATH/chunk.py] [--old-tune '[{"offdiag_warps": 1}]']
        [--mla-cand PATH/paged_decode.py] [--deadline 330] [--save-cache $OUT/tcache.tar.xz]
    python bench/kernels.py --only kdadecode --no-fla [--old-kda-decode PATH/decode_triton.py]

``--old`` and ``--mla-cand`` name other versions of kernels/kda/chunk.py and kernels/mla/paged_decode.py (files
anywhere, imported as modules of the kernels package so their relative imports resolve); they are checked against
the twins and timed beside the current kernels. The current MLA decode is also checked and timed with each of its
forms forced (``{"form": "heads"}`` / ``{"form": "tokens"}``; the rows name the form) and with the launch parameters
of the environment's ``MLA_EXTRA`` (a JSON list, e.g. ``'[{"form": "tokens", "BN": 64, "num_warps": 4}]'``). MLA decode is timed eagerly
and as CUDA-graph replays (what the engine runs: no host launch cost; the inputs cycle through copies larger than
L2 so every replay reads DRAM): ``graph_us`` for a graph of a few calls after do_bench's L2 flush, ``stream_us``
for a graph of 16 or more replayed back to back (``bench_stream``: a call's cost inside a long decode step).
Without CUDA (``TRITON_INTERPRET=1``) ``--quick`` runs every part at tiny shapes on the CPU as a smoke test.

``--warm-procs`` compiles the kernel variants in parallel processes first (they share TRITON_CACHE_DIR), and
``--fla-bg`` lets fla autotune in one more process meanwhile; the timings start only after all of them end.
Imports the kernels through a shim (``/tmp/kda_kernels_shim/kda_sessions/kernels`` -> ``kernels/``) when the
package is not installed, so the device needs only torch and triton.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _shim() -> None:
    try:
        import kda_sessions.kernels  # noqa: F401  (installed, or the repo root on the path with its deps)

        return
    except ImportError:
        for name in [m for m in sys.modules if m == "kda_sessions" or m.startswith("kda_sessions.")]:
            del sys.modules[name]
    pkg = Path("/tmp/kda_kernels_shim/kda_sessions")
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""shim for bench/kernels.py"""\n')
    if not (pkg / "kernels").exists():
        (pkg / "kernels").symlink_to(REPO / "kernels")
    sys.path.insert(0, str(pkg.parent))


_shim()

import torch
import triton
import triton.testing

from kda_sessions.kernels.conv.naive import naive_causal_conv
from kda_sessions.kernels.conv.triton_conv import causal_conv_triton
from kda_sessions.kernels.gate.naive import naive_kda_gate
from kda_sessions.kernels.kda.chunk import ChunkTuning, chunk_kda_triton
from kda_sessions.kernels.kda.fused_recurrent import fused_recurrent_kda_triton
from kda_sessions.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

H, K, V = 32, 128, 128
DEV = "cuda"
T_CHECK = 2048
R_MLA, DR_MLA = 512, 64  # latent and rope widths of the MLA cache rows
DTYPE = torch.bfloat16
SMOKE = False  # tiny shapes on the CPU (TRITON_INTERPRET=1): set by configure()

# launch-parameter variants timed by --only tune (the first of each list is the default in the launchers)
CHUNK_VARIANTS: list[dict] = [
    {}, {"offdiag_warps": 1}, {"offdiag_warps": 4}, {"inv_ieee": 0}, {"tok_warps": 2}, {"wu_warps": 8},
    {"offdiag_bk": 64}, {"prep_bk": 64}, {"state_bv": 32}, {"state_bv": 32, "state_stages": 3},
]
MLA_VARIANTS: list[dict] = [
    {"BN": 64, "BH": 32, "num_warps": 4, "num_stages": 3}, {"BN": 32, "BH": 32, "num_warps": 4, "num_stages": 3},
    {"BN": 32, "BH": 32, "num_warps": 8, "num_stages": 3}, {"BN": 64, "BH": 32, "num_warps": 8, "num_stages": 2},
    {"BN": 32, "BH": 16, "num_warps": 4, "num_stages": 3}, {"BN": 64, "BH": 64, "num_warps": 8, "num_stages": 2},
]
# the current kernel's forms, forced; the last: "tokens" with 36 splits (eight waves at 32 x 32K, the default
# there since run N; for one sequence a fixed count far from its default)
MLA_FORMS: list[dict] = [{"form": "heads"}, {"form": "tokens"}, {"form": "tokens", "num_splits": 36}]


def mla_cand_grid() -> list[dict]:
    """Compiled variants of an MLA candidate swept by --only mlasweep (split counts and partial dtype come after)."""
    if SMOKE:
        return [{"BN": 16, "tma": True, "num_warps": 4, "num_stages": 2}] + \
            [{"BN": 16, "trans": t, "num_warps": 4, "num_stages": 2} for t in (True, False)]
    # BN 32 through TMA spills 0.7-1 KB per thread with 4 warps on sm_90: left out
    tma = [(64, 8, 2), (64, 8, 3), (64, 4, 2), (64, 4, 3), (32, 8, 2)]
    trans = [(64, 4, 2), (64, 8, 2), (64, 4, 3), (64, 8, 3), (32, 4, 3), (32, 8, 3), (32, 4, 4)]
    rows = [(64, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 2)]  # heads on the rows, as the current kernel
    return ([{"tma": True, "BN": bn, "num_warps": w, "num_stages": st} for bn, w, st in tma] +
            [{"trans": True, "BN": bn, "num_warps": w, "num_stages": st} for bn, w, st in trans] +
            [{"trans": False, "BN": bn, "num_warps": w, "num_stages": st} for bn, w, st in rows])


def configure(smoke: bool) -> None:
    """Tiny shapes on the CPU for a smoke run of every part (the Triton kernels through the interpreter)."""
    global H, K, V, DEV, T_CHECK, R_MLA, DR_MLA, DTYPE, SMOKE
    if smoke:
        H, K, V, DEV, T_CHECK, R_MLA, DR_MLA, DTYPE, SMOKE = 2, 32, 32, "cpu", 160, 32, 16, torch.float32, True


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds (triton's do_bench: events, L2 flushed between runs); one timed call on the CPU."""
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def capture(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``calls`` back to back, after one warm-up pass on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def bench_graph(calls: list[Callable[[], object]], rep: int = 100) -> float:
    """Milliseconds per call of one CUDA graph that runs ``calls`` back to back: what a captured decode step pays
    (no host launch cost). Callers cycle through inputs larger than L2, so every call reads DRAM."""
    if SMOKE:
        return bench(lambda: [c() for c in calls]) / len(calls)
    graph = capture(calls)
    ms = bench(graph.replay, rep=rep) / len(calls)
    del graph
    return ms


def bench_stream(calls: list[Callable[[], object]], rep: int = 20, batches: int = 5) -> float:
    """Milliseconds per call in a steady stream: one CUDA graph of ``calls`` replayed ``rep`` times back to back
    between two events, no L2 flush in between (callers cycle through inputs larger than L2, so every call still
    reads DRAM); the median over ``batches``. This is a call's marginal cost inside a long captured decode step.
    bench_graph also charges each call its share of one replay's fixed cost: the graph's launch and the
    write-back of the dirty lines that do_bench's L2 flush leaves (about 10 us a replay on the H200, 2.5 us a call
    in a graph of 4)."""
    if SMOKE:
        return bench_graph(calls)
    graph = capture(calls)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(rep):
            graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) / (rep * len(calls)))
    del graph
    return float(sorted(times)[len(times) // 2])


def compiled_stats(jit_fn, seen: set) -> list[dict]:
    """Registers, spills and shared memory of the kernels ``jit_fn`` compiled since ``seen`` (updated)."""
    out = []
    try:
        for entry in jit_fn.device_caches.values():
            for kern in entry[0].values():
                if id(kern) in seen:
                    continue
                seen.add(id(kern))
                md = kern.metadata
                out.append({"regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None),
                            "shared": getattr(md, "shared", None), "warps": getattr(md, "num_warps", None),
                            "stages": getattr(md, "num_stages", None)})
    except Exception as e:  # the cache layout differs between Triton versions
        out.append({"error": repr(e)[:200]})
    return out


def gate_inputs(B: int, T: int, seed: int):
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.randn(B, T, H, K, device=DEV, generator=g_)
    A_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=g_))
    dt_bias = torch.randn(H * K, device=DEV, generator=g_) * 0.5 - 2.0
    return raw, A_log, dt_bias


def kda_inputs(B: int, T: int, bounded: bool, seed: int = 0, dtype: torch.dtype | None = None):
    dtype = dtype or DTYPE
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    k = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    v = torch.randn(B, T, H, V, device=DEV, generator=g_).to(dtype)
    raw, A_log, dt_bias = gate_inputs(B, T, seed + 1000)
    g = naive_kda_gate(raw, A_log, dt_bias, -5.0 if bounded else None)  # float32 log-decay
    beta = torch.rand(B, T, H, device=DEV, generator=g_).to(dtype)
    return q, k, v, g, beta


def load_fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # type: ignore

        return chunk_kda, fused_recurrent_kda
    except Exception as e:  # fla-core is optional
        print(f"fla not importable: {e!r}", file=sys.stderr)
        return None, None


def load_module(path: str, package: str):
    """A kernel file anywhere as a module of ``package`` (so ``from ..gate.naive import`` resolves)."""
    name = f"{package}._bench_{Path(path).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def load_old(paths: str | None, tunes: list[dict] | dict[str, list[dict]] | None = None) -> dict:
    """Other versions of kernels/kda/chunk.py (e.g. an earlier kernels/kda/chunk.py from git) by file stem, for before/after
    in one run; each of ``tunes`` (a list for every file, or lists by stem) adds the same function with those
    launch parameters as ``stem+k=v``."""
    out = {}
    for path in (paths or "").split(","):
        if not path or not Path(path).exists():
            continue
        mod = load_module(path, "kda_sessions.kernels.kda")
        fn = mod.chunk_kda_triton
        if Path(path).resolve() != REPO / "kernels" / "kda" / "chunk.py":  # the current one is timed anyway
            out[Path(path).stem] = fn
        for t in (tunes.get(Path(path).stem, []) if isinstance(tunes, dict) else tunes or []):
            # earlier versions took the overrides as a ``tune`` dict
            kw = {"tuning": mod.ChunkTuning(**t)} if hasattr(mod, "ChunkTuning") else {"tune": t}
            out[Path(path).stem + "+" + ",".join(f"{k}={v}" for k, v in t.items())] = functools.partial(fn, **kw)
    return out


def chunk_tuning(cfg: dict | None) -> ChunkTuning | None:
    """Launch-parameter overrides (a variant of CHUNK_VARIANTS, or JSON from the command line) as the chunk
    kernel's tuning object (None: its defaults)."""
    return ChunkTuning(**cfg) if cfg else None


def load_mla(paths: str | None) -> dict:
    """The current MLA decode module as "current" plus other versions of kernels/mla/paged_decode.py (e.g.
    from git history or a work-in-progress file), by file stem."""
    from kda_sessions.kernels.mla import paged_decode

    out = {"current": paged_decode}
    for path in (paths or "").split(","):
        if path and Path(path).exists():
            out[Path(path).stem] = load_module(path, "kda_sessions.kernels.mla")
    return out


def check_chunk(old_chunk: dict) -> dict:
    out: dict = {}
    T = T_CHECK
    cu = torch.tensor([0, T * 700 // 2048, T * 1301 // 2048, T], device=DEV, dtype=torch.int32)
    lens = (cu[1:] - cu[:-1]).tolist()
    ck = [[1, lens[0] // 3, lens[0] // 2, lens[0]], [5], [17, lens[2] - 7, lens[2]]]
    h0 = torch.randn(3, H, K, V, device=DEV) * 0.1
    for bounded in (False, True):
        q, k, v, g, beta = kda_inputs(1, T_CHECK, bounded, seed=1)
        ro, rf, rc = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, h0, True, cu, True, ck)
        key = "bounded" if bounded else "standard"
        o, f, c = chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, ck)
        out[key] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        o, f, c = chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, ck,
                                   tuning=chunk_tuning({"inv_ieee": 0}))
        out[key]["tf32_inverse"] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        raw, A_log, dt_bias = gate_inputs(1, T_CHECK, 1000 + 1)  # the raw logits behind g
        lb = -5.0 if bounded else None
        o, f, c = chunk_kda_triton(q, k, v, raw, beta, None, h0, True, cu, True, ck, use_gate_in_kernel=True,
                                   A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
        out[key]["gate_in_kernel"] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        for name, old in old_chunk.items():
            o, f, c = old(q, k, v, g, beta, None, h0, True, cu, True, ck)
            out[key][name] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
            o, f, c = old(q, k, v, raw, beta, None, h0, True, cu, True, ck, use_gate_in_kernel=True, A_log=A_log,
                          dt_bias=dt_bias, lower_bound=lb)
            out[key][name + " gate_in_kernel"] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
    # short recurrent reference for the twin itself (T small: the loop is slow)
    q, k, v, g, beta = kda_inputs(1, 200, False, seed=2)
    o, f, _ = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True)
    ro, rf, _ = naive_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(), None, None, True, None, True)
    out["vs_recurrent_T200"] = {"o": rel(o, ro), "final": rel(f, rf)}
    return out


def check_fla(fla_chunk) -> dict:
    """One sequence, no cu_seqlens (fla's autotuning of the varlen forms takes minutes): ours and fla's vs the twin."""
    h0 = torch.randn(1, H, K, V, device=DEV) * 0.1
    q, k, v, g, beta = kda_inputs(1, T_CHECK, False, seed=1)
    ro, rf, _ = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, h0, True, None, True)
    o, f, _ = chunk_kda_triton(q, k, v, g, beta, None, h0, True, None, True)
    fo, ff = fla_chunk(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    return {"o": rel(o, ro), "final": rel(f, rf), "fla_o": rel(fo, ro), "fla_final": rel(ff, rf)}


def check_decode() -> dict:
    N = 256
    q, k, v, g, beta = kda_inputs(N, 1, False, seed=3)
    pool = torch.randn(N + 64, H, K, V, device=DEV) * 0.1
    slots = torch.randperm(N + 64, device=DEV)[:N].int()
    before = pool.clone()
    o, _ = fused_recurrent_kda_triton(q, k, v, g, beta, None, None, False, None, True, pool, slots)
    ro, rf, _ = naive_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(), None, before[slots.long()],
                                    True, None, True)
    untouched = torch.ones(N + 64, dtype=torch.bool, device=DEV)
    untouched[slots.long()] = False
    return {"o": rel(o, ro), "pool_state": rel(pool[slots.long()], rf),
            "untouched_slots_equal": bool(torch.equal(pool[untouched], before[untouched]))}


def check_conv() -> dict:
    D, W = H * K, 4
    cu = torch.tensor([0, 3, 1000, 4096], device=DEV, dtype=torch.int32)
    x = torch.randn(4096, D, device=DEV).bfloat16()
    w = torch.randn(D, W, device=DEV) * 0.5
    tail = torch.randn(3, W - 1, D, device=DEV).bfloat16()
    pos = [[1, 3], [64, 997], [2, 3000]]
    y, t, c = causal_conv_triton(x, w, tail, cu, pos)
    ry, rt, rc = naive_causal_conv(x, w, tail, cu, pos)
    return {"y": rel(y, ry), "tail": rel(t, rt), "tails_at": rel(c, rc)}


def mla_setup(lens: list[int], copies: int = 1, seed: int = 0, P: int | None = None) -> list[tuple]:
    """``copies`` decode steps over distinct random pages of one bf16 pool: each (q_lat [N, H, r], q_pe [N, H, dr],
    kv_pages [num_pages, P, r + dr], page_table [N, max_pages] int32, seq_lens [N] int32, scale)."""
    P = P or (16 if SMOKE else 64)
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    N = len(lens)
    max_pages = max(math.ceil(L / P) for L in lens)
    per_copy = sum(math.ceil(L / P) for L in lens)
    total_pages = copies * per_copy + 8
    kv = torch.randn(total_pages, P, R_MLA + DR_MLA, device=DEV, generator=g_).to(DTYPE)
    perm = torch.randperm(total_pages, device=DEV, generator=g_).int()
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    out = []
    used = 0
    for _ in range(copies):
        pt = torch.zeros(N, max_pages, device=DEV, dtype=torch.int32)
        for n, L in enumerate(lens):
            np_ = math.ceil(L / P)
            pt[n, :np_] = perm[used : used + np_]
            used += np_
        ql = torch.randn(N, H, R_MLA, device=DEV, generator=g_).to(DTYPE)
        qp = torch.randn(N, H, DR_MLA, device=DEV, generator=g_).to(DTYPE)
        out.append((ql, qp, kv, pt, sl, (128 + 64) ** -0.5))
    return out


def mla_fake(lens: list[int]) -> tuple:
    """The shapes of a context (page-table width, sequences) over a pool of 8 pages, one token per sequence: the
    same compiled specialisation as the real inputs at no cost."""
    P = 16 if SMOKE else 64
    N = len(lens)
    kv = torch.zeros(8, P, R_MLA + DR_MLA, device=DEV, dtype=DTYPE)
    pt = torch.zeros(N, math.ceil(max(lens) / P), device=DEV, dtype=torch.int32)
    q = torch.zeros(N, H, R_MLA, device=DEV, dtype=DTYPE), torch.zeros(N, H, DR_MLA, device=DEV, dtype=DTYPE)
    return (*q, kv, pt, torch.ones(N, device=DEV, dtype=torch.int32), (128 + 64) ** -0.5)


def mla_check_cfgs(name: str, mod) -> list[dict]:
    """Launch parameters of each MLA module that the correctness check covers (all that the timings use; for a
    candidate also the JSON list in MLA_CAND_CFGS, which --mla-cfgs sets)."""
    if name != "current" and os.environ.get("MLA_CAND_CFGS"):
        return [{}, *json.loads(os.environ["MLA_CAND_CFGS"])]
    if name == "current":  # MLA_EXTRA: a JSON list of more launch parameters to check and time (a sweep)
        return [{}, *MLA_FORMS, *MLA_VARIANTS[1:2], *json.loads(os.environ.get("MLA_EXTRA", "[]"))]
    params = inspect.signature(mod._launch).parameters
    if "waves" in params:  # v3 and later: the whole sweep grid, plus bf16 partials and many splits
        return [{}, *mla_cand_grid(), {"part_bf16": True}, {"waves": 4.0, "part_bf16": True},
                {"tma": False, "page_tile": False}, {"num_splits": 1}]
    if "trans" in params:
        return [{}, {"trans": True}]
    return [{}]


def check_mla(mods: dict) -> dict:
    """Every MLA module and launch variant against the float32 twin, sequences of 1 .. 33000 tokens (P 16 and 64)."""
    out: dict = {}
    lens = [1, 100, 300, 1000] if SMOKE else [1, 1000, 5000, 33000]
    for P in (16, 64):
        args = mla_setup(lens, P=P)[0]
        ro = naive_mla_decode_paged(args[0].float(), args[1].float(), args[2].float(), *args[3:])
        for name, mod in mods.items():
            cfgs = mla_check_cfgs(name, mod) if P == 64 else [{}]
            errs = {}
            for cfg in cfgs:
                key = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
                try:
                    errs[key] = rel(mod._launch(*args, **cfg), ro)
                except Exception as e:
                    errs[key] = repr(e)[:300]
            num = [e for e in errs.values() if isinstance(e, float)]
            out[f"{name} P{P}"] = {"max": max(num) if num else None, "all_ran": len(num) == len(errs), **errs}
    # the current kernel's forms forced at one sequence and at 32
    for lens in ([1000], [1, 100, 300, 1000] * 8) if SMOKE else ([33000], [1, 1000, 5000, 33000] * 8):
        for P in (16, 64):
            args = mla_setup(lens, P=P)[0]
            ro = naive_mla_decode_paged(args[0].float(), args[1].float(), args[2].float(), *args[3:])
            errs = {}
            for cfg in MLA_FORMS:
                try:
                    errs[f"form={cfg['form']}"] = rel(mods["current"]._launch(*args, **cfg), ro)
                except Exception as e:
                    errs[f"form={cfg['form']}"] = repr(e)[:300]
            num = [e for e in errs.values() if isinstance(e, float)]
            out[f"current N{len(lens)} P{P}"] = {"max": max(num) if num else None, "all_ran": len(num) == len(errs),
                                                 **errs}
    return out


def copy_bandwidth() -> dict:
    """Device-to-device copy (read + write bytes) and a read-only reduction, TB/s."""
    x = torch.empty((16 if SMOKE else 2048) * 1024**2, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=100)
    xs = x.view(torch.int32)
    ms_read = bench(lambda: xs.sum(), rep=100)
    return {"copy": 2 * x.numel() / (ms * 1e-3) / 1e12, "read_sum": x.numel() / (ms_read * 1e-3) / 1e12}


def time_chunk(fla_chunk, old_chunk: dict, Ts: list[int], cfg: dict | None = None) -> list[dict]:
    rows = []
    for T in Ts:
        q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
        row: dict = {"T": T, "cfg": cfg}
        tuning = chunk_tuning(cfg)
        ms = bench(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True,
                                                                         tuning=tuning), rep=300)
        row["ours_ms"], row["ours_Mtok_s"] = ms, T / ms / 1e3
        raw, A_log, dt_bias = gate_inputs(1, T, 1000 + 4)
        ms = bench(lambda: chunk_kda_triton(q, k, v, raw, beta, None, None, True, None, True, use_gate_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias, tuning=tuning), rep=300)
        row["ours_gate_in_kernel_ms"] = ms
        ms = bench(lambda: chunk_kda_triton(q, k, v, raw, beta, None, None, True, None, True, use_gate_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, tuning=tuning), rep=300)
        row["ours_bounded_gate_in_kernel_ms"] = ms
        for name, old in old_chunk.items():
            ms = bench(lambda old=old: old(q, k, v, g, beta, None, None, True, None, True), rep=100)
            row[f"{name}_ms"], row[f"{name}_Mtok_s"] = ms, T / ms / 1e3
            ms = bench(lambda old=old: old(q, k, v, raw, beta, None, None, True, None, True,
                                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                           lower_bound=-5.0), rep=100)
            row[f"{name}_bounded_gate_in_kernel_ms"] = ms
        if fla_chunk is not None:
            def f(q=q, k=k, v=v, g=g, beta=beta):
                return fla_chunk(q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

            ms = bench(f, rep=300)
            row["fla_ms"], row["fla_Mtok_s"] = ms, T / ms / 1e3

            def fg(q=q, k=k, v=v, raw=raw, beta=beta):
                return fla_chunk(q=q, k=k, v=v, g=raw, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

            try:
                row["fla_gate_in_kernel_ms"] = bench(fg, rep=300)
            except Exception as e:
                row["fla_gate_in_kernel_ms"] = repr(e)[:200]
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def profile_chunk(old_chunk: dict, fla_chunk=None) -> dict:
    """Per-kernel CUDA time of 5 calls at T 32K: ours, every --old version and fla when loaded (where the time
    goes)."""
    from torch.profiler import ProfilerActivity, profile

    T = 512 if SMOKE else 32768
    q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
    fns = {"ours": chunk_kda_triton, **old_chunk}
    if fla_chunk is not None:
        fns["fla"] = lambda q, k, v, g, beta, *_: fla_chunk(
            q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = {}
    for name, fn in fns.items():
        fn(q, k, v, g, beta, None, None, True, None, True)
        with profile(activities=[ProfilerActivity.CPU if SMOKE else ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(q, k, v, g, beta, None, None, True, None, True)
            if not SMOKE:
                torch.cuda.synchronize()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total" if SMOKE else "cuda_time_total",
                                              row_limit=14)
    return out


def time_decode(fla_rec) -> list[dict]:
    rows = []
    for N in (1, 32, 256):
        q, k, v, g, beta = kda_inputs(N, 1, False, seed=5)
        gb = g
        pool = torch.randn(N + 8, H, K, V, device=DEV) * 0.1
        slots = torch.arange(N, device=DEV, dtype=torch.int32)
        h0 = pool[:N].clone()
        row: dict = {"N": N, "state_MB_moved": 2 * N * H * K * V * 4 / 1e6}
        row["ours_pool_us"] = 1e3 * bench(
            lambda: fused_recurrent_kda_triton(q, k, v, gb, beta, None, None, False, None, True, pool, slots))
        row["ours_h0_final_us"] = 1e3 * bench(
            lambda: fused_recurrent_kda_triton(q, k, v, gb, beta, None, h0, True, None, True))
        # CUDA graph: capture the pool form once, replay
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fused_recurrent_kda_triton(q, k, v, gb, beta, None, None, False, None, True, pool, slots)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_recurrent_kda_triton(q, k, v, gb, beta, None, None, False, None, True, pool, slots)
        row["ours_graph_replay_us"] = 1e3 * bench(graph.replay)
        # 20 replays back to back, per replay: what one layer costs inside a captured decode step
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            graph.replay()
        torch.cuda.synchronize()
        row["ours_graph_replay_back_to_back_us"] = (time.perf_counter() - t0) / 200 * 1e6
        if fla_rec is not None:
            row["fla_us"] = 1e3 * bench(lambda: fla_rec(q=q, k=k, v=v, g=gb, beta=beta, initial_state=h0,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True))
        row["ours_TB_s_pool"] = row["state_MB_moved"] / row["ours_pool_us"]
        rows.append(row)
    return rows


KDA_DECODE_CFGS = [(128, 4), (128, 8), (64, 4), (32, 2)]
"""(BV, num_warps) of the KDA decode kernel timed by --only kdadecode beside its default."""


def kda_decode_layers(N: int, n_layers: int, seed: int = 0) -> list[dict]:
    """``n_layers`` KDA layers' decode inputs at the 48B shape (H 32, K = V = 128, conv 4, bf16), N sequences,
    each layer with pools of its own (N + 8 slots, the N used ones out of order) as the model's decode hands them
    to ``kda_decode``: up to 8 sequences the gates' second projections in the kernel (f_a, g_a [N, K] beside
    their weights), above that the logits as [N, H*K] and [N, H*V] rows of one merged projection output."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    Dc = 2 * H * K + H * V
    inside = N <= 8
    layers = []
    for _ in range(n_layers):
        width = Dc + (K + V if inside else H * K + H * V) + H
        y = torch.randn(N, width, device=DEV, generator=gen).to(DTYPE)
        L = {
            "qkv": y[:, :Dc], "raw": y[:, Dc : Dc + (K if inside else H * K)],
            "gate": y[:, width - H - (V if inside else H * V) : width - H], "b": y[:, width - H :],
            "cw": (torch.randn(4, Dc, device=DEV, generator=gen) * 0.5).to(DTYPE).t(),
            "conv": torch.randn(N + 8, 3, Dc, device=DEV, generator=gen).to(DTYPE),
            "state": torch.randn(N + 8, H, K, V, device=DEV, generator=gen) * 0.1,
            "A_log": torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=gen)),
            "dt": torch.randn(H * K, device=DEV, generator=gen) * 0.5 - 2.0,
            "nw": torch.rand(V, device=DEV, generator=gen) + 0.5,
            "slots": torch.randperm(N + 8, device=DEV, generator=gen)[:N].to(torch.int32),
            "fb": (torch.randn(H * K, K, device=DEV, generator=gen) * K**-0.5).to(DTYPE) if inside else None,
            "gb": (torch.randn(H * V, V, device=DEV, generator=gen) * V**-0.5).to(DTYPE) if inside else None,
        }
        layers.append(L)
    return layers


def kda_decode_call(fn: Callable, L: dict, cfg: tuple[int, int] | None, pdl: bool) -> Callable[[], object]:
    """One layer's ``kda_decode_triton`` (``fn``: the current one or another version's) as the model calls it:
    the gated output norm, the gates' projections in the kernel where L has them."""
    return lambda: fn(L["qkv"], L["raw"], L["b"], L["cw"], L["conv"], L["A_log"], L["dt"], None, L["state"],
                      L["slots"], K**-0.5, (L["nw"], L["gate"], 1e-5), L["fb"], L["gb"], cfg, pdl)


def time_kda_decode(old_path: str | None) -> list[dict]:
    """The KDA decode launch(es) of one layer at the 48B shape, N = 1, 8, 32 sequences, PDL where the model uses
    it (one sequence): graph replays of one call per layer over enough layers' pools that they exceed L2
    (``graph_us``: bench_graph, ``stream_us``: bench_stream, both per layer), for the current kernel at its
    default and ``KDA_DECODE_CFGS`` and for ``old_path``'s version (another decode_triton.py) at its default.
    Each variant is first checked against the current default on copies of one layer's pools (outputs, states,
    tails: relative RMS)."""
    from kda_sessions.kernels.kda import decode_triton as cur
    from kda_sessions.kernels.linear import MATVEC_MAX_ROWS

    impls: list[tuple[str, Callable, tuple[int, int] | None]] = [("current", cur.kda_decode_triton, None)]
    impls += [("current", cur.kda_decode_triton, c) for c in KDA_DECODE_CFGS]
    if old_path and Path(old_path).exists():
        impls.insert(0, ("old", load_module(old_path, "kda_sessions.kernels.kda").kda_decode_triton, None))
    rows = []
    for N in (1, 8, 32):
        per_layer = N * H * K * V * 4 * 2 + (2 * H * K * K * 2 if N <= 8 else 0)
        n_layers = 1 if SMOKE else max(20, -(-256_000_000 // per_layer))
        layers = kda_decode_layers(N, n_layers)
        pdl = N <= MATVEC_MAX_ROWS
        first = {k: (v.clone() if k in ("conv", "state") else v) for k, v in layers[0].items()}  # the timings step it
        ref_layer = {k: (v.clone() if k in ("conv", "state") else v) for k, v in first.items()}
        ref = kda_decode_call(cur.kda_decode_triton, ref_layer, None, pdl)()
        for name, fn, cfg in impls:
            row: dict = {"N": N, "impl": name, "cfg": cfg or "default", "layers": n_layers, "pdl": pdl,
                         "default_cfg": list(cur.decode_launch_config(N, V)) if name == "current" else None}
            try:
                chk = {k: (v.clone() if k in ("conv", "state") else v) for k, v in first.items()}
                out = kda_decode_call(fn, chk, cfg, pdl)()
                row["check"] = {"y": rel(out, ref), "state": rel(chk["state"], ref_layer["state"]),
                                "conv_equal": bool(torch.equal(chk["conv"], ref_layer["conv"]))}
                calls = [kda_decode_call(fn, L, cfg, pdl) for L in layers]
                row["graph_us"] = 1e3 * bench_graph(calls, rep=50)
                row["stream_us"] = 1e3 * bench_stream(calls)
            except Exception:
                row["error"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        del layers
    return rows


def mla_contexts() -> list[list[int]]:
    """Context lengths of the MLA timings: 32K, 128K and 1M tokens of one sequence, 32 sequences of 32K."""
    if SMOKE:
        return [[300], [1000], [2000], [300] * 3]
    return [[32768], [131072], [1048576], [32768] * 32]


def mla_case(lens: list[int]) -> tuple[list[tuple], int, int]:
    """Input sets for one context (enough copies that a graph cycling through them exceeds L2 twice over), the
    number of calls per graph, and the cache bytes one call reads."""
    bytes_ = sum(lens) * (R_MLA + DR_MLA) * DTYPE.itemsize
    copies = 1 if SMOKE else max(1, math.ceil(128e6 / bytes_))
    return mla_setup(lens, copies=copies), 1 if SMOKE else max(copies, 4), bytes_


def mla_row(fn: Callable, sets: list[tuple], calls: int, bytes_: int, bw: float, eager: bool = True) -> dict:
    """Graph-replay, steady-stream (and eager) time of one call ``fn(*args)`` with its bytes/s against the copy
    bandwidth."""
    row: dict = {}
    ms = bench_graph([functools.partial(fn, *sets[i % len(sets)]) for i in range(calls)])
    row["graph_us"], row["graph_TB_s"] = ms * 1e3, bytes_ / ms / 1e9
    row["graph_of_copy_bw"] = row["graph_TB_s"] / bw
    ms = bench_stream([functools.partial(fn, *sets[i % len(sets)]) for i in range(max(calls, 16))])
    row["stream_us"], row["stream_of_copy_bw"] = ms * 1e3, bytes_ / ms / 1e9 / bw
    if eager:
        ms = bench(lambda: fn(*sets[0]))
        row["eager_us"], row["eager_of_copy_bw"] = ms * 1e3, bytes_ / ms / 1e9 / bw
    return row


def mla_try(row: dict, fn: Callable, sets: list[tuple], calls: int, bytes_: int, bw: float,
            eager: bool = True) -> dict:
    """``row`` with mla_row's figures for ``fn``, or with the error its launch raised."""
    try:
        row.update(mla_row(fn, sets, calls, bytes_, bw, eager=eager))
    except Exception as e:
        row["error"] = repr(e)[:300]
    return row


def time_mla(bw: float, mods: dict, cand_cfgs: list[dict] | None = None) -> list[dict]:
    """Current MLA decode and each candidate with their defaults (and the variants the check names, or
    ``cand_cfgs`` for the candidates), per context."""
    rows = []
    for lens in mla_contexts():
        sets, calls, bytes_ = mla_case(lens)
        for name, mod in mods.items():
            cfgs = [{}, {"tma": False}] if name != "current" and "waves" in inspect.signature(
                mod._launch).parameters else mla_check_cfgs(name, mod)
            if cand_cfgs is not None and name != "current":
                cfgs = cand_cfgs
            default_form = getattr(mod, "_default_form", None)  # the current kernel's choice by N
            for cfg in cfgs:
                form = cfg.get("form") or (default_form(len(lens)) if default_form else None)
                rows.append(mla_try({"N": len(lens), "context": lens[0], "impl": name, "form": form, "cfg": cfg},
                                    functools.partial(mod._launch, **cfg), sets, calls, bytes_, bw))
        del sets
        if not SMOKE:
            torch.cuda.empty_cache()
    return rows


def mla_splits(bw: float) -> list[dict]:
    """The shipped MLA kernel at each context with its default split count and 1/2, 2, 4 and 8 times as many
    (the heuristic keeps at least 512 tokens per split, so one 32K sequence gets 64 programs on 132 SMs), with
    the default tiles and with 8 warps / 2 stages (no spills on sm_90). Graph replays only."""
    from kda_sessions.kernels.mla import paged_decode as mod

    rows: list[dict] = []
    sm = 4 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for lens in mla_contexts():
        sets, calls, bytes_ = mla_case(lens)
        base = mod._num_splits(len(lens), sets[0][3].shape[1] * sets[0][2].shape[1], sm)
        for splits in sorted({max(1, int(base * f)) for f in (0.5, 1, 2, 4, 8)}):
            for cfg in ({}, {"num_warps": 8, "num_stages": 2}):
                rows.append(mla_try({"N": len(lens), "context": lens[0], "num_splits": splits, "default": splits == base,
                                     **cfg}, functools.partial(mod._launch, num_splits=splits, **cfg), sets, calls,
                                    bytes_, bw, eager=False))
        del sets
        if not SMOKE:
            torch.cuda.empty_cache()
    return rows


def mla_sweep(bw: float, mods: dict, deadline: float) -> dict:
    """Launch parameters of each candidate with a ``waves`` parameter (v3): stage 1 times every compiled variant
    at 1M x 1 and 32K x 32 with the default splits; stage 2 times the best three at every context with 0.5 .. 4
    waves of splits and float32 or bf16 partials. Graph replays only."""
    out: dict = {}
    sm = 4 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for name, mod in mods.items():
        if "waves" not in inspect.signature(mod._launch).parameters:
            continue
        res: dict = {"stage1": [], "stage2": []}
        out[name] = res
        seen: set = set()
        ctx = mla_contexts()
        score: dict = {}
        for lens in (ctx[2], ctx[3]):
            sets, calls, bytes_ = mla_case(lens)
            for cfg in mla_cand_grid():
                row: dict = {"N": len(lens), "context": lens[0], **cfg}
                try:
                    row.update(mla_row(functools.partial(mod._launch, **cfg), sets, calls, bytes_, bw, eager=False))
                    row["compiled"] = [st for kern in (mod._split_kernel, getattr(mod, "_split_kernel_tma", None))
                                       if kern is not None for st in compiled_stats(kern, seen)]
                    key = json.dumps(cfg, sort_keys=True)
                    score[key] = score.get(key, 0.0) + row["graph_of_copy_bw"]
                except Exception as e:
                    row["error"] = repr(e)[:300]
                res["stage1"].append(row)
            del sets
            if time.time() > deadline:
                res["stopped"] = "deadline in stage 1"
                return out
        top = [json.loads(k) for k, _ in sorted(score.items(), key=lambda kv: -kv[1])[:3]]
        res["stage1_top"] = top
        best: dict = {}
        for lens in ctx:
            sets, calls, bytes_ = mla_case(lens)
            cap = sets[0][3].shape[1] * sets[0][2].shape[1]
            variants = [{**cfg, "num_splits": mod._num_splits(len(lens), cap, sm, w, 128), "part_bf16": pb}
                        for cfg in top for w in (0.5, 1.0, 2.0, 4.0) for pb in (False, True)]
            if top:  # the same tiles through gathered pointer loads
                variants.append({**top[0], "tma": False, "page_tile": False})
            for cfg in variants:
                row = {"N": len(lens), "context": lens[0], **cfg}
                try:
                    row.update(mla_row(functools.partial(mod._launch, **cfg), sets, calls, bytes_, bw, eager=False))
                except Exception as e:
                    row["error"] = repr(e)[:300]
                res["stage2"].append(row)
                if "graph_us" in row and row["graph_us"] < best.get(lens[0] * 100 + len(lens), {}).get("graph_us", 1e30):
                    best[lens[0] * 100 + len(lens)] = row
            del sets
            if not SMOKE:
                torch.cuda.empty_cache()
            if time.time() > deadline:
                res["stopped"] = "deadline in stage 2"
                break
        res["best_per_context"] = list(best.values())
    return out


def tune(bw_tb_s: float) -> dict:
    """Variants of the launch parameters, timed in one run (the chosen defaults live in the launchers)."""
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    out: dict = {"mla": [], "chunk": []}
    best_1m = (float("inf"), MLA_VARIANTS[0])
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for lens in ([1048576], [131072], [32768] * 32, [32768]):
        args = mla_setup(lens)[0]
        bytes_ = sum(lens) * (512 + 64) * 2
        for cfg in MLA_VARIANTS:
            for waves in (1, 2, 4):  # 2: the launcher's default
                splits = max(1, min(triton.cdiv(waves * sm, len(lens)), triton.cdiv(lens[0], 256)))
                try:
                    ms = bench(lambda args=args, cfg=cfg, splits=splits: mla_mod._launch(*args, splits, **cfg))
                    out["mla"].append({"N": len(lens), "L": lens[0], **cfg, "splits": splits, "us": ms * 1e3,
                                       "of_copy_bw": bytes_ / ms / 1e9 / bw_tb_s})
                    if lens == [1048576] and waves == 2 and ms < best_1m[0]:
                        best_1m = (ms, cfg)
                except Exception as e:
                    out["mla"].append({**cfg, "splits": splits, "error": repr(e)[:300]})
        del args
        torch.cuda.empty_cache()
    out["mla_best"] = best_1m[1]
    T = 32768
    q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
    best = (float("inf"), CHUNK_VARIANTS[0])
    for cfg in CHUNK_VARIANTS:
        try:
            ms = bench(lambda cfg=cfg: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True,
                                                        tuning=chunk_tuning(cfg)))
            out["chunk"].append({"cfg": cfg, "ms": ms, "Mtok_s": T / ms / 1e3})
            best = min(best, (ms, cfg), key=lambda x: x[0])
        except Exception as e:
            out["chunk"].append({"cfg": cfg, "error": repr(e)[:300]})
    out["chunk_best"] = best[1]
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, tuning=chunk_tuning(best[1]))
            torch.cuda.synchronize()
        out["chunk_profile_T32K_x5"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    except Exception as e:
        out["chunk_profile_T32K_x5"] = repr(e)[:300]
    return out


def warm_jobs(parts: set, old_path: str | None, old_tunes: list[dict], mla_paths: str | None) -> list[Callable]:
    """One small launch per compiled form that the chosen parts use, in a fixed order (each warm process takes
    every k-th)."""
    jobs: list[Callable] = []
    q, k, v, g, beta = kda_inputs(1, 256, False, seed=9)
    raw, A_log, dt_bias = gate_inputs(1, 256, 3)
    cu = torch.tensor([0, 100, 256], device=DEV, dtype=torch.int32)
    h0 = torch.zeros(2, H, K, V, device=DEV)

    def chunk_forms(fn: Callable, plain_lbs: tuple) -> list[Callable]:
        """What check_chunk and time_chunk run: plain, varlen + h0 + checkpoints, the gate fused (both kinds)
        on the varlen form, and without varlen the gate-fused forms timed (lower bounds ``plain_lbs``)."""
        forms = [lambda: fn(q, k, v, g, beta, None, None, True, None, True),
                 lambda: fn(q, k, v, g, beta, None, h0, True, cu, True, [[5], [7]])]
        for lb in (None, -5.0):
            kw = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias, "lower_bound": lb}
            forms.append(lambda kw=kw: fn(q, k, v, raw, beta, None, h0, True, cu, True, [[5], [7]], **kw))
            if lb in plain_lbs:
                forms.append(lambda kw=kw: fn(q, k, v, raw, beta, None, None, True, None, True, **kw))
        return forms

    if parts & {"check", "chunk", "tune"}:
        jobs += chunk_forms(chunk_kda_triton, (None, -5.0))
        jobs.append(lambda: chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, [[5], [7]],
                                             tuning=chunk_tuning({"inv_ieee": 0})))
        for old in load_old(old_path, old_tunes).values():
            jobs += chunk_forms(old, (-5.0,))
    if "tune" in parts:
        jobs += [lambda cfg=cfg: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True,
                                                  tuning=chunk_tuning(cfg))
                 for cfg in CHUNK_VARIANTS[1:]]
    if parts & {"check", "checkmla", "mla", "mlasweep", "mlasplits", "tune"}:
        lens = [1, 100, 300, 1000] if SMOKE else [1, 1000, 5000, 33000]
        small = mla_setup(lens)[0]  # the check's shapes
        small16 = mla_setup(lens, P=16)[0]
        for name, mod in load_mla(mla_paths).items():
            cfgs = mla_check_cfgs(name, mod)
            if "waves" in inspect.signature(mod._launch).parameters and "mlasweep" in parts:
                cfgs += [{**c, "part_bf16": True} for c in mla_cand_grid()]
            jobs += [lambda mod=mod, cfg=cfg: mod._launch(*small, **cfg) for cfg in cfgs]
            jobs.append(lambda mod=mod: mod._launch(*small16))
            if name == "current":  # check_mla runs its forms at P 16 too
                jobs += [lambda mod=mod, cfg=cfg: mod._launch(*small16, **cfg) for cfg in MLA_FORMS]
            # the timed shapes, specialised as timed (split counts and page-table widths) but one token each
            timed = [{}, {"tma": False}] if "waves" in inspect.signature(mod._launch).parameters else \
                mla_check_cfgs(name, mod)
            for ctx in mla_contexts() if "mla" in parts else []:
                fake = mla_fake(ctx)
                jobs += [lambda mod=mod, cfg=cfg, fake=fake: mod._launch(*fake, **cfg) for cfg in timed]
        if "tune" in parts:
            from kda_sessions.kernels.mla import paged_decode as mla_mod

            jobs += [lambda cfg=cfg: mla_mod._launch(*small, **cfg) for cfg in MLA_VARIANTS]
        if "mlasplits" in parts:  # what mla_splits launches: every split count is a compiled form
            from kda_sessions.kernels.mla import paged_decode as mla_mod

            sm = 4 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
            for ctx in mla_contexts():
                fake = mla_fake(ctx)
                base = mla_mod._num_splits(len(ctx), fake[3].shape[1] * fake[2].shape[1], sm)
                for splits in sorted({max(1, int(base * f)) for f in (0.5, 1, 2, 4, 8)}):
                    for cfg in ({}, {"num_warps": 8, "num_stages": 2}):
                        jobs.append(lambda fake=fake, cfg=cfg, splits=splits: mla_mod._launch(
                            *fake, num_splits=splits, **cfg))
    return jobs


def warm(part: int, parts: int, a: argparse.Namespace) -> None:
    """Compile this process's share of the kernel forms into TRITON_CACHE_DIR."""
    jobs = warm_jobs(set(a.only.split(",")), a.old, json.loads(a.old_tune), a.mla_cand)
    for job in jobs[part::parts]:
        try:
            job()
        except Exception as e:  # the timed run reports it
            print(f"warm: {e!r}"[:300], file=sys.stderr)
    if not SMOKE:
        torch.cuda.synchronize()


def fla_warm() -> None:
    """Let fla autotune the forms the timings use (non-varlen chunk, decode); results land in TRITON_CACHE_DIR."""
    fla_chunk, fla_rec = load_fla()
    if fla_chunk is None:
        return
    q, k, v, g, beta = kda_inputs(1, T_CHECK, False, seed=1)
    h0 = torch.zeros(1, H, K, V, device=DEV)
    fla_chunk(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for T in (8192, 32768, 131072):
        q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
        fla_chunk(q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        raw, A_log, dt_bias = gate_inputs(1, T, 1000 + 4)
        try:
            fla_chunk(q=q, k=k, v=v, g=raw, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        except Exception as e:
            print(f"fla gate in kernel: {e!r}", file=sys.stderr)
    for N in (1, 32, 256):
        q, k, v, g, beta = kda_inputs(N, 1, False, seed=5)
        h0 = torch.zeros(N, H, K, V, device=DEV)
        fla_rec(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()


def summary(res: dict) -> str:
    """A few lines for a terminal: worst check errors, chunk throughput, MLA fractions of the copy bandwidth."""
    lines = [f"elapsed {res.get('elapsed_s', 0):.0f} s, warm {res.get('warm_s', 0):.0f} s, {res.get('fla_warm')}",
             f"bandwidth {res.get('bandwidth_TB_s')}"]
    cm = res.get("check_mla")
    if isinstance(cm, dict):
        lines.append("check_mla max: " + ", ".join(f"{k} {v.get('max') or 0:.1e}{'' if v.get('all_ran') else ' ERR'}"
                                                   for k, v in cm.items() if isinstance(v, dict)))
    cc = res.get("check_chunk")
    if isinstance(cc, dict):
        for key in ("standard", "bounded"):
            errs = cc.get(key) or {}
            ours = max((e for e in errs.values() if isinstance(e, float)), default=0.0)
            worst = {n: max(x for x in e.values() if isinstance(x, float)) for n, e in errs.items()
                     if isinstance(e, dict)}
            lines.append(f"check_chunk {key} max of o/final/ckpt: ours {ours:.1e}, " +
                         ", ".join(f"{n} {e:.1e}" for n, e in worst.items()))
    if isinstance(res.get("check_fla"), dict):
        lines.append(f"check_fla {res['check_fla']}")
    for row in res.get("chunk_kda") if isinstance(res.get("chunk_kda"), list) else []:
        if isinstance(row, dict):
            lines.append("chunk T {}: ".format(row.get("T")) + ", ".join(
                f"{k[:-7]} {v:.2f}" for k, v in row.items() if k.endswith("_Mtok_s")) + " M tok/s")
            fused = {k[:-26]: v for k, v in row.items() if k.endswith("_bounded_gate_in_kernel_ms")
                     and isinstance(v, float)}
            if fused:
                lines.append("chunk T {} bounded gate fused: ".format(row.get("T")) + ", ".join(
                    f"{n} {row['T'] / ms / 1e3:.2f}" for n, ms in fused.items()) + " M tok/s")
    for row in res.get("mla_decode") if isinstance(res.get("mla_decode"), list) else []:
        if isinstance(row, dict):
            lines.append(f"mla {row.get('N')}x{row.get('context')} {row.get('impl')} {row.get('form') or ''} "
                         f"{row.get('cfg')}: graph "
                         f"{row.get('graph_us', 0):.1f} us {row.get('graph_of_copy_bw', 0):.0%}, stream "
                         f"{row.get('stream_us', 0):.1f} us {row.get('stream_of_copy_bw', 0):.0%}, eager "
                         f"{row.get('eager_us', 0):.1f} us {row.get('error', '')}")
    sweeps = res.get("mla_sweep")
    for name, sw in (sweeps.items() if isinstance(sweeps, dict) else []):
        if isinstance(sw, dict):
            lines.append(f"sweep {name} top {sw.get('stage1_top')} {sw.get('stopped', '')}")
            for row in sw.get("best_per_context", []):
                lines.append(f"  best {row['N']}x{row['context']}: {row['graph_us']:.1f} us "
                             f"{row['graph_of_copy_bw']:.0%} " + json.dumps({k: row[k] for k in row if k in (
                                 "BN", "trans", "num_warps", "num_stages", "num_splits", "part_bf16", "page_tile")}))
    for row in res.get("decode") if isinstance(res.get("decode"), list) else []:
        if isinstance(row, dict):
            lines.append(f"decode N {row.get('N')}: pool {row.get('ours_pool_us', 0):.1f} us, graph "
                         f"{row.get('ours_graph_replay_us', 0):.1f} us, fla {row.get('fla_us', 0):.1f} us")
    for row in res.get("kda_decode") if isinstance(res.get("kda_decode"), list) else []:
        if isinstance(row, dict):
            lines.append(f"kda decode N {row.get('N')} {row.get('impl')} {row.get('cfg')}: graph "
                         f"{row.get('graph_us', 0):.2f} us, stream {row.get('stream_us', 0):.2f} us a layer "
                         f"{row.get('check')} {'ERR' if 'error' in row else ''}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="chunk at 8K only; without CUDA: tiny shapes on the CPU")
    ap.add_argument("--only", default="check,chunk,decode,mla", help="of check,checkmla,chunk,mla,mlasweep,mlasplits,decode,kdadecode,tune")
    ap.add_argument("--no-fla", action="store_true", help="skip fla-core (its autotuning takes minutes)")
    ap.add_argument("--old", default=None, help="other chunk.py files to check and time beside the current one")
    ap.add_argument("--old-tune", default="[]", help="launch parameters to time each --old with too: a JSON list, or lists by file stem")
    ap.add_argument("--old-kda-decode", default=None, help="another kernels/kda/decode_triton.py to time beside it")
    ap.add_argument("--mla-cand", default=None, help="other paged_decode.py files to check and time beside it")
    ap.add_argument("--mla-cfgs", default=None, help="JSON list of launch parameters to time each --mla-cand with")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after start: later steps are skipped")
    ap.add_argument("--warm-procs", type=int, default=0, help="compile the variants in this many processes first")
    ap.add_argument("--fla-bg", action="store_true", help="let fla autotune in a process of its own meanwhile")
    ap.add_argument("--fla-wait", type=float, default=110.0,
                    help="seconds after start to wait for --fla-bg at most (the checks run meanwhile)")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fla-warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-cache", default=None, help="tar.xz of TRITON_CACHE_DIR at the end")
    a = ap.parse_args()
    configure(a.quick and not torch.cuda.is_available())
    if a.warm_part is not None:
        wpart, wparts = (int(x) for x in a.warm_part.split("/"))
        warm(wpart, wparts, a)
        return
    if a.fla_warm:
        fla_warm()
        return
    t_start = time.time()
    if a.mla_cfgs:  # the candidates' variants: checked as well as timed, and warmed by the warm-up processes
        os.environ["MLA_CAND_CFGS"] = a.mla_cfgs
    parts = set(a.only.split(","))
    if SMOKE:
        parts.discard("decode")  # CUDA graphs and fla only
        parts.discard("tune")
    # also with --no-fla: then fla only fills the cache (carried to a later run)
    fla_proc = subprocess.Popen([sys.executable, __file__, "--fla-warm"]) if a.fla_bg and not SMOKE else None
    fwd = ["--only", a.only, "--old-tune", a.old_tune] + (["--old", a.old] if a.old else []) + \
        (["--mla-cand", a.mla_cand] if a.mla_cand else []) + (["--quick"] if a.quick else [])
    procs = [subprocess.Popen([sys.executable, __file__, "--warm-part", f"{i}/{a.warm_procs}", *fwd])
             for i in range(a.warm_procs)]
    for p in procs:
        p.wait()

    def wait_fla() -> str:
        if fla_proc is None:
            return "no background fla"
        try:
            fla_proc.wait(timeout=max(1.0, a.fla_wait - (time.time() - t_start)))
            return f"fla warm-up ended at {time.time() - t_start:.0f} s"
        except subprocess.TimeoutExpired:
            fla_proc.kill()
            fla_proc.wait()
            return f"fla warm-up stopped at --fla-wait {a.fla_wait:.0f} s"

    fla_chunk, fla_rec = (None, None) if a.no_fla or SMOKE else load_fla()
    old_chunk = load_old(a.old, json.loads(a.old_tune))
    mla_mods = load_mla(a.mla_cand)
    res: dict = {
        "device": "cpu (interpreter smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "fla": None, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "warm_s": time.time() - t_start, "argv": sys.argv[1:],
    }
    try:
        import fla  # type: ignore

        res["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass

    def bw() -> float:
        b = res.get("bandwidth_TB_s")
        return b["copy"] if isinstance(b, dict) and "copy" in b else 4.2

    steps: list[tuple[str, Callable[[], object]]] = []
    if "check" in parts:  # correctness only: fla may still be autotuning on the same GPU meanwhile
        steps += [("check_chunk", lambda: check_chunk(old_chunk)), ("check_mla", lambda: check_mla(mla_mods)),
                  ("check_decode", check_decode), ("check_conv", check_conv)]
    elif "checkmla" in parts:  # the MLA kernels alone (one candidate per process isolates a fault)
        steps.append(("check_mla", lambda: check_mla(mla_mods)))
    steps.append(("fla_warm", wait_fla))
    if "check" in parts and fla_chunk is not None:
        steps.append(("check_fla", lambda: check_fla(fla_chunk)))
    steps.append(("bandwidth_TB_s", copy_bandwidth))
    if "tune" in parts:  # first, so that the tables below use the best variant of this run
        steps.append(("tune", lambda: tune(bw())))

    def best(key: str):
        t = res.get("tune")
        return t.get(key) if isinstance(t, dict) else None

    if "mla" in parts:
        steps.append(("mla_decode", lambda: time_mla(bw(), mla_mods, json.loads(a.mla_cfgs) if a.mla_cfgs else None)))
    if "chunk" in parts:
        Ts = ([512] if SMOKE else [8192]) if a.quick else [8192, 32768, 131072]
        steps.append(("chunk_kda", lambda: time_chunk(fla_chunk, old_chunk, Ts, best("chunk_best"))))
    if "chunk" in parts:
        steps.append(("chunk_profile_T32K_x5", lambda: profile_chunk(old_chunk, fla_chunk)))
    if "mlasweep" in parts:
        steps.append(("mla_sweep", lambda: mla_sweep(bw(), mla_mods, t_start + a.deadline)))
    if "mlasplits" in parts:
        steps.append(("mla_splits", lambda: mla_splits(bw())))
    if "decode" in parts:
        steps.append(("decode", lambda: time_decode(fla_rec)))
    if "kdadecode" in parts:
        steps.append(("kda_decode", lambda: time_kda_decode(a.old_kda_decode)))
    for name, fn in steps:
        t0 = time.time()
        if t0 - t_start > a.deadline and name != "fla_warm":
            res[name] = "skipped: --deadline"
            continue
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"[{name}] {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        res["elapsed_s"] = time.time() - t_start
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    if fla_proc is not None and fla_proc.poll() is None:
        fla_proc.kill()
    if a.save_cache:
        cache = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
        with tarfile.open(a.save_cache, "w:xz", preset=1) as tar:
            tar.add(cache, arcname="tcache")
    print(json.dumps(res, indent=1))
    try:
        print(summary(res), file=sys.stderr)
    except Exception:
        print(traceback.format_exc()[-1000:], file=sys.stderr)


if __name__ == "__main__":
    main()
