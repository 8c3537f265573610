"""The Gluon split kernel of MLA paged decode (kernels/mla/paged_decode_gluon.py).

Gluon kernels do not run under TRITON_INTERPRET=1, so without a GPU this file compiles the kernel for sm_90 with the
installed Triton (its bundled ptxas; no GPU needed) and checks what the compiler made of it, and checks that CPU
calls never reach it. On an sm_90 GPU (``-m gpu``) the kernel is compared with the twin: relative RMS error 1e-2
for bf16 inputs, partials and output, and with the Triton kernel, which it matches bit for bit on the H200."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kda_sessions.kernels.mla import paged_decode
from kda_sessions.kernels.mla import paged_decode_gluon as pg
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

from .kernel_helpers import compile_gluon_sm90, rel_rms

needs_gluon = pytest.mark.skipif(pg.gluon is None, reason="this Triton has no Gluon")
SMEM_SM90 = 227 * 1024  # the most shared memory one block may use on sm_90


# the split kernel's arguments for ``compile_gluon_sm90`` (argv: BH, PDL 0 or 1)
_COMPILE = """
from kda_sessions.kernels.mla import paged_decode_gluon as pg

rows = torch.zeros(256, 576, dtype=torch.bfloat16)  # only the descriptors' types are read, never their memory
boxes = rows.as_strided((8, 256, 64), (64, 576, 1))
desc = pg.TensorDescriptor(boxes, list(boxes.shape), list(boxes.stride()), [8, 64, 64],
                           pg.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
pe_desc = pg.TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [64, 64],
                              pg.gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
fn = pg._split_kernel_gluon
types = {"q_lat": "*bf16", "q_pe": "*bf16", "kv_desc": mangle_type(desc), "pe_desc": mangle_type(pe_desc),
         "page_table": "*i32", "seq_lens": "*i32",
         "o_part": "*bf16", "lse_part": "*fp32", "sm_scale": "fp32", "max_pages": "i32", "tokens_per_split": "i32",
         "NSPLIT": "i32"}
const = {"H": 32, "R": 512, "DR": 64, "P": 64, "BH": int(sys.argv[1]), "BN": 64, "PDL": sys.argv[2] == "1",
         "WG": 2 if int(sys.argv[1]) >= 64 else 1}
"""


def _compile_sm90(BH: int, pdl: bool) -> dict:
    return compile_gluon_sm90(_COMPILE, str(BH), str(int(pdl)), num_warps=8 if BH >= 64 else 4)


# the queries-on-M kernel's arguments (argv: PDL, PIPE 0 or 1)
_COMPILE_QM = _COMPILE.split("fn = pg.")[0] + """
fn = pg._split_kernel_gluon_qm
types = {"q_lat": "*bf16", "q_pe": "*bf16", "kv_desc": mangle_type(desc), "pe_desc": mangle_type(pe_desc),
         "page_table": "*i32", "seq_lens": "*i32",
         "o_part": "*bf16", "lse_part": "*fp32", "sm_scale": "fp32", "max_pages": "i32", "tokens_per_split": "i32",
         "NSPLIT": "i32"}
const = {"H": 4096, "R": 512, "DR": 64, "P": 64, "BN": 64, "PDL": sys.argv[1] == "1", "PIPE": sys.argv[2] == "1"}
"""


@needs_gluon
@pytest.mark.parametrize("pipe", [False, True], ids=["serial", "pipelined"])
def test_gluon_queries_on_m_kernel_compiles_for_sm90(pipe: bool):
    """Blocks of 64 query rows with the queries on wgmma's M: it compiles with this Triton and fits in shared
    memory, with no spills; the scores run on m64n32k16 (each warpgroup half a tile's rows) and P V on m64n256k16
    (each warpgroup half of r); pipelined, the next tile's scores (issued once before the loop and once in it) are
    waited for while this tile's P V is still in flight (wait_group 1). Every copy is predicated (none past what
    the loop waits for)."""
    k = compile_gluon_sm90(_COMPILE_QM, "1", str(int(pipe)), num_warps=8)
    assert k["shared"] <= SMEM_SM90
    ptx = k["ptx"]
    lines = ptx.splitlines()
    assert ".local" not in ptx and ".reqntid 256" in ptx
    scores = sum("m64n32k16" in ln and "wgmma.mma_async" in ln for ln in lines)
    assert sum("m64n256k16" in ln for ln in lines) == 4 and scores == 36 * (2 if pipe else 1)
    assert any("wgmma.wait_group.sync.aligned 1" in ln for ln in lines) == pipe
    copies = [ln for ln in lines if "cp.async.bulk.tensor" in ln]
    assert len(copies) == 6 and all(ln.strip().startswith("@%p") for ln in copies)
    assert sum("st.global.v4" in ln for ln in lines) >= 1


@needs_gluon
@pytest.mark.slow  # ~70 s on a CPU machine (the first sm90 compile in a process builds Triton's toolchain state)
@pytest.mark.parametrize("BH,pdl", [(16, False), (32, True), (64, True)], ids=["bh16", "bh32-pdl", "bh64-pdl"])
def test_gluon_split_kernel_compiles_for_sm90(BH, pdl):
    """It compiles with this Triton (Gluon's API moves between releases), fits in shared memory, and its tile loop
    keeps a tile's TMA copy in flight while it runs another tile's products on wgmma. As a
    programmatic dependent launch it reads nothing from global memory before griddepcontrol.wait."""
    k = _compile_sm90(BH, pdl)
    assert k["shared"] <= SMEM_SM90
    ptx = k["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d" in ptx
    lines = ptx.splitlines()
    copies = [i for i, ln in enumerate(lines) if "cp.async.bulk.tensor" in ln]
    waits = [i for i, ln in enumerate(lines) if "mbarrier.try_wait" in ln]
    mmas = [i for i, ln in enumerate(lines) if "wgmma.mma_async" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global" in ln]
    dep_waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    # q's nine boxes are loaded before any copy goes out (behind a tile's copy they wait 4 us), then two tiles are
    # copied before the loop's first wait, and the loop refills a stage after that stage's products
    assert len(copies) == 6 and sum("cp.async.bulk.tensor.3d" in lines[i] for i in copies) == 3
    assert sum(i < min(copies) for i in loads) >= 9
    assert waits and sorted(copies)[3] < min(waits) < min(mmas) and max(mmas) < max(copies)
    # each warpgroup runs the products of 32 heads at most (64: two warpgroups, not 64 heads' accumulators on one)
    assert f"m64n{min(BH, 32)}k16" in ptx and f".reqntid {256 if BH >= 64 else 128}" in ptx
    # the partials leave in 16-byte stores
    assert sum("st.global.v4" in ln for ln in lines) >= 8
    reads = [i for i, ln in enumerate(lines) if "ld.global" in ln or "cp.async.bulk.tensor" in ln]
    if pdl:
        assert len(dep_waits) == 1 and dep_waits[0] < min(reads)
    else:
        assert not dep_waits and "griddepcontrol" not in ptx


_COMPILE_MERGE = """
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda_sessions.kernels.mla.paged_decode import _combine_kernel_lse as fn

types = {"o_part": "*bf16", "lse_part": "*fp32", "out": "*bf16", "NSPLIT": "i32", "lse_out": "*fp32"}
const = {"H": 32, "R": 512, "BR": 64, "BS": 128, "PDL": True, "EARLY_TRIGGER": EARLY, "LSE_OUT": False}
params = list(inspect.signature(fn.fn).parameters)
sig = {p: "constexpr" if p in const else types[p] for p in params}
src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in const.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p][0] == "*"})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"ptx": k.asm["ptx"]}))
"""


@pytest.mark.skipif(paged_decode.gdc_wait is None, reason="this Triton has no griddepcontrol")
@pytest.mark.parametrize("early", [False, True], ids=["trigger-after", "trigger-before"])
def test_merge_kernel_as_a_dependent_launch_waits_before_it_reads(early: bool):
    """Launched as a programmatic dependent launch behind the split kernel, the merge must not read a partial before
    griddepcontrol.wait: in its sm_90 PTX the wait comes before every global load; it lets the next launch start
    after its wait, or before it with ``COMBINE_EARLY_TRIGGER`` (``early``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", f"EARLY = {early}\n" + _COMPILE_MERGE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = json.loads(res.stdout.strip().splitlines()[-1])["ptx"].splitlines()
    waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    triggers = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global" in ln]
    assert len(waits) == 1 and loads and waits[0] < min(loads)
    assert len(triggers) == 1 and (triggers[0] < waits[0]) == early


def test_gluon_never_serves_cpu_tensors():
    from kda_sessions.kernels.mla.paged_decode import _launch

    q = torch.zeros(1, 32, 512, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not pg.gluon_split_ok(q, kv, 512, 64, 64, 64, 32)
    with pytest.raises(ValueError, match="use_gluon=True needs"):
        _launch(q, torch.zeros(1, 32, 64, dtype=torch.bfloat16), kv, torch.zeros(1, 2, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32), 0.1, use_gluon=True)
    with pytest.raises(ValueError, match="pdl=True needs the Gluon split kernel"):
        _launch(q, torch.zeros(1, 32, 64, dtype=torch.bfloat16), kv, torch.zeros(1, 2, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32), 0.1, pdl=True)


def _case(lens: list[int], H: int, P: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [math.ceil(L / P) for L in lens]
    total = sum(pages) + 3
    kv = torch.randn(total, P, 576, device="cuda", generator=g).bfloat16()
    perm = torch.randperm(total, device="cuda", generator=g).int()
    pt = torch.zeros(len(lens), max(pages), device="cuda", dtype=torch.int32)
    used = 0
    for n, k in enumerate(pages):  # each sequence's pages scattered over the pool
        pt[n, :k] = perm[used:used + k]
        used += k
    ql = torch.randn(len(lens), H, 512, device="cuda", generator=g).bfloat16()
    qp = torch.randn(len(lens), H, 64, device="cuda", generator=g).bfloat16()
    return ql, qp, kv, pt, torch.tensor(lens, device="cuda", dtype=torch.int32), (128 + 64) ** -0.5


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [  # (lens, H, P, num_splits)
    pytest.param([33000, 1000, 5, 1], 32, 64, None, id="h32-mixed"),
    pytest.param([64, 65, 127, 4097], 16, 64, None, id="h16-tile-edges"),
    pytest.param([1], 64, 64, None, id="h64-one-token"),
    pytest.param([300, 77], 20, 128, None, id="h20-p128-partial-head-block"),
    pytest.param([2000, 3], 32, 64, 40, id="h32-empty-splits"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or pg.gluon is None, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("variant", ["queries-on-n", "queries-on-m", "queries-on-m-pipelined"])
@pytest.mark.parametrize("lens,H,splits", [([33000, 700, 1], 128, None), ([4097, 64], 96, None),
                                           ([2000, 3, 65, 129], 64, 40)],
                         ids=["h128", "h96-partial-block", "h64-empty-splits"])
def test_gluon_split_kernel_blocks_of_64(lens, H, splits, variant, monkeypatch):
    """Head blocks of 64 (the absorbed prefill's query rows: tokens x heads) on two warpgroups, the queries on N
    (32 heads a warpgroup) or on M (``QUERIES_ON_M``, serial or ``PIPELINED``): the same result as blocks of 32 on
    one, and as the twin; a block half past the last head, splits past a sequence's end and a split of one tile
    included."""
    from kda_sessions.kernels.mla.paged_decode import _launch

    monkeypatch.setattr(pg, "TWO_WARPGROUPS", True)
    monkeypatch.setattr(pg, "QUERIES_ON_M", variant != "queries-on-n")
    monkeypatch.setattr(pg, "PIPELINED", variant.endswith("pipelined"))
    assert pg.warpgroups(64) == 2 and pg.warpgroups(32) == 1
    ql, qp, kv, pt, sl, scale = _case(lens, H, 64, seed=3)
    ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, scale)
    out = _launch(ql, qp, kv, pt, sl, scale, BH=64, num_splits=splits, use_gluon=True)
    one = _launch(ql, qp, kv, pt, sl, scale, BH=32, num_splits=splits, use_gluon=True)
    assert torch.isfinite(out).all()
    assert rel_rms(out, ref) < 1e-2
    assert rel_rms(out.float(), one.float()) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or pg.gluon is None, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("lens,H,P,splits", GPU_CASES)
def test_gluon_split_kernel_against_twin_and_triton(lens, H, P, splits):
    from kda_sessions.kernels.mla.paged_decode import _launch

    ql, qp, kv, pt, sl, scale = _case(lens, H, P)
    ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, scale)
    out = _launch(ql, qp, kv, pt, sl, scale, num_splits=splits, use_gluon=True)  # raises if it cannot serve
    tri = _launch(ql, qp, kv, pt, sl, scale, num_splits=splits, use_gluon=False)
    assert torch.isfinite(out).all()
    assert rel_rms(out, ref) < 1e-2
    assert rel_rms(out.float(), tri.float()) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or pg.gluon is None, reason="needs an sm_90 GPU and Gluon")
def test_gluon_split_kernel_in_a_cuda_graph():
    """Captured once, replayed on a new q and a shorter context: the TMA descriptor is captured by value and stays
    right because the cache pool does not move."""
    from kda_sessions.kernels.mla.paged_decode import _launch

    ql, qp, kv, pt, sl, scale = _case([5000, 700], 32, 64, seed=1)
    _launch(ql, qp, kv, pt, sl, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _launch(ql, qp, kv, pt, sl, scale)
    ql.copy_(torch.randn(ql.shape, device="cuda").bfloat16())
    sl[1] = 123
    graph.replay()
    torch.cuda.synchronize()
    ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, scale)
    assert rel_rms(out, ref) < 1e-2



@pytest.mark.gpu
@pytest.mark.skipif(not _sm90() or pg.gluon is None, reason="needs an sm_90 GPU and Gluon")
def test_gluon_pdl_sees_the_writes_of_the_kernels_before_it():
    """As programmatic dependent launches the split kernel and the merge start before the kernel ahead of them ends;
    they must still read q and the cache as that kernel left them: a pass over the whole pool flips its sign and q
    moves right before each call, eagerly and in a graph."""
    from kda_sessions.kernels.mla.paged_decode import _launch

    ql, qp, kv, pt, sl, scale = _case([40000, 5], 32, 64, seed=2)
    _launch(ql, qp, kv, pt, sl, scale, pdl=True)  # compile
    for _ in range(3):
        kv.mul_(-1.0)
        ql.add_(0.5)
        out = _launch(ql, qp, kv, pt, sl, scale, pdl=True)
        ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, scale)
        assert rel_rms(out, ref) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv.mul_(-1.0)
        ql.add_(0.5)
        out = _launch(ql, qp, kv, pt, sl, scale, pdl=True)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, scale)
        assert rel_rms(out, ref) < 1e-2
