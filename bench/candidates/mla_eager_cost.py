"""Host cost of one eager MLA decode call on the device, Gluon against Triton split kernel (1 x 32K, H 32):

    python3 bench/candidates/mla_eager_cost.py

Prints microseconds per call (host loop of 200 calls, then a synchronize) and for building the TMA descriptor."""

from __future__ import annotations

import json
import time

import torch

from kda_sessions.kernels.mla import paged_decode as pd
from kda_sessions.kernels.mla import paged_decode_gluon as pg


def main() -> None:
    P, L, H = 64, 32768, 32
    kv = torch.randn(L // P + 2, P, 576, device="cuda").bfloat16()
    pt = torch.randperm(L // P, device="cuda").int()[None]
    sl = torch.tensor([L], device="cuda", dtype=torch.int32)
    ql = torch.randn(1, H, 512, device="cuda").bfloat16()
    qp = torch.randn(1, H, 64, device="cuda").bfloat16()
    out = {}
    for name, flag in (("gluon", True), ("triton", False)):
        for _ in range(5):
            pd._launch(ql, qp, kv, pt, sl, 0.07, use_gluon=flag)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            pd._launch(ql, qp, kv, pt, sl, 0.07, use_gluon=flag)
        torch.cuda.synchronize()
        out[f"{name}_eager_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    rows = kv.view(-1, 576)
    t0 = time.perf_counter()
    for _ in range(1000):
        pg.TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [64, 64],
                            pg.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    out["descriptor_build_us"] = round((time.perf_counter() - t0) / 1000 * 1e6, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
