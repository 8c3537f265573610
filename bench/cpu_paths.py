"""The CPU paths of the model, piece by piece: the KDA chunk twin, MLA prefill attention, a whole forward of
``tiny`` and its decode step (docs/benchmarks.md, "CPU prefill").

    python bench/cpu_paths.py [--quick] [--out FILE]

- ``kda_chunk``: one KDA layer's ``naive_chunk_kda`` (T tokens, l2-normed q/k, no grad) at chunk sizes 16 and 64
  and ``chunk_kda_cpu`` (the batched form the model runs on a CPU), for tiny's shape (T 3,500, H 4, K = V = 64)
  and Kimi's (T 1,024, H 32, K = V = 128), with their relative RMS difference from the token-by-token recurrence.
- ``decode_layout``: the one-row matmuls of a ``tiny`` decode step (its weight shapes, one read of each), with the
  weights as a linear stores them ([out, in], ``x @ w.t()``), all transposed ([in, out] contiguous), each in the
  layout ``model/fused.row_matmul_weight`` picks (the longer dimension contiguous: what the CPU decode uses), and
  that copied into one buffer on transparent huge pages (``model/fused.pack``, what decode uses), and that in
  bfloat16 (half the bytes): what decides the CPU decode's weight layout, dtype and pages; and ``reduction_f32`` /
  ``reduction_bf16``: all of them as one ``torch.compile``d function of ``model/fused.row_matmul`` products and sums
  over ``reduction_weight``s (what ``HybridModel.compile_cpu_decode`` runs), float32 and bfloat16 weights.
- ``mla_sdpa``: causal SDPA at T 3,500 over H 4 heads, q/k 96 wide and v 64 (tiny's MLA), as the model calls it
  (one tile of ``kernels/mla/prefill_cpu.py``: v padded, torch's CPU flash kernel) against torch's math path
  (``SDPBackend.MATH``).
- ``forward``: ``HybridModel.forward`` of ``tiny`` (float32) over T 3,500 random byte tokens.
- ``decode``: ``tiny`` decode steps (``HybridModel.step``, one token per sequence) of B sequences holding 2,048
  tokens each, greedy argmax included.

Each figure is the median of ``--reps`` runs after one warm-up, after waiting for the machine to be quiet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from model_cpu import PooledRunner

from kda_sessions.kernels.kda.chunk_cpu import chunk_kda_cpu
from kda_sessions.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kda_sessions.model import load_model
from kda_sessions.model.fused import pack, reduction_weight, row_matmul, row_matmul_weight


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None, scale: float) -> torch.Tensor:
    """Causal SDPA as MLA prefill runs it on a CPU: v zero-padded to k's width, 4-D, so torch picks its flash
    kernel."""
    dv = v.shape[-1]
    v = F.pad(v, (0, k.shape[-1] - dv))
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0, ..., :dv]


def _median_s(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def kda_chunk(T: int, H: int, K: int, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, K, generator=gen)
    g, beta = -torch.rand(1, T, H, K, generator=gen) * 0.5, torch.rand(1, T, H, generator=gen)
    ref, _, _ = naive_recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out: dict[str, Any] = {"T": T, "H": H, "K": K, "quiet": common.wait_quiet()}
    runs: dict[str, Callable[[], Any]] = {
        f"chunk{C}": lambda C=C: naive_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=C)
        for C in (16, 64)
    }
    runs["chunk_cpu"] = lambda: chunk_kda_cpu(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        for name, fn in runs.items():
            out[f"{name}_ms"] = round(_median_s(fn, reps) * 1000, 1)
            out[f"{name}_rel_vs_recurrent"] = float(f"{_rel(fn()[0], ref):.2e}")
    return out


def decode_layout(reps: int) -> dict[str, Any]:
    m = load_model("tiny", device="cpu", dtype=torch.float32)
    weights = [p.detach() for n, p in m.named_parameters() if p.dim() == 2 and "embed" not in n]
    layouts = {
        "out_in_f32": [w.t() for w in weights],
        "in_out_f32": [w.t().contiguous() for w in weights],
        "picked_f32": [row_matmul_weight(w) for w in weights],
        "picked_f32_huge_pages": list(pack([row_matmul_weight(w) for w in weights])),
        "picked_bf16": [row_matmul_weight(w.bfloat16()) for w in weights],
    }
    out: dict[str, Any] = {"weights_MB": round(sum(w.numel() for w in weights) * 4 / 1e6, 1),
                           "threads": torch.get_num_threads(), "quiet": common.wait_quiet()}
    for name, ws in layouts.items():
        xs = [torch.randn(1, w.shape[0], dtype=w.dtype) for w in ws]  # every w is [in, out], as x @ w takes it

        def step(ws: list[torch.Tensor] = ws, xs: list[torch.Tensor] = xs) -> None:
            for _ in range(20):
                for x, w in zip(xs, ws):
                    x @ w

        out[f"{name}_ms"] = round(_median_s(step, reps) * 1000 / 20, 2)
    for name, dtype in (("reduction_f32", None), ("reduction_bf16", torch.bfloat16)):
        rws = list(pack([reduction_weight(w, dtype) for w in weights]))
        rxs = [torch.randn(1, w.shape[0]) for w in rws]
        fn = torch.compile(lambda xs, ws: [row_matmul(x, w) for x, w in zip(xs, ws)], fullgraph=True)

        def compiled(ws: list[torch.Tensor] = rws, xs: list[torch.Tensor] = rxs, fn: Any = fn) -> None:
            for _ in range(20):
                fn(xs, ws)

        with torch.no_grad():
            out[f"{name}_ms"] = round(_median_s(compiled, reps) * 1000 / 20, 2)
    return out


def mla_sdpa(T: int, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(4, T, 96, generator=gen), torch.randn(4, T, 96, generator=gen)
    v = torch.randn(4, T, 64, generator=gen)
    quiet = common.wait_quiet()
    used = _attention(q, k, v, None, 0.1)

    def math() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)

    return {"T": T, "model_path_ms": round(_median_s(lambda: _attention(q, k, v, None, 0.1), reps) * 1000, 1),
            "math_path_ms": round(_median_s(math, reps) * 1000, 1), "rel_diff": float(f"{_rel(used, math()):.2e}"),
            "quiet": quiet}


def forward(T: int, reps: int) -> dict[str, Any]:
    m = load_model("tiny", device="cpu", dtype=torch.float32)
    ids = torch.tensor([common.random_tokens(T, seed=T)])
    quiet = common.wait_quiet()
    with torch.no_grad():
        s = _median_s(lambda: m.forward(ids), reps)
    return {"T": T, "s": round(s, 3), "tok_per_s": round(T / s), "quiet": quiet}


def decode(B: int, context: int, steps: int, reps: int) -> dict[str, Any]:
    m = load_model("tiny", device="cpu", dtype=torch.float32)
    r = PooledRunner(m, B, context + (reps + 1) * steps + 2)
    seqs = list(range(B))
    with torch.no_grad():
        nxt = r.feed(seqs, [common.random_tokens(context, seed=b) for b in seqs]).argmax(-1).tolist()
        quiet = common.wait_quiet()

        def block() -> None:
            nonlocal nxt
            for _ in range(steps):
                nxt = r.feed(seqs, [[t] for t in nxt]).argmax(-1).tolist()

        s = _median_s(block, reps)
    return {"batch": B, "context": context, "ms_per_step": round(1000 * s / steps, 2), "quiet": quiet}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes, one rep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    reps = 1 if args.quick else args.reps
    shapes = [(256, 2, 16)] if args.quick else [(3500, 4, 64), (1024, 32, 128)]
    T = 256 if args.quick else 3500
    result = {
        "machine": common.machine(),
        "command": " ".join(["python", *sys.argv]),
        "kda_chunk": [kda_chunk(t, h, k, reps) for t, h, k in shapes],
        "decode_layout": decode_layout(max(reps, 5)),
        "mla_sdpa": mla_sdpa(T, reps),
        "forward": forward(T, reps),
        "decode": [decode(b, 256 if args.quick else 2048, 8 if args.quick else 50, reps) for b in (1, 8)],
    }
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
