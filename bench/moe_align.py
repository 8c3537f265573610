"""The MoE align kernel (``triton_moe.align_triton``: one program groups a prefill's (token, expert) pairs by
expert) at the 48B shape's router (256 experts, top 8 plus the shared expert: 9 pairs a token), for each loop
configuration (``ALIGN_CONFIG``: pairs a loop iteration takes or "sort", sentinel rows written at once, warps). Each
configuration's result is checked against ``align_torch``; times are CUDA-graph replays of 20 calls, us a call.

    python bench/moe_align.py --tokens 16,64,128 --configs 64,64,4/128,1024,8/sort,1024,4 --out $OUT/align.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.launch_chain import graph_us
from kda_sessions.kernels.moe.triton_moe import ALIGN_CONFIG, align_torch, align_triton, launch_config


def case(T: int, configs: list, E: int = 256, k: int = 9, calls: int = 20, reps: int = 20
         ) -> dict:
    g = torch.Generator(device="cuda").manual_seed(T)
    chosen = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
    BM = launch_config(T * k, num_experts=E).BM
    want = align_torch(chosen, E, BM)
    out: dict = {"tokens": T, "pairs": T * k, "BM": BM, "us": {}}
    for cfg in configs:
        got = align_triton(chosen, E, BM, cfg)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), cfg

        def run(cfg=cfg) -> None:
            for _ in range(calls):
                align_triton(chosen, E, BM, cfg)

        us = graph_us(run, reps) / calls
        out["us"][",".join(map(str, cfg))] = round(us, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,64,128")
    ap.add_argument("--configs", default="",
                    help="slash-separated 'pairs,fill,warps' triples (default: the library's ALIGN_CONFIG)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    configs = [tuple(v if v == "sort" else int(v) for v in c.split(",")) for c in args.configs.split("/") if c]
    configs = configs or [ALIGN_CONFIG]
    res = {"machine": torch.cuda.get_device_name(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "command": " ".join(sys.argv),
           "cases": [case(int(t), configs) for t in args.tokens.split(",")]}  # type: ignore[arg-type]
    text = json.dumps(res, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
