# ruff: noqa: B023  (the lambdas are timed inside the loop iteration that made them)
"""Kernel benchmark on a CUDA device: correctness against the naive twins at Kimi shapes, and timings side by
side with fla-core (when importable). Prints one JSON document; ``--out FILE`` also writes it there.

    python bench/kernels.py --out $OUT/kernels.json [--quick] [--only chunk,decode,mla,conv,check]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable

import torch
import triton
import triton.testing

from kda_sessions.kernels.conv.naive import naive_causal_conv
from kda_sessions.kernels.conv.triton_conv import causal_conv_triton
from kda_sessions.kernels.gate.naive import naive_kda_gate
from kda_sessions.kernels.kda.chunk import chunk_kda_triton
from kda_sessions.kernels.kda.fused_recurrent import fused_recurrent_kda_triton
from kda_sessions.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged
from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

H, K, V = 32, 128, 128
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds (triton's do_bench: events, L2 flushed between runs)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def kda_inputs(B: int, T: int, bounded: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    g_ = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    k = torch.randn(B, T, H, K, device=DEV, generator=g_).to(dtype)
    v = torch.randn(B, T, H, V, device=DEV, generator=g_).to(dtype)
    raw = torch.randn(B, T, H, K, device=DEV, generator=g_)
    A_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=g_))
    dt_bias = torch.randn(H * K, device=DEV, generator=g_) * 0.5 - 2.0
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


def check_chunk(fla_chunk) -> dict:
    out = {}
    for bounded in (False, True):
        T = 2048
        q, k, v, g, beta = kda_inputs(1, T, bounded, seed=1)
        cu = torch.tensor([0, 700, 1301, T], device=DEV, dtype=torch.int32)
        h0 = torch.randn(3, H, K, V, device=DEV) * 0.1
        ck = [[1, 64, 333, 700], [5], [17, 640, 747]]
        o, f, c = chunk_kda_triton(q, k, v, g, beta, None, h0, True, cu, True, ck)
        ro, rf, rc = naive_chunk_kda(q.float(), k.float(), v.float(), g, beta.float(), None, h0, True, cu, True, ck)
        key = "bounded" if bounded else "standard"
        out[key] = {"o": rel(o, ro), "final": rel(f, rf), "checkpoints": rel(c, rc)}
        if fla_chunk is not None:
            fo, ff = fla_chunk(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
            out[key]["fla_o"] = rel(fo, ro)
            out[key]["fla_final"] = rel(ff, rf)
    # short recurrent reference for the twin itself (T small: the loop is slow)
    q, k, v, g, beta = kda_inputs(1, 200, False, seed=2)
    o, f, _ = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True)
    ro, rf, _ = naive_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(), None, None, True, None, True)
    out["vs_recurrent_T200"] = {"o": rel(o, ro), "final": rel(f, rf)}
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
    out = {}
    for P in (16, 64):
        args = mla_setup([1, 1000, 5000, 33000], P=P)
        o = mla_decode_paged_triton(*args)
        ro = naive_mla_decode_paged(args[0].float(), args[1].float(), args[2].float(), *args[3:])
        out[f"P{P}"] = rel(o, ro)
    return out


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=100)
    return 2 * x.numel() / (ms * 1e-3) / 1e12


def time_chunk(fla_chunk, Ts: list[int]) -> list[dict]:
    rows = []
    for T in Ts:
        q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
        row: dict = {"T": T}
        ms = bench(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True),
                   rep=300)
        row["ours_ms"], row["ours_Mtok_s"] = ms, T / ms / 1e3
        if fla_chunk is not None:
            gb = g

            def f(q=q, k=k, v=v, gb=gb, beta=beta):
                return fla_chunk(q=q, k=k, v=v, g=gb, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

            ms = bench(f, rep=300)
            row["fla_ms"], row["fla_Mtok_s"] = ms, T / ms / 1e3
        rows.append(row)
        del q, k, v, g, beta
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


def time_mla(bw_tb_s: float) -> list[dict]:
    rows = []
    for lens in ([32768], [131072], [1048576], [32768] * 32):
        args = mla_setup(lens)
        ms = bench(lambda args=args: mla_decode_paged_triton(*args))
        bytes_ = sum(lens) * (512 + 64) * 2
        tb = bytes_ / (ms * 1e-3) / 1e12
        rows.append({"N": len(lens), "context": lens[0], "us": ms * 1e3, "TB_s": tb,
                     "fraction_of_copy_bw": tb / bw_tb_s if bw_tb_s else None})
        del args
        torch.cuda.empty_cache()
    return rows


def tune(chunk: bool = True) -> dict:
    """Variants of the launch parameters, timed in one run (the chosen defaults live in the launchers)."""
    from kda_sessions.kernels.kda import chunk as chunk_mod
    from kda_sessions.kernels.mla import paged_decode as mla_mod

    out: dict = {"mla": [], "chunk": []}
    for lens in ([1048576], [32768] * 32, [32768]):
        args = mla_setup(lens)
        bytes_ = sum(lens) * (512 + 64) * 2
        for BN, BH, nw, ns in ((32, 32, 4, 3), (64, 32, 4, 3), (32, 32, 4, 4), (64, 32, 8, 3), (16, 32, 4, 4)):
            try:
                ms = bench(lambda args=args, BN=BN, BH=BH, nw=nw, ns=ns: mla_mod._launch(
                    *args, BN=BN, BH=BH, num_warps=nw, num_stages=ns))
                out["mla"].append({"N": len(lens), "L": lens[0], "BN": BN, "BH": BH, "warps": nw, "stages": ns,
                                   "us": ms * 1e3, "TB_s": bytes_ / ms / 1e9})
            except Exception as e:
                out["mla"].append({"BN": BN, "BH": BH, "warps": nw, "stages": ns, "error": repr(e)[:300]})
        del args
    if not chunk:
        return out
    T = 32768
    q, k, v, g, beta = kda_inputs(1, T, False, seed=4)
    flat = [x.reshape(T, H, -1) if x.dim() == 4 else x.reshape(T, H) for x in (q, k, v, g, beta)]
    for cfg in ({}, {"intra_warps": 8}, {"state_bv": 32}):
        try:
            ms = bench(lambda cfg=cfg: chunk_mod._launch(*flat, K**-0.5, None, True, [0, T], True, None, cfg))
            out["chunk"].append({"cfg": cfg, "ms": ms, "Mtok_s": T / ms / 1e3})
        except Exception as e:
            out["chunk"].append({"cfg": cfg, "error": repr(e)[:300]})
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                chunk_mod._launch(*flat, K**-0.5, None, True, [0, T], True, None, None)
            torch.cuda.synchronize()
        out["chunk_profile_T32K_x5"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    except Exception as e:
        out["chunk_profile_T32K_x5"] = repr(e)[:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="check,chunk,decode,mla")
    ap.add_argument("--no-fla", action="store_true", help="skip fla-core (its autotuning takes minutes)")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    fla_chunk, fla_rec = (None, None) if a.no_fla else load_fla()
    res: dict = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "fla": None, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import fla  # type: ignore

        res["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    steps: list[tuple[str, Callable[[], object]]] = []
    if "check" in parts:
        steps += [("check_chunk", lambda: check_chunk(fla_chunk)), ("check_decode", check_decode),
                  ("check_conv", check_conv), ("check_mla", check_mla)]
    steps.append(("copy_bw_TB_s", copy_bandwidth))
    if "mla" in parts:
        steps.append(("mla_decode", lambda: time_mla(res.get("copy_bw_TB_s") or 4.2)))
    if "chunk" in parts:
        steps.append(("chunk_kda", lambda: time_chunk(fla_chunk, [8192] if a.quick else [8192, 32768, 131072])))
    if "decode" in parts:
        steps.append(("decode", lambda: time_decode(fla_rec)))
    if "tune" in parts or "tunemla" in parts:
        steps.append(("tune", lambda: tune(chunk="tune" in parts)))
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
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
