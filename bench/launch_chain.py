"""The floor of a decode step built as a chain of dependent launches, apart from what its kernels compute.

The 48B step at batch 1 is ~194 launches, each waiting for the one before (docs/benchmarks.md). Its bytes' floor
(bytes / 4.8 TB/s) ignores what a launch boundary costs; this script measures it with the simplest kernels that
have the step's shape: N launches in one CUDA graph, each reading its own slice of weights (which no launch
writes: with PDL it requests them before its wait, as the library's matvecs do) and then one value the launch
before wrote, so every launch depends on the last. Cases, each with PDL and without:

- ``latency``: no weights, one program per SM: the cost of a boundary alone.
- ``stream``: the step's bytes split evenly over the N launches (distinct buffers, beyond the L2), ``--per-sm``
  programs per SM: a chain of ideal kernels, each a perfect read of its share. With PDL twice: the next launch
  let in once every program has its share summed, and (``early_trigger``) as soon as every program has started.
- ``one read``: the same bytes in one ``torch.sum`` (no chain): the rate a plain read reaches.

``stream`` with PDL, against the real step, splits the step's distance from its floor into what a chain of
launches costs at all and what the kernels add over an ideal read. ``--quick --device cpu`` checks the script
(Triton's interpreter, a few small launches, no timing).

    python bench/launch_chain.py --launches 194 --gb 7.34 --out chain.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 1024
"""Elements a program loads at once (bf16: 2 KB; 16 bytes a thread on 4 warps)."""


@triton.jit
def _link_kernel(w, n_w, x_in, n_in, x_out, sink, BLOCK: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr):
    """Program p: the sum of its ITERS * BLOCK elements of w (every load issued before the PDL wait), then
    x_out[p] = x_in[p % n_in] + 1 after it; the sum goes to sink[p] so the loads stay. With PDL the next launch
    may start once every program has summed its share, or with EARLY as soon as every program has started."""
    pid = tl.program_id(0)
    if PDL and EARLY:
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(w + offs, mask=offs < n_w, other=0.0).to(tl.float32)
    if PDL:
        if not EARLY:
            gdc_launch_dependents()
        gdc_wait()  # x_in is the launch before's output
    v = tl.load(x_in + pid % n_in)
    tl.store(x_out + pid, v + 1.0)
    if ITERS > 0:
        tl.store(sink + pid, tl.sum(acc, axis=0))


class Chain:
    """N launches of ``_link_kernel``: launch i reads weights[i] (``elems`` each; none when 0) and the x buffer
    the launch before wrote."""

    def __init__(self, n: int, elems: int, programs: int, pdl: bool, device: str, early: bool = False) -> None:
        self.n, self.programs, self.pdl, self.early = n, programs, pdl, early
        self.iters = math.ceil(elems / (programs * BLOCK)) if elems else 0
        self.weights = [torch.ones(max(elems, 1), dtype=torch.bfloat16, device=device) for _ in range(n)] if elems \
            else [torch.ones(1, dtype=torch.bfloat16, device=device)] * n
        self.elems = elems
        self.xs = [torch.zeros(programs, dtype=torch.float32, device=device) for _ in range(2)]
        self.sink = torch.zeros(programs, dtype=torch.float32, device=device)

    def run(self) -> None:
        launch = {"launch_pdl": True} if self.pdl else {}
        for i in range(self.n):
            _link_kernel[(self.programs,)](self.weights[i], self.elems, self.xs[i % 2], self.programs,
                                           self.xs[(i + 1) % 2], self.sink, BLOCK=BLOCK, ITERS=self.iters,
                                           PDL=self.pdl, EARLY=self.early, num_warps=4, **launch)

    def out(self) -> torch.Tensor:
        """The last launch's x (after one run from the zeros: N everywhere)."""
        return self.xs[self.n % 2]


def graph_us(fn, reps: int) -> float:
    """Median over ``reps`` replays of one CUDA graph of ``fn``, us."""
    for _ in range(2):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return round(sorted(times)[len(times) // 2], 1)


def chain_case(n: int, elems: int, programs: int, pdl: bool, device: str, reps: int, early: bool = False) -> dict:
    chain = Chain(n, elems, programs, pdl, device, early)
    chain.run()  # from zeros: every link adds 1, so each program's value is N if all ran in order
    ok = bool((chain.out() == n).all())
    us = None if device == "cpu" else graph_us(chain.run, reps)
    res = {"launches": n, "programs": programs, "pdl": pdl, "early_trigger": early, "bytes_per_launch": elems * 2,
           "us": us, "order_ok": ok}
    if us is not None:
        res["us_per_launch"] = round(us / n, 2)
        if elems:
            res["TBps"] = round(n * elems * 2 / (us * 1e-6) / 1e12, 2)
    del chain
    return res


def one_read_us(total_elems: int, device: str, reps: int) -> dict:
    """The same bytes in one torch.sum of one buffer."""
    big = torch.ones(total_elems, dtype=torch.bfloat16, device=device)
    out = torch.empty((), dtype=torch.float32, device=device)

    def read() -> None:
        out.copy_(big.sum(dtype=torch.float32))

    if device == "cpu":
        read()
        return {"bytes": total_elems * 2, "us": None}
    us = graph_us(read, reps)
    return {"bytes": total_elems * 2, "us": us, "TBps": round(total_elems * 2 / (us * 1e-6) / 1e12, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few small launches, to check the script")
    ap.add_argument("--launches", type=int, default=194, help="launches in the chain (the 48B step at batch 1: 194)")
    ap.add_argument("--gb", type=float, default=7.34,
                    help="bytes the chain reads in all, GB (the 48B step at 1 x 128K: 7.34, its floor 1.53 ms)")
    ap.add_argument("--per-sm", type=int, default=8, help="programs per SM of the stream case")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.launches, a.gb, a.reps = 4, 2e-5, 2
    sms = 4 if a.device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    pdl_ok = a.device != "cpu" and torch.cuda.get_device_capability(0)[0] >= 9
    elems = int(a.gb * 1e9 / 2 / a.launches)
    res: dict = {"device": "cpu" if a.device == "cpu" else torch.cuda.get_device_name(0), "sms": sms,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "launches": a.launches, "gb": a.gb,
                 "floor_us_at_4.8TBps": round(a.gb * 1e9 / 4.8e12 * 1e6, 1), "cases": []}
    for pdl in ([True, False] if pdl_ok else [False]):
        res["cases"].append({"case": "latency", **chain_case(a.launches, 0, sms, pdl, a.device, a.reps)})
        res["cases"].append({"case": "stream", **chain_case(a.launches, elems, sms * a.per_sm, pdl, a.device,
                                                            a.reps)})
        if pdl:  # the next launch let in at the start: its programs take SMs as this one's finish
            res["cases"].append({"case": "stream", **chain_case(a.launches, elems, sms * a.per_sm, pdl, a.device,
                                                                a.reps, early=True)})
        print(json.dumps(res["cases"][-2:]), flush=True)
    res["one_read"] = one_read_us(elems * a.launches, a.device, a.reps)
    print(json.dumps(res, indent=1))
    assert all(c["order_ok"] for c in res["cases"]), "a link ran out of order or not at all"
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
