"""The decode step's Triton kernels of kernels/linear, kernels/mla/decode_prep.py and kernels/kda/decode_triton.py
compiled for sm_90 with the installed Triton (its bundled ptxas; no GPU needed). The interpreter runs what the
compiler may refuse (a name assigned in both branches of an ``if`` with two types), and only the compiled code
shows whether the matvec's loads are 16-byte vectors, all issued before the first product."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# in a process of its own: this folder's conftest turns the interpreter on without a GPU
_COMPILE = """
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda_sessions.kernels.feed.triton_feed import _feed_kernel
from kda_sessions.kernels.kda.decode_triton import _decode_kernel
from kda_sessions.kernels.linear.matvec_triton import _matvec_kernel
from kda_sessions.kernels.mla.decode_prep import _prep_kernel
from kda_sessions.kernels.moe.route import _route_decode_kernel
from kda_sessions.kernels.moe.triton_moe import _down_direct_kernel, _up_direct_kernel


def ptx(fn, types, const):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in const else types.get(p, "i32") for p in params}
    # pointers and row strides (s_*, stride_*) divisible by 16, as the launches' arguments are (Triton specializes on it)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p][0] == "*" or p.startswith(("s_", "stride_"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


bf, f32 = "*bf16", "*fp32"
# the KDA decode as the model launches it at one sequence: gate projections inside, the gated output norm, two V
# blocks a head (the last to arrive shifts the q/k tails and norms); "decode_one_block": one block a head
DECODE_TYPES = {"qkv": bf, "raw": bf, "b": bf, "cw": bf, "conv": bf, "A_log": f32, "dt_bias": f32,
                "lower_bound": "fp32", "state": f32, "slots": "*i32", "o": bf, "scale": "fp32", "gw": bf, "gate": bf,
                "nw": bf, "y": bf, "gz": f32, "eps": "fp32", "ogw": bf, "counter": "*i32", "stamps": "*i64"}
DECODE_CONST = {"H": 32, "K": 128, "V": 128, "W": 4, "BK": 128, "BV": 64, "BOUNDED": False, "KF": 128, "BJ": 32,
                "NORM": True, "VF": 128, "BJO": 32, "BVH": 128, "STAMPS": False}
out = {
    "matvec": ptx(_matvec_kernel, {"x": bf, "w": bf, "y": bf}, {"I": 4096, "N": 1, "BO": 1, "BI": 4096, "PDL": False,
                                                                  "HO": 0, "STAMPS": False}),
    "prep": ptx(_prep_kernel, {"y": bf, "w": bf, "norm_w": f32, "kv": bf, "kv_rows": "*i64", "q_lat": bf, "q_pe": bf,
                               "eps": "fp32"},
                {"H": 32, "DN": 128, "DR": 64, "DV": 128, "R": 512, "BR": 128, "BDN": 128, "BDR": 64, "BRF": 512,
                 "PDL": False}),
    "decode": ptx(_decode_kernel, DECODE_TYPES, {**DECODE_CONST, "PDL": False}),
    "decode_one_block": ptx(_decode_kernel, DECODE_TYPES, {**DECODE_CONST, "BV": 128, "PDL": False}),
}
# the PDL variants (``kernels.moe.pdl``)
out["matvec_pdl"] = ptx(_matvec_kernel, {"x": bf, "w": bf, "y": bf}, {"I": 4096, "N": 1, "BO": 1, "BI": 4096,
                                                                     "PDL": True, "HO": 0, "STAMPS": False})
out["prep_pdl"] = ptx(_prep_kernel, {"y": bf, "w": bf, "norm_w": f32, "kv": bf, "kv_rows": "*i64", "q_lat": bf,
                                     "q_pe": bf, "eps": "fp32"},
                      {"H": 32, "DN": 128, "DR": 64, "DV": 128, "R": 512, "BR": 128, "BDN": 128, "BDR": 64, "BRF": 512,
                       "PDL": True})
out["heads_pdl"] = ptx(_matvec_kernel, {"x": bf, "w": bf, "y": bf},
                       {"I": 512, "N": 1, "BO": 1, "BI": 512, "PDL": True, "HO": 128, "STAMPS": False})
out["decode_pdl"] = ptx(_decode_kernel, DECODE_TYPES, {**DECODE_CONST, "PDL": True})
# with its clock stamps (``kernels.stamps``: bench/decode_48b.py --stamps)
out["decode_stamps_pdl"] = ptx(_decode_kernel, DECODE_TYPES, {**DECODE_CONST, "PDL": True, "STAMPS": True})
# the MoE down kernel at one token with the residual add and norm after it (its last program: ``fused_moe_add_norm``),
# and the decode router at one token with its norm (the add and norm before a MoE layer)
DOWN_TYPES = {"act": bf, "w2": bf, "y": bf, "chosen": "*i64", "route_w": bf, "res": bf, "norm_w": bf, "s_out": bf,
              "h_out": bf, "counter": "*i32", "eps": "fp32"}
DOWN_CONST = {"D": 2304, "Fw": 1024, "TOP_K": 9, "BN": 2, "BK": 512, "NORM": True, "BD": 4096, "PRE": 2, "GROUP": 2,
              "PDL": True, "TRIGGER": True, "STAMPS": False}
ROUTE_TYPES = {"x": bf, "gate": bf, "bias": f32, "logits": f32, "counter": "*i32", "chosen": "*i64", "weights": bf,
               "scale": "fp32", "res": bf, "norm_w": bf, "s_out": bf, "h_out": bf, "eps": "fp32"}
ROUTE_CONST = {"D": 2304, "BT": 1, "BE": 2, "BK": 4096, "K": 8, "EP": 256, "RENORM": True, "EXTRA": 1, "NORM": True,
               "PDL": True, "STAMPS": False, "LANES": False, "NT": 128}
out["moe_down_norm_pdl"] = ptx(_down_direct_kernel, DOWN_TYPES, DOWN_CONST)
out["route_pdl"] = ptx(_route_decode_kernel, ROUTE_TYPES, ROUTE_CONST)
out["route_lanes_pdl"] = ptx(_route_decode_kernel, ROUTE_TYPES, {**ROUTE_CONST, "LANES": True})
out["matvec_stamps_pdl"] = ptx(_matvec_kernel, {"x": bf, "w": bf, "y": bf, "stamps": "*i64"},
                               {"I": 4096, "N": 1, "BO": 1, "BI": 4096, "PDL": True, "HO": 0, "STAMPS": True})
out["moe_down_stamps_pdl"] = ptx(_down_direct_kernel, {**DOWN_TYPES, "stamps": "*i64"}, {**DOWN_CONST, "STAMPS": True})
out["route_stamps_pdl"] = ptx(_route_decode_kernel, {**ROUTE_TYPES, "stamps": "*i64"}, {**ROUTE_CONST, "STAMPS": True})
# the MoE up kernel at one token with the shared expert's rows read before the wait (``triton_moe.FIXED_FIRST``)
out["moe_up_fixed_pdl"] = ptx(_up_direct_kernel, {"x": bf, "w13": bf, "act": bf, "chosen": "*i64"},
                              {"D": 2304, "Fw": 1024, "TOP_K": 9, "BN": 2, "BK": 512, "PDL": True, "FIXED": True,
                               "D1": 2048, "DR": 256})
# the decode feed of a decode step queued ahead (``kernels.feed``): 64 rows, the scalars as runtime ints
out["feed"] = ptx(_feed_kernel, {"tokens": "*i64", "rows": "*i32", "can_stop": "*i32", "stop_ids": "*i64",
                                 "ids": "*i32", "slots": "*i32", "seq_lens": "*i32", "kv_rows": "*i64", "table": "*i32"},
                  {"BM": 64, "BS": 16})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def out() -> dict:
    """Each kernel's PTX, compiled once for this module's tests."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_decode_kernels_compile_for_sm90(out):
    assert set(out) == {"matvec", "prep", "decode", "decode_one_block", "matvec_pdl", "prep_pdl", "heads_pdl",
                        "decode_pdl", "moe_down_norm_pdl", "moe_up_fixed_pdl", "route_pdl", "feed",
                        "decode_stamps_pdl", "moe_down_stamps_pdl", "route_stamps_pdl",
                        "matvec_stamps_pdl", "route_lanes_pdl"}
    assert "st.global" in out["feed"] and "griddepcontrol" not in out["feed"]
    assert "atom.global.gpu.acq_rel.add" in out["route_pdl"]
    # the down kernel with the add and norm: its stores after the wait (it lets the next launch start after it
    # too), the last program's arrival counted and the counter reset
    lines = out["moe_down_norm_pdl"].splitlines()
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    assert len(waits) == 1 and not any("st.global" in ln for ln in lines[: waits[0]])
    assert any("st.global" in ln for ln in lines[waits[0] :])
    assert "atom.global.gpu.acq_rel.add" in out["moe_down_norm_pdl"]
    # the down kernel and the router: one launch_dependents each, after the wait (their dependents' prologues read
    # the router's choices, or the next launch reads nothing before its wait)
    for name in ("moe_down_norm_pdl", "route_pdl"):
        lines = out[name].splitlines()
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        trig = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
        assert len(trig) == 1 and trig[0] > wait, name
    # the up kernel with a fixed expert: that expert's rows (2 x 2304 bf16 of w1 and of w3) in 16-byte loads
    # before the wait, the activations stored after it
    lines = out["moe_up_fixed_pdl"].splitlines()
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    assert len(waits) == 1 and sum("ld.global.v4" in ln for ln in lines[: waits[0]]) >= 8
    assert not any("st.global" in ln for ln in lines[: waits[0]])
    assert "atom.global.gpu.relaxed.exch" in out["moe_down_norm_pdl"]
    assert all("griddepcontrol" not in out[k] for k in ("matvec", "prep", "decode", "decode_one_block"))
    # the KDA decode's last-arriver: one acq_rel atomic add on the counter and its reset; none with one block a head
    assert "atom.global.gpu.acq_rel.add" in out["decode"] and "atom.global.gpu.relaxed.exch" in out["decode"]
    assert "atom." not in out["decode_one_block"]
    lines = out["matvec"].splitlines()
    loads = [i for i, ln in enumerate(lines) if "ld.global" in ln]
    math = [i for i, ln in enumerate(lines) if any(op in ln for op in ("fma.rn.f32", "mul.f32", "add.f32"))]
    # one weight row of 4096 bf16 on 4 warps: 8 KB in 16-byte loads (4 a thread), then x's, before any product
    assert sum("ld.global.v4" in lines[i] for i in loads) >= 8
    assert all("ld.global.v4" in lines[i] for i in loads)
    assert math and max(loads) < min(math)


def _before_wait(ptx: str) -> tuple[list[str], list[str]]:
    """The lines of a PDL kernel's PTX before its ``griddepcontrol.wait`` and after it (one wait, after the
    ``launch_dependents``)."""
    lines = ptx.splitlines()
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    trigger = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    assert len(waits) == 1 and len(trigger) == 1 and trigger[0] < waits[0]
    return lines[: waits[0]], lines[waits[0] + 1 :]


def test_pdl_kernels_load_their_weights_before_the_wait(out):
    """The PDL variants (Hopper): the matvecs' weight rows and the prep kernel's W_uk tile are requested before the
    wait for the launch before; the KDA decode reads nothing before it; no store precedes a wait."""
    pre, post = _before_wait(out["matvec_pdl"])
    # one weight row of 4096 bf16 on 4 warps: 8 KB in 16-byte loads (4 a thread), all before the wait; x's after it
    assert sum("ld.global.v4" in ln for ln in pre) >= 4
    assert any("ld.global" in ln for ln in post)
    assert not any("st.global" in ln for ln in pre)
    pre, post = _before_wait(out["heads_pdl"])
    # a W_uv row of 512 bf16 on 4 warps: one 8-byte load a thread before the wait, the head's x after it
    assert any("ld.global" in ln for ln in pre) and any("ld.global" in ln for ln in post)
    assert not any("st.global" in ln for ln in pre)
    # the prep kernel: one wait in each branch (W_uk's tile before it; the norm's weight before the other)
    lines = out["prep_pdl"].splitlines()
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    assert len(waits) == 2
    assert sum("ld.global" in ln for ln in lines[: waits[0]]) >= 8
    assert not any("st.global" in ln for ln in lines[: waits[0]])
    pre, post = _before_wait(out["decode_pdl"])
    assert not any("ld.global" in ln or "st.global" in ln or "atom" in ln for ln in pre)
    assert any("ld.global" in ln for ln in post) and any("st.global" in ln for ln in post)


def test_the_router_selects_by_lanes_without_a_barrier(out):
    """``route.SELECT_LANES``: after the arrival the K steps are warp shuffles (5 butterflies of the 64-bit key
    and one to fetch the winner's score, each), with at most one barrier (the arrival's broadcast), where the
    selection by block reductions has one or two a step."""
    for name, most, least in (("route_lanes_pdl", 1, 8 * 6), ("route_pdl", 99, 0)):
        lines = out[name].splitlines()
        atom = next(i for i, ln in enumerate(lines) if "atom.global.gpu.acq_rel.add" in ln)
        bars = sum("bar.sync" in ln for ln in lines[atom:])
        shfl = sum(ln.count("shfl.sync") for ln in lines[atom:])
        assert bars <= most and shfl >= least, (name, bars, shfl)
    assert sum("bar.sync" in ln for ln in out["route_pdl"].splitlines()) > 8


def test_the_decode_kernels_stamp_only_when_asked(out):
    """Built with STAMPS: two globaltimer readings (start, end), a clock reading at each phase end, the first
    before the PDL wait; as shipped (STAMPS off): neither timer read."""
    for name, clocks in (("decode_stamps_pdl", 9), ("moe_down_stamps_pdl", 5), ("route_stamps_pdl", 6),
                         ("matvec_stamps_pdl", 3)):
        text = out[name]
        assert text.count("%globaltimer") == 2, name
        assert text.count("%clock64") >= clocks, name
        lines = text.splitlines()
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        assert next(i for i, ln in enumerate(lines) if "%clock64" in ln) < wait, name
    for name in ("decode", "decode_pdl", "decode_one_block", "moe_down_norm_pdl", "route_pdl", "matvec", "matvec_pdl",
                 "heads_pdl"):
        assert "%clock64" not in out[name] and "%globaltimer" not in out[name], name
