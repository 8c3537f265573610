"""Host cost of one eager MLA decode call on the device, Gluon against Triton split kernel (1 x 32K, H 32):

    python3 bench/candidates/mla_eager_cost.py

Prints microseconds per call (host loop of 200 calls, then a synchronize), the same for the pieces of a Gluon
call (gluon_split_ok, building each TMA descriptor, the split kernel's launch with descriptors built beforehand,
the merge's launch), and cProfile's top entries for 200 Gluon calls."""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time

import torch
import triton

from kda_sessions.kernels.mla import paged_decode as pd
from kda_sessions.kernels.mla import paged_decode_gluon as pg


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / n * 1e6, 1)


def main() -> None:
    P, L, H = 64, 32768, 32
    kv = torch.randn(L // P + 2, P, 576, device="cuda").bfloat16()
    pt = torch.randperm(L // P, device="cuda").int()[None]
    sl = torch.tensor([L], device="cuda", dtype=torch.int32)
    ql = torch.randn(1, H, 512, device="cuda").bfloat16()
    qp = torch.randn(1, H, 64, device="cuda").bfloat16()
    out = {}
    for name, flag in (("gluon", True), ("triton", False)):
        out[f"{name}_eager_us"] = per_call_us(lambda flag=flag: pd._launch(ql, qp, kv, pt, sl, 0.07, use_gluon=flag))
    rows = kv.view(-1, 576)
    boxes = rows.as_strided((8, rows.shape[0], 64), (64, rows.shape[1], 1))
    lay3 = pg.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    lay2 = pg.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    out["gluon_split_ok_us"] = per_call_us(lambda: pg.gluon_split_ok(ql, kv, 512, 64, P, 64, 32), 1000)
    out["descriptor_3d_us"] = per_call_us(
        lambda: pg.TensorDescriptor(boxes, list(boxes.shape), list(boxes.stride()), [8, 64, 64], lay3), 1000)
    out["descriptor_2d_us"] = per_call_us(
        lambda: pg.TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [64, 64], lay2), 1000)
    desc = pg.TensorDescriptor(boxes, list(boxes.shape), list(boxes.stride()), [8, 64, 64], lay3)
    pe_desc = pg.TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [64, 64], lay2)
    S = 128
    o_part = torch.empty(1, S, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, S, H, device="cuda", dtype=torch.float32)
    res = torch.empty(1, H, 512, device="cuda", dtype=torch.bfloat16)
    out["split_launch_prebuilt_us"] = per_call_us(lambda: pg._split_kernel_gluon[(1, S, 1)](
        ql, qp, desc, pe_desc, pt, sl, o_part, lse, 0.1, pt.shape[1], 256, S, H=H, R=512, DR=64, P=P, BH=32, BN=64,
        PDL=True, num_warps=4, launch_pdl=True))
    out["split_launch_full_us"] = per_call_us(lambda: pg.launch_split_gluon(ql, qp, kv, pt, sl, o_part, lse, 0.1, 256,
                                                                            32, pdl=True))
    out["merge_launch_us"] = per_call_us(lambda: pd._combine_kernel_lse[(H, 1, 8)](
        o_part, lse, res, S, H=H, R=512, BR=64, BS=triton.next_power_of_2(S), PDL=True, num_warps=4, launch_pdl=True))
    out["empty_alloc_us"] = per_call_us(lambda: (torch.empty(1, S, H, 512, device="cuda", dtype=torch.bfloat16),
                                                 torch.empty(1, S, H, device="cuda"), torch.empty_like(ql)), 1000)
    print(json.dumps(out), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        pd._launch(ql, qp, kv, pt, sl, 0.07, use_gluon=True)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
