"""End-to-end decode benchmark on a CUDA device: time per output token (one ``HybridModel.step`` of batch 1) at
long contexts, for the hybrid KDA + MLA model and an all-MLA model of the same size, plus one correctness smoke
(the built-in ``tiny-random`` on CUDA vs CPU).

The context is not prefilled: the latent KV pages are filled with random bf16 values and the KDA states with
small random fp32 values (content does not change the cost), then each step feeds one token at position L.

    PYTHONUNBUFFERED=1 python3 bench/e2e_gpu.py --out $OUT/e2e.json        # on the device
    python bench/e2e_gpu.py --device cpu --quick                           # tiny sizes, to check the script

Imports the package through a shim (``/tmp/kda_e2e_shim/kda_sessions`` with links to the model, config and the
kernels/ and storage/ folders and an empty ``__init__``), so that neither an install nor the server's
dependencies are needed; pydantic is taken from ``.whl/e2e`` when the interpreter lacks it.
Results are written to ``--out`` after every case; a time guard stops starting new cases after ``--budget`` s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
T0 = time.time()


def _import_pydantic() -> str:
    try:
        import pydantic

        return "installed"
    except ImportError:
        pass
    site = Path("/tmp/kda_e2e_site")
    site.mkdir(parents=True, exist_ok=True)
    for whl in sorted((REPO / ".whl" / "e2e").glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    sys.path.append(str(site))  # after site-packages: only what is missing comes from here
    try:
        import pydantic

        return "carried (appended)"
    except ImportError:
        for m in [m for m in sys.modules if m.startswith(("pydantic", "typing_extensions", "annotated_types"))]:
            del sys.modules[m]
        sys.path.insert(0, str(site))
        import pydantic  # noqa: F401

        return "carried (first)"


def _shim() -> None:
    """kda_sessions/{config,errors,model,builtin} + kernels/ + storage/, with an empty __init__."""
    root = Path("/tmp/kda_e2e_shim")
    pkg = root / "kda_sessions"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""shim for bench/e2e_gpu.py"""\n')
    links = {name: REPO / "kda_sessions" / name for name in ("config.py", "errors.py", "model", "builtin")}
    links["kernels"] = REPO / "kernels"
    links["storage"] = REPO / "storage"
    for name, target in links.items():
        p = pkg / name
        if p.is_symlink() or p.exists():
            if p.is_symlink() and Path(os.readlink(p)) == target:
                continue
            p.unlink()
        p.symlink_to(target)
    sys.path.insert(0, str(root))


PYDANTIC = _import_pydantic()
_shim()

import torch  # noqa: E402

from kda_sessions.config import ModelConfig  # noqa: E402
from kda_sessions.kernels import mla_decode_paged  # noqa: E402
from kda_sessions.model import ForwardBatch, HybridModel, StatePools, load_model  # noqa: E402

RESULTS: dict = {}
OUT_PATH: Path | None = None


def dump() -> None:
    RESULTS["elapsed_s"] = round(time.time() - T0, 1)
    if OUT_PATH is not None:
        tmp = OUT_PATH.with_suffix(".tmp")
        tmp.write_text(json.dumps(RESULTS, indent=1))
        tmp.replace(OUT_PATH)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- configs


def config_dict(kind: str, quick: bool, dense: bool) -> dict:
    if quick:
        D, n_layers, Hk, Kk, Hm, r, dn, dr, dv, ffn, moe_w, E, vocab = 64, 4, 2, 16, 2, 32, 16, 8, 16, 128, 32, 4, 256
        mla_layers = [2, 4]
    else:
        D, n_layers, Hk, Kk, Hm, r, dn, dr, dv, ffn, moe_w, E, vocab = 2048, 16, 16, 128, 16, 512, 128, 64, 128, 4096, 1024, 16, 32768
        mla_layers = [4, 8, 12, 16]
    layers = list(range(1, n_layers + 1))
    full = layers if kind == "all_mla" else mla_layers
    kda = [i for i in layers if i not in full]
    return {
        "model_type": "kimi_linear",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": ffn,
        "moe_intermediate_size": moe_w,
        "num_hidden_layers": n_layers,
        "num_attention_heads": Hm,
        "kv_lora_rank": r,
        "q_lora_rank": None,
        "qk_nope_head_dim": dn,
        "qk_rope_head_dim": dr,
        "v_head_dim": dv,
        "mla_use_nope": True,
        "num_experts": 0 if dense else E,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": Hk,
            "head_dim": Kk,
            "short_conv_kernel_size": 4,
        },
    }


def build_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> HybridModel:
    with torch.device(device):
        model = HybridModel(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(0.0, math.log(16.0), generator=gen)
            elif name.endswith(("dt_bias", "e_score_correction_bias")):
                p.zero_()
            elif name.endswith("gate.weight"):  # MoE router (allocated with torch.empty)
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    model = model.to(dtype).eval()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"non-finite parameters: {bad[:5]}")
    return model


# ---------------------------------------------------------------- decode timing


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fill_pools(pools: StatePools, gen: torch.Generator) -> None:
    with torch.no_grad():
        for t in pools.kv:
            t.normal_(0.0, 1.0, generator=gen)
        for t in pools.kda:
            t.normal_(0.0, 0.01, generator=gen)
        for t in pools.conv:
            t.normal_(0.0, 0.1, generator=gen)


def decode_case(model: HybridModel, L: int, batch: int, P: int, warmup: int, steps: int, device: str) -> dict:
    cfg = model.config
    pages_per_seq = -(-(L + 1) // P)
    n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pools = model.allocate_pools(batch, batch * pages_per_seq, P)
    gen = torch.Generator(device=device).manual_seed(1)
    fill_pools(pools, gen)
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, pages_per_seq)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=gen)
    fb = ForwardBatch(
        input_ids=ids, num_new=[1] * batch, start=[L] * batch,
        slots=torch.arange(batch, device=device), page_table=table,
    )
    assert fb.is_decode
    pool_bytes = sum(t.numel() * t.element_size() for t in pools.kv + pools.kda + pools.conv)
    kv_bytes = sum(t.numel() * t.element_size() for t in pools.kv)
    sync(device)
    for _ in range(warmup):
        logits, _ = model.step(fb, pools)
    sync(device)
    finite = bool(torch.isfinite(logits).all())
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        model.step(fb, pools)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    out = {
        "L": L, "batch": batch, "page_size": P, "pages_per_seq": pages_per_seq,
        "tpot_ms_median": statistics.median(times), "tpot_ms_min": min(times), "tpot_ms_max": max(times),
        "steps": steps, "logits_finite": finite, "kda_layers": n_kda, "mla_layers": n_mla,
        "pool_bytes": pool_bytes, "kv_pool_bytes": kv_bytes,
    }
    if device == "cuda":
        out["mem_allocated_bytes"] = torch.cuda.memory_allocated()
        out["mem_peak_bytes"] = torch.cuda.max_memory_allocated()
    # one MLA layer's paged-decode kernel alone at this context (the part of the step that grows with L)
    if n_mla:
        H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q_lat = torch.randn(batch, H, r, device=device, generator=gen).to(model.dtype)
        q_pe = torch.randn(batch, H, dr, device=device, generator=gen).to(model.dtype)
        lens = torch.full((batch,), L + 1, dtype=torch.int32, device=device)
        scale = (cfg.qk_nope_head_dim + dr) ** -0.5
        for _ in range(3):
            mla_decode_paged(q_lat, q_pe, pools.kv[0], table, lens, scale)
        sync(device)
        kt = []
        for _ in range(steps):
            t0 = time.perf_counter()
            mla_decode_paged(q_lat, q_pe, pools.kv[0], table, lens, scale)
            sync(device)
            kt.append((time.perf_counter() - t0) * 1e3)
        out["mla_kernel_one_layer_ms_median"] = statistics.median(kt)
        out["mla_kernel_one_layer_GBps"] = batch * (L + 1) * cfg.latent_dim * 2 / (statistics.median(kt) * 1e-3) / 1e9
    del pools
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- correctness smoke


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_steps(model: HybridModel, prompt: torch.Tensor, decode_ids: list[int], device: str) -> list[torch.Tensor]:
    P, T = 16, prompt.numel()
    pages = -(-(T + len(decode_ids)) // P)
    pools = model.allocate_pools(1, pages, P)
    table = torch.arange(pages, dtype=torch.int32, device=device).view(1, pages)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    outs = []
    fb = ForwardBatch(input_ids=prompt.to(device), num_new=[T], start=[0], slots=slots, page_table=table)
    logits, _ = model.step(fb, pools)
    outs.append(logits.cpu())
    for i, tok in enumerate(decode_ids):
        fb = ForwardBatch(
            input_ids=torch.tensor([tok], device=device), num_new=[1], start=[T + i], slots=slots, page_table=table
        )
        logits, _ = model.step(fb, pools)
        outs.append(logits.cpu())
    return outs


def smoke(device: str) -> dict:
    ref = load_model("tiny-random", device="cpu", dtype=torch.float32)
    dut = load_model("tiny-random", device=device, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    V = ref.config.vocab_size
    ids = torch.randint(0, V, (1, 200), generator=g)
    f_ref = ref.forward(ids)
    f_dut = dut.forward(ids.to(device)).cpu()
    decode_ids = torch.randint(0, V, (4,), generator=g).tolist()
    s_ref = run_steps(ref, ids[0], decode_ids, "cpu")
    s_dut = run_steps(dut, ids[0], decode_ids, device)
    return {
        "forward_T200_rel_rms": rel(f_dut, f_ref),
        "step_prefill_then_decode_rel_rms": [rel(a, b) for a, b in zip(s_dut, s_ref)],
        "step_prefill_vs_forward_last_rel_rms_dut": rel(s_dut[0], f_dut[0, -1:]),
        "finite": bool(torch.isfinite(f_dut).all()),
        "argmax_agree_forward": float((f_dut.argmax(-1) == f_ref.argmax(-1)).float().mean()),
    }


# ---------------------------------------------------------------- main


def main() -> None:
    global OUT_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny config and short contexts (a CPU check)")
    ap.add_argument("--dense", action="store_true", help="dense FFN everywhere instead of MoE")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget", type=float, default=240.0, help="start no new case after this many seconds")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    OUT_PATH = args.out
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    Ls = [64, 1024, 4096] if args.quick else [8192, 131072, 524288]
    L_b8 = 1024 if args.quick else 131072
    steps = 3 if args.quick else args.steps
    RESULTS.update({
        "command": " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host": platform.node(),
        "torch": torch.__version__,
        "pydantic": PYDANTIC,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "dtype": str(dtype),
        "ffn": "dense" if args.dense else "moe",
        "cases": {},
        "errors": {},
    })
    try:
        import triton

        RESULTS["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"device {RESULTS['device']} torch {torch.__version__} pydantic {PYDANTIC}")
    dump()

    models: dict[str, HybridModel] = {}

    def get_model(kind: str) -> HybridModel:
        if kind not in models:
            t0 = time.time()
            cfg = ModelConfig.from_dict(config_dict(kind, args.quick, args.dense))
            m = build_model(cfg, dev, dtype)
            n = sum(p.numel() for p in m.parameters())
            RESULTS.setdefault("models", {})[kind] = {
                "params": n,
                "kda_layers": [i + 1 for i in cfg.kda_layer_ids],
                "mla_layers": [i + 1 for i in cfg.mla_layer_ids],
                "kv_bytes_per_token": len(cfg.mla_layer_ids) * cfg.latent_dim * (2 if dtype == torch.bfloat16 else 4),
                "kda_state_bytes_per_seq": len(cfg.kda_layer_ids)
                * (cfg.kda_heads * cfg.kda_head_dim**2 * 4 + (cfg.conv_size - 1) * 3 * cfg.kda_heads * cfg.kda_head_dim
                   * (2 if dtype == torch.bfloat16 else 4)),
                "build_s": round(time.time() - t0, 1),
            }
            log(f"built {kind}: {n / 1e9:.2f} B params in {time.time() - t0:.1f}s")
            models[kind] = m
        return models[kind]

    def case(name: str, fn) -> None:
        if time.time() - T0 > args.budget:
            log(f"skip {name}: time guard ({args.budget:.0f}s)")
            RESULTS["errors"][name] = "skipped: time guard"
            dump()
            return
        log(f"start {name}")
        try:
            r = fn()
            RESULTS["cases"][name] = r
            log(f"done {name}: {json.dumps(r)}")
        except Exception as e:
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            log(f"FAILED {name}: {type(e).__name__}: {e}")
            traceback.print_exc()
            if dev == "cuda":
                torch.cuda.empty_cache()
        dump()

    for kind in ("hybrid", "all_mla"):
        for L in Ls:
            case(f"{kind}_L{L}_b1", lambda kind=kind, L=L: decode_case(get_model(kind), L, 1, 64, args.warmup, steps, dev))
    case("smoke_tiny_random_cuda_vs_cpu", lambda: smoke(dev))
    for kind in ("hybrid", "all_mla"):
        case(f"{kind}_L{L_b8}_b8", lambda kind=kind: decode_case(get_model(kind), L_b8, 8, 64, args.warmup, steps, dev))

    # summary table
    rows = []
    for L in Ls:
        h = RESULTS["cases"].get(f"hybrid_L{L}_b1", {}).get("tpot_ms_median")
        m = RESULTS["cases"].get(f"all_mla_L{L}_b1", {}).get("tpot_ms_median")
        rows.append({"L": L, "hybrid_ms": h, "all_mla_ms": m, "all_mla_over_hybrid": (m / h) if h and m else None})
    RESULTS["summary"] = rows
    dump()
    for r in rows:
        log(f"L {r['L']:>7}: hybrid {r['hybrid_ms']} ms, all-MLA {r['all_mla_ms']} ms, ratio {r['all_mla_over_hybrid']}")
    log(f"errors: {list(RESULTS['errors'])}")


if __name__ == "__main__":
    main()
