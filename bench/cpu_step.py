"""Where ``tiny``'s one-sequence CPU decode step goes, on this machine's torch threads.

    python bench/cpu_step.py [--out FILE]

- ``matvec``: one-row matmuls over 64 MiB of float32 weights (beyond the caches), one thread: GB/s of float32
  weight read by the BLAS (``torch.mm``) and by ``model.fused.row_mm`` (FBGEMM's float16 packs, where torch has
  FBGEMM), beside a read-only stream (``sum``) of the same bytes; us per matmul by shape.
- ``step``: the decode step at 1K context on one thread (best of five blocks of 100 steps), with the float16 packs
  and without (``fused.HALF_ROW_WEIGHTS``), and the time inside each layer kind's calls (KDA, MLA, FFN, norms).
- ``spin_down``: 1-thread steps right after a block of 2-thread steps (libgomp's idle threads still spinning) against
  steady 1-thread and 2-thread steps, ms (median of 5 blocks; the first 4 steps of each 1-thread block, the rest).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from model_cpu import PooledRunner

from kda_sessions.model import fused, load_model
from kda_sessions.model import model as model_mod
from kda_sessions.model.kda import KDAAttention
from kda_sessions.model.mla import MLAttention

MIB = 2**20


def _best(fn: Any, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matvec() -> dict[str, Any]:
    torch.set_num_threads(1)
    src = torch.randn(64 * MIB // 4)
    out: dict[str, Any] = {"read_stream_gbs": round(64 * MIB / _best(src.sum) / 1e9, 1), "shapes": {}}
    for i, o in [(256, 1024), (1024, 256), (256, 2048)]:
        n = 64 * MIB // (i * o * 4)
        ws = [(torch.randn(i, o) * 0.05).bfloat16().float() for _ in range(n)]  # bfloat16 values, as tiny's
        x = torch.randn(1, i)
        blas = _best(lambda x=x, ws=ws: [torch.mm(x, w) for w in ws])
        half = _best(lambda x=x, ws=ws: [fused.row_mm(x, w) for w in ws])
        out["shapes"][f"{i}x{o}"] = {"blas_gbs": round(64 * MIB / blas / 1e9, 1), "blas_us": round(blas / n * 1e6, 1),
                                     "row_mm_gbs": round(64 * MIB / half / 1e9, 1),
                                     "row_mm_us": round(half / n * 1e6, 1)}
    return out


def step(model: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)
    saved = []

    def wrap(owner: Any, name: str, key: str) -> None:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        setattr(owner, name, timed)

    wrap(KDAAttention, "decode_one", "kda")
    wrap(MLAttention, "decode_one", "mla")
    wrap(model_mod, "swiglu_residual_rows", "ffn")
    wrap(model_mod._CpuDecodePlan, "norm", "norm")
    out = {}
    try:
        for half in (True, False):
            fused.HALF_ROW_WEIGHTS = half
            r = PooledRunner(model, 1, 1024 + 700)
            with torch.no_grad():
                nxt = r.feed([0], [common.random_tokens(1024, seed=1)]).argmax(-1).tolist()
                for _ in range(10):
                    nxt = r.feed([0], [nxt]).argmax(-1).tolist()
                best: tuple[float, dict[str, float]] | None = None
                for _ in range(5):
                    acc.clear()
                    t = time.perf_counter()
                    for _ in range(100):
                        nxt = r.feed([0], [nxt]).argmax(-1).tolist()
                    ms = (time.perf_counter() - t) * 10  # per step, ms
                    if best is None or ms < best[0]:
                        best = (ms, {k: round(v * 10, 3) for k, v in acc.items()})
            assert best is not None
            parts = best[1]
            out["float16 packs" if half else "float32 BLAS"] = {
                "step_ms": round(best[0], 3), **parts, "rest": round(best[0] - sum(parts.values()), 3)}
    finally:
        fused.HALF_ROW_WEIGHTS = True
        for owner, name, f in saved:
            setattr(owner, name, f)
    return out


def spin_down(model: Any) -> dict[str, Any]:
    r = PooledRunner(model, 1, 1024 + 1400)
    first, after, two = [], [], []
    with torch.no_grad():
        torch.set_num_threads(1)
        nxt = r.feed([0], [common.random_tokens(1024, seed=1)]).argmax(-1).tolist()
        for block in range(10):
            n = 2 if block % 2 else 1
            torch.set_num_threads(n)
            ts = []
            for _ in range(24):
                t = time.perf_counter()
                nxt = r.feed([0], [nxt]).argmax(-1).tolist()
                ts.append((time.perf_counter() - t) * 1000)
            if n == 2:
                two.append(statistics.median(ts))
            elif block:  # a 1-thread block after a 2-thread one
                first.append(statistics.median(ts[:4]))
                after.append(statistics.median(ts[4:]))
    torch.set_num_threads(1)
    return {"one_thread_first_4_ms": round(statistics.median(first), 2),
            "one_thread_rest_ms": round(statistics.median(after), 2), "two_threads_ms": round(statistics.median(two), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    before = torch.get_num_threads()
    model = load_model("tiny")
    res = {"machine": common.machine(), "command": "python bench/cpu_step.py", "matvec": matvec(), "step": step(model),
           "spin_down": spin_down(model) if before > 1 else None}
    torch.set_num_threads(before)
    common.emit(res, args.out)


if __name__ == "__main__":
    main()
