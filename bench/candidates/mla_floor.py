"""Floors under one MLA decode call at 1 x 32K on an sm_90 GPU: how fast can anything read the call's 37.7 MB?

    python3 bench/candidates/mla_floor.py [32768]

Times, as CUDA-graph replays cycling through inputs past L2 (bench/kernels.py's ``bench_graph``, graphs of 4 and of
16 calls), each of:

- ``call``: the shipped call (Gluon split kernel + merge, programmatic dependent launch);
- ``split``: its split kernel alone;
- ``split_nocompute`` / ``split_nocompute+merge``: the split kernel with its products and softmax cut out (an
  edited copy of kernels/mla/paged_decode_gluon.py: the same copies, waits and refills, no wgmma), alone and
  with the merge;
- ``read{programs}x{block}``: a plain streaming read of the same bytes (int32 sums of contiguous memory, one
  program per chunk), the best such kernel alone and followed by the shipped merge kernel over 4.2 MB of
  partials it writes (the shape of any split-and-merge call, without its arithmetic);
- ``torch_sum``: torch's reduction over the bytes (one kernel, its own cross-block reduction);
- ``empty_pair``: two empty programmatic dependent launches (the cost of a hand-off).

Prints one JSON line per row: microseconds per call and the fraction of the copy bandwidth (4.27 TB/s, or the
``MLA_BW`` environment variable) that the call's bytes make."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_one import kb, load_source  # bench/kernels.py loaded by path

REPO = Path(__file__).resolve().parents[2]


@triton.jit
def _read_kernel(x, o_part, lse, n, PER: tl.constexpr, BLOCK: tl.constexpr, PART: tl.constexpr,
                 PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * PER
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, PER, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x + offs, mask=offs < n, other=0)
    tot = tl.sum(acc, axis=0)
    if PART:  # a split's partials: [32 heads, 512] bf16 and 32 log-sum-exps, as the split kernel stores them
        r = tl.arange(0, 32 * 512)
        tl.store(o_part + pid * (32 * 512) + r, (tot + r).to(tl.float32).to(tl.bfloat16))
        h = tl.arange(0, 32)
        tl.store(lse + pid * 32 + h, (tot + h).to(tl.float32) * 1e-9)
    else:
        tl.store(lse + pid, tot.to(tl.float32))


@triton.jit
def _empty_kernel(out, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if tl.program_id(0) == 0:
        tl.store(out, 1.0)


def nocompute_module():
    """kernels/mla/paged_decode_gluon.py with the loop's products and softmax cut out (copies, waits, refills
    kept), loaded from a real file (Gluon compiles from the function's source file)."""
    src = (REPO / "kernels/mla/paged_decode_gluon.py").read_text()
    a = src.index("            b0 = st * (NB - 1)\n")
    end_marker = "num_outstanding=0, deps=(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7))\n"
    b = src.index(end_marker) + len(end_marker)
    src = src[:a] + src[b:]
    return load_source(src, "paged_decode_gluon_nc")


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    bw = float(os.environ.get("MLA_BW", "4.27"))
    kb.configure(False)
    from kda_sessions.kernels.mla import paged_decode as pd
    from kda_sessions.kernels.mla import paged_decode_gluon as pdg

    sets, _, bytes_ = kb.mla_case([ctx])
    dev = sets[0][0].device
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    cap = sets[0][3].shape[1] * 64
    splits = pd._num_splits_tokens(1, cap, sm, many_waves=2)
    tps = math.ceil(math.ceil(cap / splits) / 64) * 64
    splits = math.ceil(cap / tps)
    H, R = sets[0][0].shape[1], sets[0][0].shape[2]
    nc = nocompute_module()

    def row(name: str, calls_of: list, extra: dict | None = None) -> None:
        for g in (4, 16):
            ms = kb.bench_graph([calls_of[i % len(calls_of)] for i in range(g)])
            print(json.dumps({"context": ctx, "row": name, "graph_calls": g, "us": round(ms * 1e3, 2),
                              "of_copy_bw": round(bytes_ / (ms * 1e-3) / 1e12 / bw, 3), **(extra or {})}),
                  flush=True)

    def split_only(args, mod, merge: bool):
        ql, qp, kv, pt, sl, scale = args
        o_part = torch.empty(1, splits, H, R, device=dev, dtype=ql.dtype)
        lse = torch.empty(1, splits, H, device=dev, dtype=torch.float32)
        out = torch.empty(1, H, R, device=dev, dtype=ql.dtype)

        def f():
            mod.launch_split_gluon(ql, qp, kv, pt, sl, o_part, lse, scale * 1.4426950408889634, tps, 32, pdl=True)
            if merge:
                pd._combine_kernel_lse[(H, 1, R // 64)](o_part, lse, out, splits, H=H, R=R, BR=64,
                                                         BS=max(16, triton.next_power_of_2(splits)), PDL=True,
                                                         num_warps=4, launch_pdl=True)
        return f

    row("call", [lambda a=a: pd._launch(*a) for a in sets], {"splits": splits})
    row("split", [split_only(a, pdg, False) for a in sets])
    row("split_nocompute", [split_only(a, nc, False) for a in sets])
    row("split_nocompute+merge", [split_only(a, nc, True) for a in sets])

    flat = sets[0][2].view(torch.int32).reshape(-1)  # the sets share one pool of len(sets) calls' pages
    n = bytes_ // 4
    xs = [flat[i * n:(i + 1) * n] for i in range(len(sets))]  # distinct bytes per call, as the calls' pages
    best = None
    for programs in (128, 132, 264, 528):
        for block in (4096, 8192, 16384):
            for warps in (4, 8):
                per = triton.cdiv(triton.cdiv(n, programs), block) * block
                lse = torch.empty(programs, device=dev, dtype=torch.float32)

                def f(x, lse=lse, programs=programs, per=per, block=block, warps=warps):
                    _read_kernel[(programs,)](x, lse, lse, n, PER=per, BLOCK=block, PART=False, PDL=False,
                                              num_warps=warps)
                try:
                    ms = kb.bench_graph([functools_partial(f, xs[i % len(xs)]) for i in range(16)])
                except Exception as e:  # a config that does not compile is skipped, and said
                    print(json.dumps({"row": "read", "programs": programs, "block": block, "error": repr(e)[:200]}))
                    continue
                print(json.dumps({"context": ctx, "row": "read", "graph_calls": 16, "programs": programs,
                                  "block": block, "warps": warps, "us": round(ms * 1e3, 2)}), flush=True)
                if best is None or ms < best[0]:
                    best = (ms, programs, block, warps)
    assert best is not None
    _, programs, block, warps = best
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    o_part = torch.empty(1, programs, H, R, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(1, programs, H, device=dev, dtype=torch.float32)
    out = torch.empty(1, H, R, device=dev, dtype=torch.bfloat16)

    def read(x, part: bool, merge: bool):
        def f():
            _read_kernel[(programs,)](x, o_part, lse, n, PER=per, BLOCK=block, PART=part, PDL=True, num_warps=warps,
                                      launch_pdl=True)
            if merge:
                pd._combine_kernel_lse[(H, 1, R // 64)](o_part, lse, out, programs, H=H, R=R, BR=64,
                                                         BS=max(16, triton.next_power_of_2(programs)), PDL=True,
                                                         num_warps=4, launch_pdl=True)
        return f

    tag = {"programs": programs, "block": block, "warps": warps}
    row(f"read{programs}x{block}", [read(x, False, False) for x in xs], tag)
    row(f"read{programs}x{block}+partials", [read(x, True, False) for x in xs], tag)
    row(f"read{programs}x{block}+partials+merge", [read(x, True, True) for x in xs], tag)
    row("torch_sum", [lambda x=x: x[:n].sum() for x in xs])
    e = torch.zeros(1, device=dev)
    row("empty_pair", [lambda: (_empty_kernel[(128,)](e, PDL=True, launch_pdl=True),
                                _empty_kernel[(256,)](e, PDL=True, launch_pdl=True))])


def functools_partial(f, x):
    return lambda: f(x)


if __name__ == "__main__":
    main()
