"""Kernel durations of MLA decode launches (split and merge kernels apart), from torch.profiler over eager calls:

    python3 bench/candidates/mla_profile.py kernels/mla/paged_decode.py,bench/candidates/paged_decode_v8.py \
        32768,131072,1048576

One JSON line per module and context: mean device microseconds per call of each kernel, and their sum. The calls
cycle through copies of the inputs larger than L2, so each reads DRAM."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_one import kb  # bench/kernels.py loaded by path


def main() -> None:
    paths, ctxs = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")]
    cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    kb.configure(False)
    for ctx in ctxs:
        # enough copies (distinct pages of one pool) to pass 200 MB, so every call reads DRAM, not the L2
        sets = kb.mla_setup([ctx], copies=max(1, -(-200_000_000 // (ctx * 1152))), P=64)
        for path in paths:
            mod = kb.load_mla(path)[Path(path).stem] if "candidates" in path else kb.load_mla(None)["current"]
            c = cfg if "candidates" in path else {}
            for args in sets[:3]:
                mod._launch(*args, **c)
            torch.cuda.synchronize()
            calls = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    mod._launch(*sets[i % len(sets)], **c)
                torch.cuda.synchronize()
            per: dict[str, float] = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    per[ev.name] = per.get(ev.name, 0.0) + ev.device_time / calls
            print(json.dumps({"module": Path(path).stem, "cfg": c, "context": ctx,
                              "us": {k: round(v, 2) for k, v in per.items()}, "sum_us": round(sum(per.values()), 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
