"""Where the host's time goes in a short prefill step (an agent's tool output appended), at the Kimi-Linear-48B-A3B
shape's first ``--layers`` layers (random bf16 weights built on the device, ``prefill_48b.build_model``).

One sequence is prefilled ``--context`` tokens, then for each N of ``--tokens``: ``HybridModel.step`` over N new
tokens, timed three ways (median of 5): the host's call alone (launches queued, nothing waited for), the call and
the device until done, and the device's own time (CUDA events); then one step of the first N under cProfile, its top
functions by own time and by cumulative time. A step whose host call is longer than its device time is host-bound: the device idles
between launches.

    PYTHONUNBUFFERED=1 python3 bench/prefill_host.py --layers 16 --tokens 16,128,1024 --out $OUT/host.json
    python3 bench/prefill_host.py --quick --device cpu     # a small shape, to check the script
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_48b import build_model, config_48b

from kda_sessions.model import ForwardBatch, HybridModel

P = 64


class Sequence1:
    """One sequence on slot 0 of its own pools, its pages in order."""

    def __init__(self, model: HybridModel, capacity: int) -> None:
        self.model = model
        self.pools = model.allocate_pools(2, -(-capacity // P) + 4, P)
        self.pages = list(range(-(-capacity // P)))
        self.length = 0

    def batch(self, n: int) -> ForwardBatch:
        dev = self.model.device
        rows = ForwardBatch.rows_for([self.pages], [self.length], [n], P)
        return ForwardBatch(
            input_ids=torch.randint(0, 256, (n,)).to(dev), num_new=[n], start=[self.length],
            slots=torch.zeros(1, dtype=torch.long).to(dev),
            page_table=torch.tensor([self.pages], dtype=torch.int32).to(dev), kv_rows=torch.tensor(rows).to(dev),
        )

    def step(self, b: ForwardBatch) -> None:
        self.model.step(b, self.pools)
        self.length += b.input_ids.shape[0]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def measure(seq: Sequence1, n: int, reps: int = 5) -> dict[str, float]:
    host, total, device = [], [], []
    for _ in range(reps + 1):
        b = seq.batch(n)
        sync()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if torch.cuda.is_available() else []
        t = time.perf_counter()
        if ev:
            ev[0].record()
        seq.step(b)
        if ev:
            ev[1].record()
        host.append(time.perf_counter() - t)
        sync()
        total.append(time.perf_counter() - t)
        if ev:
            device.append(ev[0].elapsed_time(ev[1]) / 1e3)
    med = lambda v: round(statistics.median(v[1:]) * 1e3, 3) if v else 0.0  # noqa: E731
    return {"host_call_ms": med(host), "until_done_ms": med(total), "device_ms": med(device)}


@torch.no_grad()
def host_profile(seq: Sequence1, n: int, top: int = 40) -> str:
    b = seq.batch(n)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    seq.step(b)
    prof.disable()
    sync()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", default="16,128,1024")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tokens = [int(v) for v in args.tokens.split(",") if v]
    model = build_model(config_48b(args.quick, None if args.quick else args.layers), args.device)
    context = min(args.context, 256) if args.quick else args.context
    seq = Sequence1(model, context + 8 * sum(tokens) + 64)
    with torch.no_grad():
        for i in range(0, context, 2048):
            seq.step(seq.batch(min(2048, context - i)))
        for n in tokens:  # compiles what each size needs
            seq.step(seq.batch(n))
    res: dict[str, Any] = {"machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
                           "steps": {}}
    for n in tokens:
        res["steps"][str(n)] = measure(seq, n)
        print(n, res["steps"][str(n)], flush=True)
    res["profile"] = host_profile(seq, tokens[0])
    print(res["profile"], flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
