# ruff: noqa: B023, E402  (lambdas are timed inside the iteration that made them; imports follow the shim)
"""Kernel benchmark on a CUDA device: correctness against the naive twins at Kimi shapes, and timings side by
side with fla-core (when importable). Prints one JSON document; ``--out FILE`` also writes it there.

    python bench/kernels.py --out $OUT/kernels.json [--quick] [--only check,chunk,decode,mla,tune]
        [--warm-procs 6] [--fla-bg] [--old .out/chunk_v1.py] [--save-cache $OUT/tcache.tar.xz]

``--warm-procs`` compiles the kernel variants in parallel processes first (they share TRITON_CACHE_DIR), and
``--fla-bg`` lets fla autotune in one more process meanwhile; the timings start only after all of them end.
Imports the kernels through a shim (``/tmp/kda_kernels_shim/kda_sessions/kernels`` -> ``kernels/``) when the
package is not installed, so the device needs only torch and triton.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from kda_sessions.kernels.kda.chunk import SPAN_MAX, chunk_kda_triton
from kda_sessions.kernels.kda.fused_recurrent import fused_recurrent_kda_triton
from kda_sessions.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged
from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

H, K, V = 32, 128, 128
DEV = "cuda"
T_CHECK = 2048

# launch-parameter variants timed by --only tune (the first of each list is the default in the launchers)
CHUNK_VARIANTS: list[dict] = [
    {}, {"intra_bk": 64}, {"intra_warps": 8}, {"intra_bk": 64, "intra_warps": 8}, {"inv_ieee": 0},
    {"intra_stages": 1}, {"state_bv": 32}, {"state_bv": 32, "state_stages": 3},
]
MLA_VARIANTS: list[dict] = [
    {"BN": 64, "BH": 32, "num_warps": 4, "num_stages": 3}, {"BN": 32, "BH": 32, "num_warps": 4, "num_stages": 3},
    {"BN": 32, "BH": 32, "num_warps": 8, "num_stages": 3}, {"BN": 64, "BH": 32, "num_warps": 8, "num_stages": 2},
    {"BN": 32, "BH": 16, "num_warps": 4, "num_stages": 3}, {"BN": 64, "BH": 64, "num_warps": 8, "num_stages": 2},
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds (triton's do_bench: events, L2 flushed between runs)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def gate_inputs(B: int, T: int, seed: int):
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    raw = torch.randn(B, T, H, K, device=DEV, generator=g_)
    A_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=g_))
    dt_bias = torch.randn(H * K, device=DEV, generator=g_) * 0.5 - 2.0
    return raw, A_log, dt_bias


def kda_inputs(B: int, T: int, bounded: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
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


def load_old(paths: str | None) -> dict:
    """Previous versions of kernels/kda/chunk.py (e.g. .out/chunk_v1.py,.out/chunk_v2.py) by file stem, for
    before/after in one run."""
    out = {}
    for path in (paths or "").split(","):
        if not path or not Path(path).exists():
            continue
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out[Path(path).stem] = mod.chunk_kda_triton
    return out


def check_chunk(fla_chunk, old_chunk) -> dict:
    out: dict = {}
    cu = torch.tensor([0, 700, 1301, T_CHECK], device=DEV, dtype=torch.int32)
    ck = [[1, 64, 333, 700], [5], [17, 640, 747]]
    h0 = torch.randn(3, H, K, V, device=DEV) * 0.1
    for bounded in (False, True):
        q, k, v, g, beta = kda_inputs(1, T_CHECK, bounded, seed=1)
        ro, rf, rc = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, h0, True, cu, True, ck)
        key = "bounded" if bounded else "standard"
        o, f, c = chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, ck)
        out[key] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        o, f, c = chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, ck, tune={"span_max": -1.0})
        out[key]["exact_diagonal_path"] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        raw, A_log, dt_bias = gate_inputs(1, T_CHECK, 1000 + 1)  # the raw logits behind g
        lb = -5.0 if bounded else None
        o, f, c = chunk_kda_triton(q, k, v, raw, beta, None, h0, True, cu, True, ck, use_gate_in_kernel=True,
                                   A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
        out[key]["gate_in_kernel"] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        for name, old in old_chunk.items():
            o, f, c = old(q, k, v, g, beta, None, h0, True, cu, True, ck)
            out[key][name] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
    if fla_chunk is not None:  # one sequence, no cu_seqlens: fla's autotuning of the varlen forms takes minutes
        q, k, v, g, beta = kda_inputs(1, T_CHECK, False, seed=1)
        ro, rf, _ = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, h0[:1], True, None, True)
        o, f, _ = chunk_kda_triton(q, k, v, g, beta, None, h0[:1], True, None, True)
        fo, ff = fla_chunk(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0[:1], output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        out["single_T2048_h0"] = {"o": rel(o, ro), "final": rel(f, rf), "fla_o": rel(fo, ro), "fla_final": rel(ff, rf)}
    # short recurrent reference for the twin itself (T small: the loop is slow)
    q, k, v, g, beta = kda_inputs(1, 200, False, seed=2)
    o, f, _ = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True)
    ro, rf, _ = naive_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(), None, None, True, None, True)
    out["vs_recurrent_T200"] = {"o": rel(o, ro), "final": rel(f, rf)}
    # how often the benchmark's standard gate sends a (16-token sub-chunk, head, 32-channel block) to the exact path
    _, _, _, g, _ = kda_inputs(1, 32768, False, seed=4)
    span = -g.view(32768 // 16, 16, H, K // 32, 32).sum(1).amin(-1)  # [sub-chunks, H, K blocks] = max over channels
    out["exact_path_fraction_T32K"] = float((span > SPAN_MAX).float().mean())
    return out


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


def mla_setup(lens: list[int], P: int = 64, R: int = 512, DR: int = 64, seed: int = 0):
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    N = len(lens)
    max_pages = max(math.ceil(L / P) for L in lens)
    total_pages = sum(math.ceil(L / P) for L in lens) + 8
    kv = torch.randn(total_pages, P, R + DR, device=DEV, generator=g_).bfloat16()
    perm = torch.randperm(total_pages, device=DEV, generator=g_).int()
    pt = torch.zeros(N, max_pages, device=DEV, dtype=torch.int32)
    used = 0
    for n, L in enumerate(lens):
        np_ = math.ceil(L / P)
        pt[n, :np_] = perm[used : used + np_]
        used += np_
    ql = torch.randn(N, H, R, device=DEV, generator=g_).bfloat16()
    qp = torch.randn(N, H, DR, device=DEV, generator=g_).bfloat16()
    sl = torch.tensor(lens, device=DEV, dtype=torch.int32)
    return ql, qp, kv, pt, sl, (128 + 64) ** -0.5


def check_mla() -> dict:
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    out: dict = {}
    for P in (16, 64):
        args = mla_setup([1, 1000, 5000, 33000], P=P)
        ro = naive_mla_decode_paged(args[0].float(), args[1].float(), args[2].float(), *args[3:])
        out[f"P{P}"] = rel(mla_decode_paged_triton(*args), ro)
        for i, cfg in enumerate(MLA_VARIANTS[1:], 1):
            out[f"P{P}_variant{i}"] = rel(mla_mod._launch(*args, **cfg), ro)
    return out


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=100)
    return 2 * x.numel() / (ms * 1e-3) / 1e12


def time_chunk(fla_chunk, old_chunk: dict, Ts: list[int], cfg: dict | None = None) -> list[dict]:
    rows = []
    for T in Ts:
        q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
        row: dict = {"T": T, "cfg": cfg}
        ms = bench(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True,
                                                                         tune=cfg), rep=300)
        row["ours_ms"], row["ours_Mtok_s"] = ms, T / ms / 1e3
        raw, A_log, dt_bias = gate_inputs(1, T, 1000 + 4)
        ms = bench(lambda: chunk_kda_triton(q, k, v, raw, beta, None, None, True, None, True, use_gate_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias, tune=cfg), rep=300)
        row["ours_gate_in_kernel_ms"] = ms
        ms = bench(lambda: chunk_kda_triton(q, k, v, raw, beta, None, None, True, None, True, use_gate_in_kernel=True,
                                            A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, tune=cfg), rep=300)
        row["ours_bounded_gate_in_kernel_ms"] = ms
        for name, old in old_chunk.items():
            ms = bench(lambda old=old: old(q, k, v, g, beta, None, None, True, None, True), rep=100)
            row[f"{name}_ms"], row[f"{name}_Mtok_s"] = ms, T / ms / 1e3
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


def time_mla(bw_tb_s: float, cfg: dict | None = None) -> list[dict]:
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    rows = []
    for lens in ([32768], [131072], [1048576], [32768] * 32):
        args = mla_setup(lens)
        ms = bench(lambda args=args: mla_mod._launch(*args, **(cfg or {})))
        bytes_ = sum(lens) * (512 + 64) * 2
        tb = bytes_ / (ms * 1e-3) / 1e12
        rows.append({"N": len(lens), "context": lens[0], "cfg": cfg, "us": ms * 1e3, "TB_s": tb,
                     "fraction_of_copy_bw": tb / bw_tb_s if bw_tb_s else None})
        del args
        torch.cuda.empty_cache()
    return rows


def tune(bw_tb_s: float) -> dict:
    """Variants of the launch parameters, timed in one run (the chosen defaults live in the launchers)."""
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    out: dict = {"mla": [], "chunk": []}
    best_1m = (float("inf"), MLA_VARIANTS[0])
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for lens in ([1048576], [131072], [32768] * 32, [32768]):
        args = mla_setup(lens)
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
            ms = bench(lambda cfg=cfg: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, tune=cfg))
            out["chunk"].append({"cfg": cfg, "ms": ms, "Mtok_s": T / ms / 1e3})
            best = min(best, (ms, cfg), key=lambda x: x[0])
        except Exception as e:
            out["chunk"].append({"cfg": cfg, "error": repr(e)[:300]})
    out["chunk_best"] = best[1]
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, tune=best[1])
            torch.cuda.synchronize()
        out["chunk_profile_T32K_x5"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    except Exception as e:
        out["chunk_profile_T32K_x5"] = repr(e)[:300]
    return out


def warm(part: int, parts: int, old_path: str | None) -> None:
    """Compile this process's share of the kernel variants (one small launch each) into TRITON_CACHE_DIR."""
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    q, k, v, g, beta = kda_inputs(1, 256, False, seed=9)
    for cfg in CHUNK_VARIANTS[part::parts]:
        chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, tune=cfg)
    if part == 0:  # the forms the checks use: varlen + h0 + checkpoints, gate in kernel, exact path
        cu = torch.tensor([0, 100, 256], device=DEV, dtype=torch.int32)
        h0 = torch.zeros(2, H, K, V, device=DEV)
        chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, [[5], [7]])
        chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, [[5], [7]], tune={"span_max": -1.0})
    if part == 1 % parts:
        raw, A_log, dt_bias = gate_inputs(1, 256, 3)
        cu = torch.tensor([0, 100, 256], device=DEV, dtype=torch.int32)
        h0 = torch.zeros(2, H, K, V, device=DEV)
        for lb in (None, -5.0):
            chunk_kda_triton(q, k, v, raw, beta, None, h0, True, cu, True, [[5], [7]], use_gate_in_kernel=True,
                             A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
            chunk_kda_triton(q, k, v, raw, beta, None, None, True, None, True, use_gate_in_kernel=True,
                             A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
    olds = list(load_old(old_path).values())
    for old in olds[part::parts]:
        cu = torch.tensor([0, 100, 256], device=DEV, dtype=torch.int32)
        old(q, k, v, g, beta, None, None, True, None, True)
        old(q, k, v, g, beta, None, torch.zeros(2, H, K, V, device=DEV), True, cu, True, [[5], [7]])
    args = mla_setup([32768])
    for cfg in MLA_VARIANTS[part::parts]:
        mla_mod._launch(*args, 8, **cfg)
    args = mla_setup([1, 1000, 5000, 33000], P=16)  # the check's page size
    for cfg in MLA_VARIANTS[part::parts]:
        mla_mod._launch(*args, **cfg)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="check,chunk,decode,mla")
    ap.add_argument("--no-fla", action="store_true", help="skip fla-core (its autotuning takes minutes)")
    ap.add_argument("--old", default=None, help="a previous chunk.py to time beside the current one")
    ap.add_argument("--warm-procs", type=int, default=0, help="compile the variants in this many processes first")
    ap.add_argument("--fla-bg", action="store_true", help="let fla autotune in a process of its own meanwhile")
    ap.add_argument("--fla-wait", type=float, default=110.0, help="seconds to wait for --fla-bg at most")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fla-warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-cache", default=None, help="tar.xz of TRITON_CACHE_DIR at the end")
    a = ap.parse_args()
    if a.warm_part is not None:
        wpart, wparts = (int(x) for x in a.warm_part.split("/"))
        warm(wpart, wparts, a.old)
        return
    if a.fla_warm:
        fla_warm()
        return
    t_start = time.time()
    # also with --no-fla: then fla only fills the cache (carried to a later run)
    fla_proc = subprocess.Popen([sys.executable, __file__, "--fla-warm"]) if a.fla_bg else None
    procs = []
    for i in range(a.warm_procs):
        cmd = [sys.executable, __file__, "--warm-part", f"{i}/{a.warm_procs}"] + (["--old", a.old] if a.old else [])
        procs.append(subprocess.Popen(cmd))
    for p in procs:
        p.wait()
    if fla_proc is not None:
        try:
            fla_proc.wait(timeout=max(1.0, a.fla_wait - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            fla_proc.kill()
            fla_proc.wait()
            print("fla warm-up stopped at --fla-wait", file=sys.stderr)
    parts = set(a.only.split(","))
    fla_chunk, fla_rec = (None, None) if a.no_fla else load_fla()
    old_chunk = load_old(a.old)
    res: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "fla": None, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "warm_s": time.time() - t_start,
    }
    try:
        import fla  # type: ignore

        res["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    steps: list[tuple[str, Callable[[], object]]] = []
    if "check" in parts:
        steps += [("check_chunk", lambda: check_chunk(fla_chunk, old_chunk)), ("check_decode", check_decode),
                  ("check_conv", check_conv), ("check_mla", check_mla)]
    steps.append(("copy_bw_TB_s", copy_bandwidth))
    if "tune" in parts:  # first, so that the tables below use the best variant of this run
        steps.append(("tune", lambda: tune(res.get("copy_bw_TB_s") or 4.2)))

    def best(key: str):
        t = res.get("tune")
        return t.get(key) if isinstance(t, dict) else None

    if "chunk" in parts:
        Ts = [8192] if a.quick else [8192, 32768, 131072]
        steps.append(("chunk_kda", lambda: time_chunk(fla_chunk, old_chunk, Ts, best("chunk_best"))))
    if "mla" in parts:
        steps.append(("mla_decode", lambda: time_mla(res.get("copy_bw_TB_s") or 4.2, best("mla_best"))))
    if "decode" in parts:
        steps.append(("decode", lambda: time_decode(fla_rec)))
    for name, fn in steps:
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"[{name}] {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    if a.save_cache:
        cache = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
        with tarfile.open(a.save_cache, "w:xz", preset=1) as tar:
            tar.add(cache, arcname="tcache")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
