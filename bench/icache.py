"""How long a GPU takes to run straight-line code it has not cached: one launch of N unrolled FMA groups
(``tl.static_range``: ~64 bytes of SASS a group) against the same work in a loop (``range``: a few hundred bytes
of code), no memory traffic but a 512-byte read and write a program. If the unrolled launch is much slower than
the loop at the same instruction count, a latency-bound kernel's time goes on fetching its instructions (from the
L2, or with the L2 flushed between launches, from HBM), and its code size is what to cut.

    python bench/icache.py [--programs 64] [--sizes 16,64,256,1024] [--flush-mb 256]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _fma_kernel(x, a, N: tl.constexpr, LOOP: tl.constexpr):
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    x0 = tl.load(x + i)
    av = tl.load(a)
    x1, x2, x3 = x0 + 1.0, x0 + 2.0, x0 + 3.0
    if LOOP:
        for _ in range(N):
            x0 = x0 * av + 1.0
            x1 = x1 * av + 2.0
            x2 = x2 * av + 3.0
            x3 = x3 * av + 4.0
    else:
        for _ in tl.static_range(N):
            x0 = x0 * av + 1.0
            x1 = x1 * av + 2.0
            x2 = x2 * av + 3.0
            x3 = x3 * av + 4.0
    tl.store(x + i, x0 + x1 + x2 + x3)


def launch_us(n: int, loop: bool, programs: int, flush: torch.Tensor | None, reps: int = 50) -> float:
    """Median us of one launch (CUDA events around it), the L2 flushed before each launch when ``flush`` is given."""
    x = torch.zeros(programs * 128, device="cuda")
    a = torch.full((1,), 0.999, device="cuda")
    _fma_kernel[(programs,)](x, a, N=n, LOOP=loop, num_warps=4)  # compile
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.add_(1)  # reads and writes the whole buffer: the L2 holds it, not the kernel's code
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        _fma_kernel[(programs,)](x, a, N=n, LOOP=loop, num_warps=4)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=64)
    ap.add_argument("--sizes", default="16,64,256,1024", help="FMA groups (4 FMAs each) a thread runs")
    ap.add_argument("--flush-mb", type=int, default=256, help="a buffer touched before each flushed launch")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/icache.py needs a CUDA device")
    flush = torch.zeros(args.flush_mb << 18, device="cuda")
    rows = []
    for n in [int(v) for v in args.sizes.split(",")]:
        row = {"groups": n}
        for loop in (False, True):
            name = "loop" if loop else "unrolled"
            row[name + "_us"] = round(launch_us(n, loop, args.programs, None), 2)
            row[name + "_flushed_us"] = round(launch_us(n, loop, args.programs, flush), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "programs": args.programs, "rows": rows}))


if __name__ == "__main__":
    main()
