"""The Gluon split kernel of an MLA decode candidate against the float32 twin and the Triton kernel, on the device:

    python3 bench/candidates/mla_gluon_check.py kernels/mla/paged_decode.py

Heads 16 / 32 / 64 / 20 (a partial head block), pages of 64 and 128 rows, lengths that end inside a tile, empty
splits, and one CUDA-graph capture replayed on new inputs. Prints one JSON line per case and a final verdict line;
exit status 1 if any case is wrong."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_one import kb  # bench/kernels.py loaded by path (its import shim, input builders, the twin)

mla_decode_paged_naive = kb.naive_mla_decode_paged


def load(path: str):
    return kb.load_mla(path)[Path(path).stem]


def case(lens: list[int], H: int, P: int, seed: int = 0, R: int = 512, DR: int = 64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, pages = len(lens), [math.ceil(L / P) for L in lens]
    total = sum(pages) + 3
    kv = torch.randn(total, P, R + DR, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(total, device="cuda", generator=g).int()
    pt = torch.zeros(N, max(pages), device="cuda", dtype=torch.int32)
    used = 0
    for n, k in enumerate(pages):
        pt[n, :k] = perm[used:used + k]
        used += k
    ql = torch.randn(N, H, R, device="cuda", generator=g).bfloat16()
    qp = torch.randn(N, H, DR, device="cuda", generator=g).bfloat16()
    sl = torch.tensor(lens, device="cuda", dtype=torch.int32)
    return ql, qp, kv, pt, sl, (128 + 64) ** -0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    mod = load(sys.argv[1])
    bad = 0
    cases = [([33000, 1000, 5, 1], 32, 64, None), ([64, 65, 127, 4097], 16, 64, None), ([1], 64, 64, None),
             ([300, 77], 20, 128, None), ([2000, 3], 32, 64, 40), ([130000], 32, 64, None)]
    for lens, H, P, splits in cases:
        ql, qp, kv, pt, sl, scale = case(lens, H, P)
        ref = mla_decode_paged_naive(ql.float(), qp.float(), kv.float(), pt, sl, scale)
        BH = max(16, 1 << (H - 1).bit_length())
        used = mod.gluon_split_ok(ql, kv, 512, 64, P, 64, BH)
        g = mod._launch(ql, qp, kv, pt, sl, scale, num_splits=splits, use_gluon=True)
        t = mod._launch(ql, qp, kv, pt, sl, scale, num_splits=splits, use_gluon=False)
        row = {"lens": lens, "H": H, "P": P, "splits": splits, "gluon_used": used, "rel_gluon": rel(g, ref),
               "rel_triton": rel(t, ref), "max_diff_gluon_triton": float((g.float() - t.float()).abs().max()),
               "finite": bool(torch.isfinite(g).all())}
        ok = used and row["finite"] and row["rel_gluon"] < 1e-2
        bad += not ok
        print(json.dumps({**row, "ok": ok}), flush=True)
    # a CUDA graph captured once and replayed on new q and a longer context: the descriptor is captured by value
    ql, qp, kv, pt, sl, scale = case([5000, 700], 32, 64, seed=1)
    out = mod._launch(ql, qp, kv, pt, sl, scale)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mod._launch(ql, qp, kv, pt, sl, scale)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod._launch(ql, qp, kv, pt, sl, scale)
    ql.copy_(torch.randn_like(ql.float()).bfloat16())
    sl[1] = 1234
    graph.replay()
    torch.cuda.synchronize()
    ref = mla_decode_paged_naive(ql.float(), qp.float(), kv.float(), pt, sl, scale)
    r = rel(out, ref)
    bad += not r < 1e-2
    print(json.dumps({"graph_replay_rel": r, "ok": r < 1e-2}), flush=True)
    print(json.dumps({"verdict": "ok" if bad == 0 else f"{bad} wrong"}), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
