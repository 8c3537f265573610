# ruff: noqa: B023  (the launch closures are timed inside the iteration that made them)
"""fused_recurrent_kda decode (T 1, pool in place) over its launch: V block and warps, on the device:

    python3 bench/candidates/decode_sweep.py [1,32,256]

For each sequence count, every (BV, num_warps) of the shipped kernel is checked against the shipped launch (output
and the pool's slots, max abs difference) and timed: do_bench median (L2 flushed) and a CUDA graph of one call
replayed 200 times back to back. Prints one JSON line per launch, the shipped one marked."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_one import kb  # bench/kernels.py loaded by path


def main() -> None:
    Ns = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,32,256").split(",")]
    kb.configure(False)
    from kda_sessions.kernels.kda import fused_recurrent as fr

    H, K, V = kb.H, kb.K, kb.V
    for N in Ns:
        q, k, v, g, beta = kb.kda_inputs(N, 1, False, seed=5)
        pool0 = torch.randn(N + 8, H, K, V, device="cuda") * 0.1
        slots = torch.arange(N, device="cuda", dtype=torch.int32)
        ref_pool = pool0.clone()
        ref_o, _ = fr.fused_recurrent_kda_triton(q, k, v, g, beta, None, None, False, None, True, ref_pool, slots)
        shipped_bv, shipped_w = fr.launch_config(N, H, V)
        args = (q.reshape(N, H, K).contiguous(), k.reshape(N, H, K).contiguous(), v.reshape(N, H, V).contiguous(),
                g.reshape(N, H, K).contiguous(), beta.reshape(N, H).contiguous())
        for BV in (16, 32, 64, 128):
            for w in (1, 2, 4, 8):
                def f(pool, o, BV=BV, w=w):
                    fr._fused_recurrent_kernel[(triton.cdiv(V, BV), N * H)](
                        *args, o, None, None, pool, slots, None, K**-0.5, 1, H=H, K=K, V=V, BK=K, BV=BV,
                        HAS_H0=False, USE_POOL=True, STORE_FINAL=False, IS_VARLEN=False, NORM=True, num_warps=w)
                row: dict = {"N": N, "BV": BV, "num_warps": w, "shipped": (BV, w) == (shipped_bv, shipped_w)}
                try:
                    pool = pool0.clone()
                    o = torch.empty_like(args[2])
                    f(pool, o)
                    torch.cuda.synchronize()
                    row["o_diff"] = float((o.float() - ref_o.reshape(N, H, V).float()).abs().max())
                    row["pool_diff"] = float((pool - ref_pool).abs().max())
                    row["us"] = round(1e3 * kb.bench(lambda: f(pool, o)), 2)
                    graph = kb.capture([lambda: f(pool, o)])
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(200):
                        graph.replay()
                    torch.cuda.synchronize()
                    row["graph_b2b_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 2)
                    del graph
                except Exception as e:  # a launch that does not compile or fit is reported, not fatal
                    row["error"] = repr(e)[:200]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
