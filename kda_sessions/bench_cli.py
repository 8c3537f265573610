"""``kda-sessions bench``: tokens/s through the Engine beside what the machine allows, measured in the same run.

Prefill and decode (one session, after an untimed warm-up session) are timed through the Engine; the first
token of a resumed session against one whose context is prefilled again. The floor is measured right after on the same device: a matmul's
GFLOP/s (the model's dtype) and a memory copy's GB/s (read + write). Prefill's floor is that matmul rate over
2 FLOPs per active weight a token; decode's, the copy rate over the active weights' bytes read once a token
(both ignore attention over the context, so they bound from above what a step can reach).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

MATMUL_N = 1024
"""The floor's matmul is N x N x N in the model's dtype."""
COPY_BYTES = 256 * 2**20
"""The floor's copy: large enough to leave every cache."""


async def run_bench(args: argparse.Namespace, engine_config: Any, dtype: torch.dtype,
                    progress: Callable[..., Any]) -> dict[str, Any]:
    """The CLI's bench: ``args`` has model, device and context; ``progress(label, engine=None, total=None)`` is an
    async context manager showing progress. Returns the figures ``bench_table`` prints."""
    from . import Engine

    tokens = [(i * 31) % 250 for i in range(args.context)]
    out: dict[str, Any] = {"context": args.context, "model": args.model, "device": args.device}
    t0 = time.perf_counter()
    async with progress(f"loading {args.model}"):
        engine = await Engine.open(model=args.model, store="memory:", device=args.device, dtype=dtype,
                                   config=engine_config)
    async with engine:
        # first calls pay one-time costs (the CPU paths derive their fused weights, oneDNN sets up, a compiled
        # decode compiles, cpu_decode_threads="auto" times its two counts): not timed but reported
        async with progress("warm-up" + (" (torch.compile)" if engine_config.cpu_compile else "")):
            warm = await engine.create_session()
            await warm.append(tokens[:64])
            await warm.generate(max_tokens=16, ignore_eos=True)
            await engine.delete_session(warm.id)
        out["warm_up_s"] = time.perf_counter() - t0
        out["compiled"] = engine_config.cpu_compile_weights if engine.core.runner.compiled else None
        s = await engine.create_session()
        async with progress("prefill", engine, total=args.context):
            t0 = time.perf_counter()
            await s.append(tokens)
            out["prefill_tokens_per_s"] = args.context / (time.perf_counter() - t0)
        async with progress("decode"):
            t0 = time.perf_counter()
            r = await s.generate(max_tokens=32, ignore_eos=True)
            out["decode_tokens_per_s"] = len(r.token_ids) / (time.perf_counter() - t0)
        await s.save()
        await engine.default.forget(s.id)
        t0 = time.perf_counter()
        s2 = await engine.resume(s.id)
        await s2.generate(max_tokens=1)
        out["ttft_resume_s"] = time.perf_counter() - t0
        fresh = await engine.create_session()
        async with progress("re-prefill", engine, total=args.context + len(r.token_ids)):
            t0 = time.perf_counter()
            await fresh.append(tokens + r.token_ids)
            await fresh.generate(max_tokens=1)
            out["ttft_reprefill_s"] = time.perf_counter() - t0
        out["resume_speedup"] = out["ttft_reprefill_s"] / out["ttft_resume_s"]
        async with progress("machine floor"):
            out["floor"] = machine_floor(engine.model)
    return out


def active_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(weights a token multiplies, their bytes): every parameter but the embedding table (one row is read), the
    routed experts scaled by the share a token picks (top_k of E)."""
    cfg = getattr(model, "config", None)
    share = cfg.num_experts_per_token / cfg.num_experts if cfg is not None and cfg.num_experts else 1.0
    n = nbytes = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        f = share if ".experts." in name else 1.0
        n += f * p.numel()
        nbytes += f * p.numel() * p.element_size()
    return int(n), int(nbytes)


def machine_floor(model: torch.nn.Module) -> dict[str, Any]:
    """A matmul's GFLOP/s and a copy's GB/s on the model's device (best of a few runs), and the floors they give."""
    p = next(model.parameters())
    dev, dt = p.device, p.dtype
    a = torch.randn(MATMUL_N, MATMUL_N, device=dev).to(dt)
    mm_s = _best(lambda: a @ a, dev, 10)
    src = torch.empty(COPY_BYTES // 4, device=dev)
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), dev, 5)
    gflops = 2 * MATMUL_N**3 / mm_s / 1e9
    gbs = 2 * COPY_BYTES / copy_s / 1e9
    n, nbytes = active_weights(model)
    return {"matmul_gflops": gflops, "matmul_dtype": str(dt).removeprefix("torch."), "copy_gbs": gbs,
            "threads": torch.get_num_threads() if dev.type == "cpu" else None, "active_weights": n,
            "active_bytes": nbytes, "prefill_tokens_per_s": gflops * 1e9 / (2 * n),
            "decode_tokens_per_s": gbs * 1e9 / nbytes}


def _best(fn: Callable[[], Any], dev: torch.device, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t)
    return best


def bench_table(out: dict[str, Any]) -> str:
    """The figures as a table: measured, the floor and the share of it reached, then the floor's own figures."""
    f = out["floor"]

    def share(x: float, floor: float) -> str:
        return f"{100 * x / floor:.0f}%"

    rows = [
        ["prefill", f"{out['prefill_tokens_per_s']:,.0f} tokens/s", f"{f['prefill_tokens_per_s']:,.0f} tokens/s",
         share(out["prefill_tokens_per_s"], f["prefill_tokens_per_s"])],
        ["decode (batch of 1)", f"{out['decode_tokens_per_s']:,.1f} tokens/s",
         f"{f['decode_tokens_per_s']:,.0f} tokens/s", share(out["decode_tokens_per_s"], f["decode_tokens_per_s"])],
        ["first token, resumed from the store", f"{out['ttft_resume_s'] * 1000:,.1f} ms", "", ""],
        ["first token, context prefilled again", f"{out['ttft_reprefill_s'] * 1000:,.1f} ms", "", ""],
        ["resume speedup", f"{out['resume_speedup']:,.1f}x", "", ""],
        [f"matmul ({f['matmul_dtype']}, {MATMUL_N} cubed)", f"{f['matmul_gflops']:,.1f} GFLOP/s", "", ""],
        [f"memory copy ({COPY_BYTES >> 20} MiB, read + write)", f"{f['copy_gbs']:,.1f} GB/s", "", ""],
    ]
    threads = f", {f['threads']} torch threads" if f["threads"] else ""
    compiled = (f", decode compiled ({out['compiled']} weights; open and warm-up {out['warm_up_s']:,.1f} s)"
                if out.get("compiled") else "")
    title = (f"kda-sessions bench: model {out['model']}, {out['context']:,} context tokens, device {out['device']}"
             f"{threads}{compiled}")
    note = (f"floor: prefill = the matmul rate over 2 FLOPs x {f['active_weights'] / 1e6:,.1f} M active weights a "
            f"token;\n       decode = the copy rate over their {f['active_bytes'] / 1e6:,.1f} MB read once a token")
    return "\n".join([title, "", _table(rows, ["", "measured", "floor", "of floor"]), "", note])


def _table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell, the first left-aligned and the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


__all__ = ["active_weights", "bench_table", "machine_floor", "run_bench"]
