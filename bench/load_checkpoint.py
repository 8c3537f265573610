"""Load a sharded Kimi-Linear checkpoint of the real width (D 2304, 256 experts of width 1024, vocabulary
163,840) at reduced depth onto the GPU, and report the load rate and the loader's peak host memory.

``--write DIR`` writes the checkpoint with plain ``safetensors`` (not ``save_model``): random bf16 tensors under
the HF names, in shards of ``--shard-gb`` with ``model.safetensors.index.json``. ``--load DIR`` (run in a fresh
process, so that its peak RSS is the loader's) streams it to ``--device`` through ``load_model`` and prints
bytes, seconds, GB/s, the largest shard and the peak RSS above the RSS before the load.

    python bench/load_checkpoint.py --write /tmp/ck --layers 2 && python bench/load_checkpoint.py --load /tmp/ck
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel, load_model


def config(layers: int) -> dict:
    mla = [i for i in range(1, layers + 1) if i % 4 == 0] or [layers]
    kda = [i for i in range(1, layers + 1) if i not in mla]
    return {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 32, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 256,
        "num_experts_per_token": 8, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1, "mla_use_output_gate": False,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": mla, "num_heads": 32, "head_dim": 128,
                               "short_conv_kernel_size": 4},
    }


def write(path: Path, layers: int, shard_gb: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    with torch.device("meta"):
        model = HybridModel(ModelConfig.from_dict(cfg))
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for n, shape in shapes.items():
        t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
        if shards[-1] and size + t.numel() * 2 > shard_gb * 1e9:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    print(json.dumps({"wrote": str(path), "shards": len(shards), "tensors": len(shapes)}), flush=True)


def rss_kb_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def load(path: Path, device: str) -> None:
    if device == "cuda":
        torch.zeros(1, device=device)  # the CUDA context is not the loader's memory
    before_kb = rss_kb_now()
    t0 = time.perf_counter()
    model = load_model(path, device=device, dtype=torch.bfloat16)
    secs = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = max(f.stat().st_size for f in path.glob("*.safetensors"))
    print(json.dumps({
        "device": device, "params": sum(p.numel() for p in model.parameters()), "bytes": nbytes,
        "seconds": round(secs, 2), "GB_per_s": round(nbytes / secs / 1e9, 2), "largest_shard_GB": round(shard / 1e9, 2),
        "rss_before_GB": round(before_kb / 1e6, 2), "peak_rss_GB": round(peak_kb / 1e6, 2),
        "peak_rss_above_before_GB": round((peak_kb - before_kb) / 1e6, 2),
    }), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--load", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.write:
        write(args.write, args.layers, args.shard_gb)
    if args.load:
        load(args.load, args.device)


if __name__ == "__main__":
    main()
