"""End-to-end decode benchmark on a CUDA device: time per output token (one decode step of batch 1) at long
contexts, for the hybrid KDA + MLA model and an all-MLA model of the same size, plus correctness smokes (the
built-in ``tiny-random`` on CUDA vs CPU, and CUDA-graph replay vs eager).

Each case times up to three ways of running the same step (``--graphs``): ``eager`` (``HybridModel.step``, kernels
launched from Python), ``static`` (``DecodeGraphs`` with graphs off: the static-buffer step, run eagerly) and
``graph`` (``DecodeGraphs``: fill the static buffers, replay the captured graph), plus ``replay_only``: the GPU
time of back-to-back replays measured with CUDA events (no host work in it).

Every mode reads the same page table: the pages padded with the scratch page to the width ``DecodeGraphs`` picks
(a power of two, at least 16 pages), since the MLA decode kernel's split schedule, and so the order of its float
sums, follows the table width (``eager_bare_table_vs_eager_first_step_rel``: the eager step over the bare table).

The context is not prefilled: the latent KV pages are filled with random bf16 values and the KDA states with
small random fp32 values (content does not change the cost), then each step feeds one token at position L.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/train/*.whl
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/e2e_gpu.py --out $OUT/e2e.json    # on the device
    python bench/e2e_gpu.py --device cpu --quick                           # tiny sizes, to check the script

Imports the package through a shim (``/tmp/kda_e2e_shim/kda_sessions`` with links to the model, config and the
kernels/ and storage/ folders and an empty ``__init__``), so that neither an install nor the server's
dependencies are needed; pydantic is taken from ``.whl/train`` when the interpreter lacks it.
Results are written to ``--out`` after every case; a time guard stops starting new cases after ``--budget`` s.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    for whl in sorted((REPO / ".whl" / "train").glob("*.whl")):
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
from kda_sessions.model.graphs import DecodeGraphs  # noqa: E402

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
    if device == "cuda":
        model.stack_experts()  # every mode (eager, static, graph) then runs the same batched MoE decode
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


def timed(fn, steps: int, device: str) -> list[float]:
    """Wall-clock ms of each call, synchronized around it."""
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def stats(times: list[float]) -> dict:
    return {"ms_median": round(statistics.median(times), 4), "ms_min": round(min(times), 4),
            "ms_max": round(max(times), 4), "steps": len(times)}


def decode_case(
    model: HybridModel, L: int, batch: int, P: int, warmup: int, steps: int, device: str, modes: list[str]
) -> dict:
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
    # eager runs over the table the static and graph modes build: the pages padded with the scratch page to the
    # bucketed width. The MLA decode kernel takes its split schedule from the width, so over the bare table it
    # sums in another order, and this bf16 random MoE model turns those last bits into ~0.2 relative logits
    width = DecodeGraphs(model, pools, enabled=False).width(pages_per_seq)
    padded = torch.full((batch, width), pools.scratch_page or 0, dtype=torch.int32, device=device)
    padded[:, :pages_per_seq] = table
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=gen)
    fb = ForwardBatch(
        input_ids=ids, num_new=[1] * batch, start=[L] * batch,
        slots=torch.arange(batch, device=device), page_table=padded,
    )
    assert fb.is_decode
    pool_bytes = sum(t.numel() * t.element_size() for t in pools.kv + pools.kda + pools.conv)
    kv_bytes = sum(t.numel() * t.element_size() for t in pools.kv)
    out: dict = {
        "L": L, "batch": batch, "page_size": P, "pages_per_seq": pages_per_seq, "table_width": width, "kda_layers": n_kda,
        "mla_layers": n_mla, "pool_bytes": pool_bytes, "kv_pool_bytes": kv_bytes,
    }
    host = {"ids": ids.tolist(), "slots": list(range(batch)), "lens": [L + 1] * batch, "pages": table.tolist()}
    # every mode starts from the same states, so the first step's logits of the modes can be compared
    saved = [t.clone() for t in pools.kda + pools.conv]
    first: dict[str, torch.Tensor] = {}
    for mode in modes:
        for t, v in zip(pools.kda + pools.conv, saved):
            t.copy_(v)
        capture_s = 0.0
        if mode == "eager":
            def step() -> torch.Tensor:
                return model.step(fb, pools)[0]
        else:
            graphs = DecodeGraphs(model, pools, enabled=mode == "graph")
            if mode == "graph" and not graphs.use_graphs:
                out["graph"] = "not on this device"
                continue

            def step(graphs: DecodeGraphs = graphs) -> torch.Tensor:
                return graphs.run(host["ids"], host["slots"], host["lens"], host["pages"])
        t0 = time.perf_counter()
        first[mode] = step().float().clone()  # a graph is captured here (warm-up on scratch rows only)
        sync(device)
        capture_s = time.perf_counter() - t0
        for _ in range(warmup):
            last = step()
        sync(device)
        r = stats(timed(step, steps, device))
        r["logits_finite"] = bool(torch.isfinite(last).all())
        r["first_call_s"] = round(capture_s, 2)
        if mode == "graph":
            r["replays"], r["captures"] = graphs.replays, graphs.captures
            r["capture_error"] = graphs.capture_error
            g = graphs.graph_for(batch, pages_per_seq)
            if g is not None:  # the GPU time of the step alone: back-to-back replays between two events
                n_rep = max(steps, 20)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(n_rep):
                    g.replay()
                e1.record()
                e1.synchronize()
                r["replay_only_ms"] = round(e0.elapsed_time(e1) / n_rep, 4)
        out[mode] = r
    if "eager" in first:
        for mode in first:
            if mode != "eager":
                out[f"{mode}_vs_eager_first_step_rel"] = rel(first[mode], first["eager"])
                out[f"{mode}_vs_eager_argmax_agree"] = bool(torch.equal(first[mode].argmax(-1), first["eager"].argmax(-1)))
        if width != pages_per_seq:  # the same first step over the bare table: only the kernel's split schedule differs
            for t, v in zip(pools.kda + pools.conv, saved):
                t.copy_(v)
            bare = ForwardBatch(input_ids=ids, num_new=[1] * batch, start=[L] * batch,
                                slots=torch.arange(batch, device=device), page_table=table)
            lg = model.step(bare, pools)[0].float()
            out["eager_bare_table_vs_eager_first_step_rel"] = rel(lg, first["eager"])
            out["eager_bare_table_vs_eager_argmax_agree"] = bool(torch.equal(lg.argmax(-1), first["eager"].argmax(-1)))
    if device == "cuda":
        out["mem_allocated_bytes"] = torch.cuda.memory_allocated()
        out["mem_peak_bytes"] = torch.cuda.max_memory_allocated()
    # one MLA layer's paged-decode kernel alone at this context (the part of the step that grows with L)
    if n_mla:
        H, r_, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        q_lat = torch.randn(batch, H, r_, device=device, generator=gen).to(model.dtype)
        q_pe = torch.randn(batch, H, dr, device=device, generator=gen).to(model.dtype)
        lens = torch.full((batch,), L + 1, dtype=torch.int32, device=device)
        scale = (cfg.qk_nope_head_dim + dr) ** -0.5
        for _ in range(3):
            mla_decode_paged(q_lat, q_pe, pools.kv[0], table, lens, scale)
        kt = timed(lambda: mla_decode_paged(q_lat, q_pe, pools.kv[0], table, lens, scale), steps, device)
        out["mla_kernel_one_layer_ms_median"] = statistics.median(kt)
        out["mla_kernel_one_layer_GBps"] = batch * (L + 1) * cfg.latent_dim * 2 / (statistics.median(kt) * 1e-3) / 1e9
    return out  # the pools and graphs go with this frame; the next case empties the cache first


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


def smoke_graphs(device: str, steps: int = 6) -> dict:
    """``tiny-random`` (float32) on this device: 5 sequences prefilled to mixed lengths, then decode steps of 3
    and 5 sequences (padded to buckets 4 and 8) through the graph runner, the eager static path and
    ``HybridModel.step``, each on its own copy of the pools."""
    model = load_model("tiny-random", device=device, dtype=torch.float32)
    P, contexts = 16, [3, 14, 15, 45, 70]
    per_seq = 8
    pools = model.allocate_pools(len(contexts), len(contexts) * per_seq, P)
    pages = [list(range(n * per_seq, (n + 1) * per_seq)) for n in range(len(contexts))]
    g = torch.Generator().manual_seed(5)
    for n, L in enumerate(contexts):
        fb = ForwardBatch(
            input_ids=torch.randint(0, 272, (L,), generator=g).to(device), num_new=[L], start=[0],
            slots=torch.tensor([n], device=device), page_table=torch.tensor([pages[n]], dtype=torch.int32, device=device),
        )
        model.step(fb, pools)
    copies = {m: StatePools([t.clone() for t in pools.kda], [t.clone() for t in pools.conv],
                            [t.clone() for t in pools.kv], P, pools.scratch_slot, pools.scratch_page)
              for m in ("graph", "static", "eager")}
    runners = {"graph": DecodeGraphs(model, copies["graph"]), "static": DecodeGraphs(model, copies["static"], enabled=False)}
    lengths = list(contexts)
    res: dict = {"graph_vs_static_rel": [], "graph_vs_eager_rel": [], "argmax_agree": []}
    for step in range(steps):
        seqs = [0, 1, 2, 3, 4] if step % 2 else [4, 1, 0]
        ids = torch.randint(0, 272, (len(seqs),), generator=g).tolist()
        lens = [lengths[s] + 1 for s in seqs]
        out = {m: r.run(ids, seqs, lens, [pages[s] for s in seqs]).float().clone() for m, r in runners.items()}
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, device=device), num_new=[1] * len(seqs), start=[lengths[s] for s in seqs],
            slots=torch.tensor(seqs, device=device),
            page_table=torch.tensor([pages[s] for s in seqs], dtype=torch.int32, device=device),
        )
        out["eager"] = model.step(fb, copies["eager"])[0]
        for s in seqs:
            lengths[s] += 1
        res["graph_vs_static_rel"].append(rel(out["graph"], out["static"]))
        res["graph_vs_eager_rel"].append(rel(out["graph"], out["eager"]))
        res["argmax_agree"].append(bool(torch.equal(out["graph"].argmax(-1), out["eager"].argmax(-1))))
    n = pools.kda[0].shape[0] - 1 if pools.kda else 0  # the scratch slot is excluded: padded rows race there
    res["kda_pool_graph_vs_static_rel"] = max(rel(a[:n], b[:n]) for a, b in zip(copies["graph"].kda, copies["static"].kda))
    res["replays"], res["captures"], res["eager_runs"] = (runners["graph"].replays, runners["graph"].captures,
                                                          runners["graph"].eager_runs)
    res["graphs_used"] = runners["graph"].use_graphs
    res["capture_error"] = runners["graph"].capture_error
    return res


# ---------------------------------------------------------------- main


def main() -> None:
    global OUT_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny config and short contexts (a CPU check)")
    ap.add_argument("--dense", action="store_true", help="dense FFN everywhere instead of MoE")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget", type=float, default=150.0, help="start no new case after this many seconds")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--graphs", choices=["both", "off", "on"], default="both",
                    help="both: eager, static and graph replay in each case; off: eager only; on: graph only")
    ap.add_argument("--batch8", action="store_true", help="also batch 8 at 128K (after the batch-1 cases)")
    args = ap.parse_args()
    OUT_PATH = args.out
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    modes = {"both": ["eager", "static", "graph"], "off": ["eager"], "on": ["graph"]}[args.graphs]
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
        "modes": modes,
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

    if args.graphs != "off":
        case("smoke_graphs_tiny_random", lambda: smoke_graphs(dev))
    for kind in ("hybrid", "all_mla"):
        for L in Ls:
            case(f"{kind}_L{L}_b1",
                 lambda kind=kind, L=L: decode_case(get_model(kind), L, 1, 64, args.warmup, steps, dev, modes))
    case("smoke_tiny_random_cuda_vs_cpu", lambda: smoke(dev))
    if args.batch8:
        for kind in ("hybrid", "all_mla"):
            case(f"{kind}_L{L_b8}_b8",
                 lambda kind=kind: decode_case(get_model(kind), L_b8, 8, 64, args.warmup, steps, dev, modes))

    # summary table: median ms per output token by mode, and the replay-only GPU time
    rows = []
    for L in Ls:
        row: dict = {"L": L}
        for kind in ("hybrid", "all_mla"):
            c = RESULTS["cases"].get(f"{kind}_L{L}_b1", {})
            for mode in modes:
                if isinstance(c.get(mode), dict):
                    row[f"{kind}_{mode}_ms"] = c[mode]["ms_median"]
            if isinstance(c.get("graph"), dict) and "replay_only_ms" in c["graph"]:
                row[f"{kind}_replay_only_ms"] = c["graph"]["replay_only_ms"]
        for mode in [*modes, "replay_only"]:
            h, m = row.get(f"hybrid_{mode}_ms"), row.get(f"all_mla_{mode}_ms")
            if h and m:
                row[f"all_mla_over_hybrid_{mode}"] = round(m / h, 3)
        rows.append(row)
    RESULTS["summary"] = rows
    dump()
    for r in rows:
        log(json.dumps(r))
    log(f"errors: {list(RESULTS['errors'])}")

if __name__ == "__main__":
    main()
