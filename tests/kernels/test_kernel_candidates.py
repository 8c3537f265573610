"""The unmeasured kernel candidates of bench/candidates (paged_decode_v3, and the tunables of the chunk
kernel promoted from there, chunk_v5) against the naive twins, under TRITON_INTERPRET=1.

A candidate may replace its kernel in kernels/ only if these pass and the device run shows it correct and faster.
Tolerances: relative RMS error 1e-4 for chunk_kda (as tests/kernels/test_kda_triton.py), 1e-5 for MLA decode with
float32 partials, 1e-2 with bf16 partials (float32 inputs; the interpreter computes dots in float32)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kda_sessions.kernels.kda.naive import naive_recurrent_kda
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

from .kernel_helpers import kda_inputs, rel_rms

CANDIDATES = Path(__file__).resolve().parents[2] / "bench" / "candidates"
H, K, V = 2, 32, 32


def load_candidate(stem: str, package: str) -> ModuleType:
    """bench/candidates/<stem>.py as a module of ``package``, so that its relative imports resolve."""
    name = f"{package}._candidate_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CANDIDATES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


CHUNK_CASES = [  # (gate, varlen, h0, checkpoints, l2norm, launch parameters)
    pytest.param("standard", True, True, [[5, 37], [1, 63]], True, None, id="standard-varlen-h0-ckpt"),
    pytest.param("bounded", True, False, [[37], [64]], True,
                 {"prep_bk": 16, "offdiag_bk": 16, "wu_bk": 16, "wu_bv": 16, "state_bv": 16, "out_bv": 16},
                 id="bounded-varlen-small-blocks"),
    pytest.param("standard", False, True, None, False, {"inv_ieee": 1, "offdiag_warps": 4, "prep_bk": 32},
                 id="standard-batch2-no-norm-ieee-inverse"),
    pytest.param("steep", True, True, [[20], [2, 50]], True, None, id="steep-decay-varlen-ckpt"),
]


@pytest.mark.parametrize("gate,varlen,h0,ckpts,norm,tune", CHUNK_CASES)
def test_shipped_chunk_tunables_match_recurrent(gate, varlen, h0, ckpts, norm, tune):
    """The shipped chunk kernel (candidate v5, promoted: prep, exact diagonal, off-diagonal + inverse, w/u
    kernels) with its launch parameters. ``steep``: log-decays 30x the standard gate's, far past the previous
    kernel's tensor-core limit for diagonal blocks (e^160), where the off-diagonal factors underflow: the
    diagonal blocks are exact here for any span."""
    from kda_sessions.kernels.kda import chunk
    if varlen:
        q, k, v, g, beta = kda_inputs(1, 101, H, K, V, gate == "bounded", seed=1)
        cu = torch.tensor([0, 37, 101])
    else:
        q, k, v, g, beta = kda_inputs(2, 70, H, K, V, gate == "bounded", seed=2)
        cu = None
    if gate == "steep":
        g = g * 30
    init = torch.randn(2, H, K, V) if h0 else None
    o, final, ck = chunk.chunk_kda_triton(q, k, v, g, beta, None, init, True, cu, norm, ckpts, tune=tune)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu, norm, ckpts)
    assert torch.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-4 and rel_rms(final, rfinal) < 1e-4
    if ckpts is not None:
        assert rel_rms(ck, rck) < 1e-4


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["standard", "bounded"])
def test_shipped_chunk_gate_in_kernel(lower_bound):
    from kda_sessions.kernels.gate.naive import naive_kda_gate
    from kda_sessions.kernels.kda import chunk
    q, k, v, _, beta = kda_inputs(1, 75, H, K, V, False, seed=9)
    gen = torch.Generator().manual_seed(10)
    raw = torch.randn(1, 75, H, K, generator=gen) * 3
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) - 1.0
    cu = torch.tensor([0, 30, 75])
    ckpts = [[7, 30], [45]]
    init = torch.randn(2, H, K, V)
    g = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
    o, final, ck = chunk.chunk_kda_triton(q, k, v, raw, beta, 0.3, init, True, cu, True, ckpts,
                                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                       lower_bound=lower_bound)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, 0.3, init, True, cu, True, ckpts)
    assert rel_rms(o, ro) < 1e-4 and rel_rms(final, rfinal) < 1e-4 and rel_rms(ck, rck) < 1e-4


def test_shipped_chunk_rejects_unknown_launch_parameter():
    from kda_sessions.kernels.kda import chunk
    q, k, v, g, beta = kda_inputs(1, 16, H, K, V, False)
    with pytest.raises(ValueError, match="intra_bk"):
        chunk.chunk_kda_triton(q, k, v, g, beta, tune={"intra_bk": 16})


def _mla_case(P: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    N, Hm, R, DR = 3, 4, 32, 16
    lens = [1, 37, 80]
    max_pages = -(-max(lens) // P)
    kv = torch.randn(N * max_pages + 2, P, R + DR, generator=gen)
    pt = torch.randperm(N * max_pages + 2, generator=gen)[: N * max_pages].view(N, max_pages).int()
    sl = torch.tensor(lens)
    ql, qp = torch.randn(N, Hm, R, generator=gen), torch.randn(N, Hm, DR, generator=gen)
    return ql, qp, kv, pt, sl, 0.1


V3_CASES = [  # pointer kernel: (P, num_splits, launch parameters): page-aligned tiles, gathered tiles, empty splits,
    # bf16 partials (the TMA kernel has its own test below)
    (32, None, {"BN": 16}),
    (32, 3, {"BN": 16, "trans": False}),
    (8, 1, {"BN": 16}),
    (16, 7, {"BN": 16, "page_tile": False}),
    (16, 5, {"BN": 16, "trans": False, "page_tile": True}),
    (32, 4, {"BN": 32, "part_bf16": True}),
    (4, 2, {"BN": 16, "trans": False, "part_bf16": True}),
]


@pytest.mark.parametrize("P,num_splits,cfg", V3_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_mla_decode_v3(P, num_splits, cfg):
    v3 = load_candidate("paged_decode_v3", "kda_sessions.kernels.mla")
    args = _mla_case(P)
    o = v3._launch(*args, num_splits, tma=False, **cfg)
    tol = 1e-2 if cfg.get("part_bf16") else 1e-5
    assert rel_rms(o, naive_mla_decode_paged(*args)) < tol


def test_mla_decode_v3_public_entry():
    v3 = load_candidate("paged_decode_v3", "kda_sessions.kernels.mla")
    args = _mla_case(16, seed=5)
    assert rel_rms(v3.mla_decode_paged_triton(*args), naive_mla_decode_paged(*args)) < 1e-5


@pytest.mark.parametrize("P,num_splits,BN", [(16, None, 16), (32, 3, 16), (16, 7, 16), (32, 1, 32)],
                         ids=lambda x: str(x))
def test_mla_decode_v3_tma(P, num_splits, BN):
    """Whole tiles through tensor descriptors, the partial last tile of a split through masked loads; the cache
    rows past every sequence's end hold NaN, which must not reach the output."""
    v3 = load_candidate("paged_decode_v3", "kda_sessions.kernels.mla")
    ql, qp, kv, pt, sl, scale = _mla_case(P)
    ref = naive_mla_decode_paged(ql, qp, kv, pt, sl, scale)
    for n, length in enumerate(sl.tolist()):  # poison the unused rows of every sequence's last page
        last = int(pt[n, (length - 1) // P])
        kv[last, (length - 1) % P + 1 :] = float("nan")
    o = v3._launch(ql, qp, kv, pt, sl, scale, num_splits, BN=BN, tma=True, part_bf16=BN == 32)
    assert rel_rms(o, ref) < (1e-2 if BN == 32 else 1e-5)


def _mla_guarded_case(P: int = 64, seed: int = 7):
    """A P 64 decode step whose page table and cache make a stray read show up as NaN in the output.

    Lengths 1, P - 1, P, P + 1, 2P - 1, 2P + 1, multiples of the split length (96, 128, 192 for 3 splits at BN 16 /
    64) and splits with a partial last tile; the last sequence fills its page-table row, so a read past its pages
    is a read past the whole table. Every page-table entry past a sequence's pages, and the 64 entries after the
    table, name a poison page of NaN; the rows past each sequence's end in its last page hold NaN too."""
    gen = torch.Generator().manual_seed(seed)
    Hm, R, DR = 2, 32, 16
    lens = [1, 63, 64, 65, 96, 127, 128, 129, 192, 200, 256]
    N, max_pages = len(lens), -(-max(lens) // P)
    used = sum(-(-n // P) for n in lens)
    kv = torch.randn(used + 2, P, R + DR, generator=gen)
    poison = used + 1
    kv[poison] = float("nan")
    flat = torch.full((N * max_pages + 64,), poison, dtype=torch.int32)  # the table, then poison past its end
    pt = flat[: N * max_pages].view(N, max_pages)
    perm, u = torch.randperm(used + 1, generator=gen).int(), 0
    for n, length in enumerate(lens):
        k = -(-length // P)
        pt[n, :k] = perm[u : u + k]
        u += k
        kv[int(pt[n, k - 1]), (length - 1) % P + 1 :] = float("nan")
    ql, qp = torch.randn(N, Hm, R, generator=gen), torch.randn(N, Hm, DR, generator=gen)
    return ql, qp, kv, pt, torch.tensor(lens, dtype=torch.int32), 0.1


# P 64, where both candidates crashed on the H200 (bench/candidates/README.md): (module, num_splits, launch params)
P64_CASES = [
    ("paged_decode_v3", None, {"tma": True}),
    ("paged_decode_v3", 3, {"tma": True, "BN": 32}),
    ("paged_decode_v3", 3, {"tma": False, "BN": 16}),
    ("paged_decode_v3", None, {"tma": False, "trans": False, "BN": 64}),
    ("paged_decode_v3", 3, {"tma": False, "page_tile": False, "BN": 16}),
    ("paged_decode_v3", 1, {"tma": False, "BN": 64, "part_bf16": True}),
]


@pytest.mark.parametrize("stem,num_splits,cfg", P64_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_mla_decode_candidates_p64_guarded(stem, num_splits, cfg):
    mod = load_candidate(stem, "kda_sessions.kernels.mla")
    args = _mla_guarded_case()
    o = mod._launch(*args, num_splits, **cfg)
    assert torch.isfinite(o).all(), "a read outside the sequences' rows reached the output"
    assert rel_rms(o, naive_mla_decode_paged(*args)) < (1e-2 if cfg.get("part_bf16") else 1e-5)
