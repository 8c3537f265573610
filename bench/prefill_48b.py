"""Long prefill through the Engine at the Kimi-Linear-48B-A3B shape (random bf16 weights built on the GPU).

For each context N: a fresh session, ``append`` of N random token ids, then ``generate(max_tokens=1)`` (greedy);
the wall time of the two together is the prefill time. Reported per N: tokens/s, achieved TFLOP/s (matmul flops
of the active parameters plus MLA attention's, KDA's recurrence left out: a lower bound) against the H200's dense
bf16 peak, and peak GPU memory above what the weights and pools hold.

``--cpu-rss N`` instead prefills N tokens of ``tiny-random`` on the CPU through the Engine (in
``--chunk``-token chunks) and reports how much the peak RSS grew during the prefill.

``--profile N`` also runs one prefill of N tokens with CUDA events around every layer's attention and FFN and
reports where the time goes (KDA attention, MLA attention, MoE, dense FFN, the rest).

    PYTHONUNBUFFERED=1 python bench/prefill_48b.py --contexts 8192,32768,131072 --profile 32768 --out $OUT/p.json
    python bench/prefill_48b.py --layers 16 --contexts 32768 --moe-ab   # an H100: MoE kernels A/B
    python bench/prefill_48b.py --cpu-rss 32768 --chunk 8192
    python bench/prefill_48b.py --quick      # a small shape on any device, to check the script

Random weights: every matrix N(0, 1/fan_in), norms 1, A_log uniform in [0, ln 16], biases 0. The lm_head rows past
the byte tokenizer's 272 ids are zero, so the greedy token is one the tokenizer can decode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
from decode_48b import config as decode_48b_config  # bench/ is on the path: this script's folder
from decode_48b import device_kernels

from kda_sessions.api import Engine, open_snapshots
from kda_sessions.config import ModelConfig
from kda_sessions.engine.config import EngineConfig
from kda_sessions.model import HybridModel
from kda_sessions.model.ffn import MoE
from kda_sessions.model.kda import KDAAttention
from kda_sessions.model.mla import MLAttention
from kda_sessions.tokenizer import ByteTokenizer, builtin_template

H200_BF16_DENSE_TFLOPS = 989.0


def config_48b(quick: bool, layers: int | None = None) -> ModelConfig:
    """KDA.md's Kimi-Linear-48B-A3B shape (``decode_48b.config``; ``layers`` keeps only the first that many layers at
    the real width: 16 fit an 80 GB card); ``--quick``: 4 layers, narrow, 16 experts."""
    if not quick:
        return decode_48b_config(False, layers)
    return ModelConfig.from_dict(dict(
        model_type="kimi_linear", vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, num_experts=16, num_experts_per_token=4, num_shared_experts=1, routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4, head_dim=32,
                                short_conv_kernel_size=4),
    ))


@torch.no_grad()
def build_model(cfg: ModelConfig, device: str) -> HybridModel:
    """Allocated on ``meta`` then materialised on ``device`` in bf16 (no float32 copy: 48B parameters are 96 GB)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = HybridModel(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            p.data = p.data.float()  # the loader keeps these in float32
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.uniform_(0.0, math.log(16.0), generator=gen)
        elif name.endswith(("dt_bias", "e_score_correction_bias")):
            p.zero_()
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    model.lm_head.weight[ByteTokenizer().vocab_size :].zero_()
    model.eval()
    if device == "cuda":
        model.stack_experts()
    return model


def active_params(model: HybridModel) -> int:
    """Parameters one token multiplies by in prefill, embedding and lm_head excluded (logits of the last token
    only): routed experts count top_k / num_experts of theirs."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if name.startswith(("model.embed_tokens", "lm_head")) or p.dim() < 2:
            continue
        if ".experts." in name:
            total += p.numel() * cfg.num_experts_per_token // cfg.num_experts
        else:
            total += p.numel()
    return total


def flops(model: HybridModel, N: int, chunk: int) -> float:
    """Matmul flops of an N-token prefill in chunks: 2 x active params per token, MLA attention (causal,
    2 (dn + dr + dv) H per visible pair) and its per-chunk decompression of the prefix."""
    cfg = model.config
    H, r, dn, dr, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
        cfg.v_head_dim
    nm = len(cfg.mla_layer_ids)
    attn = N * (N + 1) / 2 * 2 * H * (dn + dr + dv)
    decompress = sum(min(N, s + chunk) for s in range(0, N, chunk)) * 2 * r * H * (dn + dv)
    return 2.0 * active_params(model) * N + nm * (attn + decompress)


class LayerTimer:
    """CUDA events around every layer's attention and FFN, summed by kind after a sync."""

    def __init__(self, model: HybridModel) -> None:
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self.handles = []
        for layer in model.model.layers:
            attn = layer.self_attn
            kind = "kda_attention" if isinstance(attn, KDAAttention) else "mla_attention"
            assert isinstance(attn, KDAAttention | MLAttention)
            ffn = getattr(layer, "block_sparse_moe", None) or layer.mlp
            self._wrap(attn, kind)
            self._wrap(ffn, "moe" if isinstance(ffn, MoE) else "dense_ffn")

    def _wrap(self, module: torch.nn.Module, kind: str) -> None:
        def pre(_m: Any, _a: Any) -> None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.setdefault(kind, []).append((e, e))

        def post(_m: Any, _a: Any, _o: Any) -> None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            start, _ = self.events[kind][-1]
            self.events[kind][-1] = (start, e)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def totals_s(self) -> dict[str, float]:
        torch.cuda.synchronize()
        out = {k: sum(a.elapsed_time(b) for a, b in v) / 1000 for k, v in self.events.items()}
        for h in self.handles:
            h.remove()
        return out


MOE_VARIANTS = ["library", "pointers", "one-tile", "library", "pointers", "one-tile"]
"""``--moe-ab``'s prefills of each context, alternated: the library; the grouped MoE kernels with pointer loads
(``triton_moe.GROUPED_TMA`` off); pointer loads and the up kernel's tile for the down kernel too. ``--kda-ab``:
the library against "kda-unfused" (``kda.PREFILL_FUSED`` off)."""


@contextlib.contextmanager
def moe_variant(name: str):
    from kda_sessions.kernels.moe import triton_moe
    from kda_sessions.model import kda

    tma, launch, kda_fused = triton_moe.GROUPED_TMA, triton_moe.launch_config, kda.PREFILL_FUSED
    kda.PREFILL_FUSED = name != "kda-unfused"
    if name in ("pointers", "one-tile"):
        triton_moe.GROUPED_TMA = False
    if name == "one-tile":
        triton_moe.launch_config = lambda *a, **k: dataclasses.replace(launch(*a, **k), down=None)
    try:
        yield
    finally:
        triton_moe.GROUPED_TMA, triton_moe.launch_config, kda.PREFILL_FUSED = tma, launch, kda_fused


async def prefill_once(engine: Engine, N: int, seed: int) -> tuple[float, int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (N,), generator=gen).tolist()
    s = await engine.create_session()
    t = time.perf_counter()
    u = await s.append(ids)
    r = await s.generate(max_tokens=1, temperature=0.0)
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    await engine.delete_session(s.id)
    return dt, u.prefill_tokens + r.usage.prefill_tokens


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = config_48b(args.quick, args.layers)
    t = time.perf_counter()
    model = build_model(cfg, device)
    res: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "build_s": round(time.perf_counter() - t, 1), "chunk": args.chunk,
        "active_params_b": round(active_params(model) / 1e9, 2),
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2), "runs": [],
    }
    P = 64
    num_pages = -(-max([*args.contexts, args.profile, args.kernels, 512 if args.quick else 40960]) // P) + 64
    config = EngineConfig(max_active_sessions=2, num_pages=num_pages, page_size=P, prefill_chunk_tokens=args.chunk,
                          prefill_chunk_tokens_idle=args.chunk,
                          max_checkpoints_in_memory=1)
    snapshots = await open_snapshots("memory:", config)
    engine = Engine(model, "kimi-linear-48b-shape-random", ByteTokenizer(), builtin_template(), snapshots, config)
    try:
        cuda = device == "cuda"
        base = torch.cuda.memory_allocated() if cuda else 0
        res["weights_and_pools_gib"] = round(base / 2**30, 2)
        # warm-up: compiles every kernel variant (MLA prefill's first, middle and last blocks of 16,384 tokens)
        await prefill_once(engine, 512 if args.quick else 40960, seed=0)
        if args.profile and cuda:  # before the long contexts, so a run cut short by a time limit still has it
            timer = LayerTimer(model)
            dt, _ = await prefill_once(engine, args.profile, seed=1)
            parts = timer.totals_s()
            parts["rest"] = dt - sum(parts.values())
            res["profile"] = {"N": args.profile, "s": round(dt, 2),
                              **{k: round(v, 3) for k, v in sorted(parts.items())}}
            print(json.dumps(res["profile"]), flush=True)
        if args.kernels and cuda:  # one prefill under the profiler: the top kernels by device time
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dt, _ = await prefill_once(engine, args.kernels, seed=2)
            rows = [(round(t / 1e3, 2), n, name[:90]) for name, n, t in device_kernels(prof)]
            res["kernels"] = {"N": args.kernels, "s": round(dt, 2), "ms_calls_name": rows[:40]}
            for r in rows[:40]:
                print(r, flush=True)
        variants = MOE_VARIANTS if args.moe_ab else ["library", "kda-unfused"] * 2 if args.kda_ab else ["library"]
        for N, moe in [(N, m) for N in args.contexts for m in variants]:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            with moe_variant(moe):
                dt, pre = await prefill_once(engine, N, seed=N)
            run = {"N": N, "prefill_tokens": pre, "s": round(dt, 2), "tok_per_s": round(N / dt),
                   "tflops": round(flops(model, N, args.chunk) / dt / 1e12, 1)}
            if args.moe_ab or args.kda_ab:
                run["variant"] = moe
            run["pct_of_peak"] = round(100 * run["tflops"] / H200_BF16_DENSE_TFLOPS, 1)
            if cuda:
                run["peak_above_weights_pools_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
            res["runs"].append(run)
            print(json.dumps(run), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        await engine.close()
    return res


async def cpu_rss(N: int, chunk: int) -> dict[str, Any]:
    import resource

    import kda_sessions as ks

    async with await ks.Engine.open(model="tiny-random", store="memory:", prefill_chunk_tokens=chunk,
                                    prefill_chunk_tokens_idle=chunk,
                                    num_pages=-(-N // 64) + 8) as engine:
        await prefill_once(engine, 256, seed=0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        dt, pre = await prefill_once(engine, N, seed=N)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": "tiny-random", "N": N, "chunk": chunk, "prefill_tokens": pre, "s": round(dt, 2),
            "tok_per_s": round(N / dt), "peak_rss_growth_mib": round((after - before) / 1024, 1),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    p.add_argument("--chunk", type=int, default=8192, help="EngineConfig.prefill_chunk_tokens")
    p.add_argument("--profile", type=int, default=0, help="context of the per-layer-kind profile (0: none)")
    p.add_argument("--cpu-rss", type=int, default=0, help="tiny-random on the CPU instead: peak RSS growth")
    p.add_argument("--quick", action="store_true", help="a small shape and small contexts, to check the script")
    p.add_argument("--layers", type=int, default=None, help="the first that many layers of the 48B shape (16 fit an "
                   "80 GB card)")
    p.add_argument("--kernels", type=int, default=0, help="context of one prefill under the torch profiler: the "
                   "top 40 kernels by device time (0: none)")
    p.add_argument("--kda-ab", action="store_true", help="each context also with KDA's prefill unfused "
                   "(kda.PREFILL_FUSED off), alternated")
    p.add_argument("--moe-ab", action="store_true", help="each context also with the MoE's other kernels "
                   "(MOE_VARIANTS), alternated")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.cpu_rss:
        print(json.dumps(asyncio.run(cpu_rss(args.cpu_rss, args.chunk))))
        return
    if args.quick:
        args.contexts, args.chunk = [200, 700], 256
    res = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
