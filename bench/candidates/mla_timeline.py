"""Where the time of one MLA decode call goes, per program of the Gluon split kernel, on an sm_90 GPU:

    python3 bench/candidates/mla_timeline.py 32768,131072

Builds an instrumented copy of kernels/mla/paged_decode_gluon.py (the source with probes inserted at marked lines,
so it cannot drift from the kernel) whose programs record %globaltimer and %clock64 at six points: entry, first
tile's copy issued, q staged, first tile landed, loop done, partials stored; and their SM. Runs eager calls and
CUDA-graph replays (inputs cycling past L2) with and without programmatic dependent launch, and prints one JSON
line per (context, mode): percentiles over programs of each point's time after the first program's entry (us,
globaltimer), of the per-program spans from the SM clock (us), and the number of tiles per program."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_one import kb, load_source  # bench/kernels.py loaded by path

REPO = Path(__file__).resolve().parents[2]
POINTS = ["entry", "copies_out", "q_staged", "first_tile", "loop_done", "stored"]

_STAMP = '''
    @gluon.jit
    def _stamp(buf, k: gl.constexpr):
        pid = (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0) + gl.program_id(0)
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(buf + pid * 16 + k, t)
        gl.store(buf + pid * 16 + 8 + k, c)
        if k == 0:
            sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.store(buf + pid * 16 + 7, sm.to(gl.int64))

'''


def instrumented():
    """The Gluon kernel module with probes; its launcher reads the probe buffer from the module global TL_BUF."""
    src = (REPO / "kernels/mla/paged_decode_gluon.py").read_text()
    if os.environ.get("MLA_TL_NOCOMPUTE"):  # the loop's products and softmax cut out (copies, waits, refills kept)
        a = src.index("            b0 = st * (NB - 1)\n")
        end = "num_outstanding=0, deps=(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7))\n"
        src = src[:a] + src[src.index(end) + len(end):]
    edits = [  # (marker, text inserted after it): each marker must occur exactly once
        ("if gluon is not None:\n", _STAMP),
        ("NSPLIT, H: gl.constexpr,", ""),
        ("        n = gl.program_id(2)\n", "        _stamp(tl_buf, 0)\n"),
        ("        page_nx = gl.load(pt + gl.minimum((start + 2 * BN) // P, max_pages - 1))\n",
         "        _stamp(tl_buf, 1)\n"),
        ("            mbarrier.wait(bar.index(st), (i // 2) & 1)\n", "            if i == 0:\n                _stamp(tl_buf, 3)\n"),
        ("        mbarrier.invalidate(bar.index(1))\n", "        _stamp(tl_buf, 4)\n"),
        ("        gl.store(lse_part + base, lse, mask=rh < H)\n", "        _stamp(tl_buf, 5)\n"),
    ]
    for marker, text in edits:
        assert src.count(marker) == 1, marker
        src = src.replace(marker, marker + text)
    src = src.replace("NSPLIT, H: gl.constexpr,", "NSPLIT, tl_buf, H: gl.constexpr,")
    staged = "        fence_async_shared()\n        _cta_barrier()\n\n        m_i = "
    assert src.count(staged) == 1
    src = src.replace(staged, "        fence_async_shared()\n        _cta_barrier()\n        _stamp(tl_buf, 2)\n\n        m_i = ")
    call = "tokens_per_split, o_part.shape[1], H=H"
    assert src.count(call) == 1
    src = src.replace(call, "tokens_per_split, o_part.shape[1], TL_BUF, H=H")
    return load_source(src + "\nTL_BUF = None\n", "paged_decode_gluon_tl")


def pct(x: torch.Tensor) -> dict:
    q = torch.quantile(x.double(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
    return {k: round(float(v), 2) for k, v in zip(("min", "p10", "p50", "p90", "max"), q)}


def summary(buf: torch.Tensor, programs: int, tiles: torch.Tensor) -> dict:
    b = buf[:programs].cpu()
    t = b[:, :6].double()
    c = b[:, 8:14].double()
    t0 = t[:, 0].min()
    ghz = float(((c[:, 5] - c[:, 0]) / (t[:, 5] - t[:, 0]).clamp_min(1)).median())  # SM cycles per ns
    out = {"kernel_us": round(float(t[:, 5].max() - t0) / 1e3, 2), "sm_ghz": round(ghz, 3),
           "sms": int(b[:, 7].unique().numel()), "tiles": pct(tiles.double())}
    out["at_us"] = {name: pct((t[:, k] - t0) / 1e3) for k, name in enumerate(POINTS)}
    out["span_us"] = {f"{POINTS[k]}->{POINTS[k + 1]}": pct((c[:, k + 1] - c[:, k]) / ghz / 1e3) for k in range(5)}
    return out


def main() -> None:
    ctxs = [int(x) for x in sys.argv[1].split(",")]
    cfg = json.loads(os.environ.get("MLA_TL_CFG", "{}"))  # more launch parameters, e.g. {"prefetch": 2}
    kb.configure(False)
    from kda_sessions.kernels.mla import paged_decode as pd

    tl_mod = instrumented()
    pd.launch_split_gluon = tl_mod.launch_split_gluon  # _launch calls the instrumented kernel
    for ctx in ctxs:
        sets = kb.mla_setup([ctx], copies=max(1, -(-200_000_000 // (ctx * 1152))), P=64)
        H = sets[0][0].shape[1]
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        cap = sets[0][3].shape[1] * 64  # the page table's capacity in tokens, as _launch counts it
        splits = pd._num_splits_tokens(1, cap, sm, many_waves=2)
        tps = math.ceil(math.ceil(cap / splits) / 64) * 64
        splits = math.ceil(cap / tps)
        programs = splits * math.ceil(H / 32)
        starts = torch.arange(splits) * tps
        tiles = ((torch.clamp(torch.minimum(starts + tps, torch.tensor(ctx)) - starts, min=0) + 63) // 64).repeat(
            math.ceil(H / 32))
        tl_mod.TL_BUF = torch.zeros(programs, 16, dtype=torch.int64, device="cuda")
        for pdl in (False, True):
            for args in sets[:2]:
                pd._launch(*args, pdl=pdl, **cfg)
            torch.cuda.synchronize()
            for i in range(6):  # eager: the last call's probes, its inputs last read 5 calls ago
                pd._launch(*sets[(i + 2) % len(sets)], pdl=pdl, **cfg)
                torch.cuda.synchronize()
            print(json.dumps({"context": ctx, "mode": "eager", "pdl": pdl, "splits": splits, "tokens_per_split": tps,
                              **summary(tl_mod.TL_BUF, programs, tiles)}), flush=True)
            calls = max(len(sets), 4)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(calls):
                    pd._launch(*sets[i % len(sets)], pdl=pdl, **cfg)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            print(json.dumps({"context": ctx, "mode": f"graph of {calls}", "pdl": pdl, "splits": splits,
                              **summary(tl_mod.TL_BUF, programs, tiles)}), flush=True)
            del graph


if __name__ == "__main__":
    main()
