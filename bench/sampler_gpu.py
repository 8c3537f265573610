"""The sampler's cost on the device: ``engine.sampler.sample_batch_async`` on random float32 logits of the 48B
model's vocabulary (163,840), per batch and setting, as a decode step pays it (queued behind other work, no sync):
device time per draw (CUDA events around ``--reps`` draws) and host time per call, and the profiler's kernels of
one draw.

    PYTHONUNBUFFERED=1 python3 bench/sampler_gpu.py --out $OUT/sampler.json    # on the device
    python bench/sampler_gpu.py --device cpu --vocab 4096 --reps 3            # checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kda_sessions.engine.sampler import sample_batch_async
from kda_sessions.types import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.7),
    "top-k": SamplingParams(temperature=0.7, top_k=50),
    "nucleus": SamplingParams(temperature=0.7, top_p=0.95),
    "nucleus+logprobs": SamplingParams(temperature=0.7, top_p=0.95, logprobs=True),
}


def case(batch: int, name: str, vocab: int, reps: int, device: str, seeded: bool) -> dict[str, Any]:
    logits = torch.randn(batch, vocab, device=device) * 4
    params = [SETTINGS[name]] * batch
    gens = [torch.Generator(device=device).manual_seed(i) if seeded else None for i in range(batch)]
    for _ in range(3):
        sample_batch_async(logits, params, gens).result()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(4 + reps // 2):  # ~2.7 ms each in float32: the host queues every draw before they run
            busy = busy @ busy / 64
        start.record()
    t = time.perf_counter()
    pending = [sample_batch_async(logits, params, gens) for _ in range(reps)]
    host_us = (time.perf_counter() - t) / reps * 1e6
    if cuda:
        end.record()
    for p in pending:
        p.result()
    out: dict[str, Any] = {"batch": batch, "setting": name + ("/seeded" if seeded else ""),
                           "host_us_per_call": round(host_us, 1)}
    if cuda:
        torch.cuda.synchronize()
        out["device_us_per_call"] = round(start.elapsed_time(end) / reps * 1e3, 1)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            sample_batch_async(logits, params, gens).result()
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                rows.append((round(us, 1), e.count, e.key[:90]))
        rows.sort(reverse=True)
        out["kernels"] = len(rows)
        out["top"] = rows[:8]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--reps", type=int, default=20,
                    help="draws queued at once: few enough that their launches (~40 each) fit the device's launch "
                         "queue (~1,000), past which the host blocks and both timings measure that instead")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res: dict[str, Any] = {"machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                           "command": " ".join(sys.argv), "cases": []}
    for b in [int(v) for v in args.batches.split(",")]:
        for name in args.settings.split(","):
            for seeded in ((False, True) if name == "nucleus" else (False,)):
                r = case(b, name, args.vocab, args.reps, args.device, seeded)
                res["cases"].append(r)
                print(json.dumps(r), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
