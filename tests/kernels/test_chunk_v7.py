"""The chunk_kda candidate bench/candidates/chunk_v7.py (the shipped forward with its prep and diagonal steps fused
into one kernel) against the token-by-token twin and against the shipped kernels' buffers, under TRITON_INTERPRET=1
at small shapes.

Tolerance: relative RMS error 1e-4 against the twin, as tests/kernels/test_kda_triton.py (float32 inputs; the
interpreter computes dots in float32); 5e-5 between the candidate's buffers and the shipped ones: G is summed in
another order (16-row sums plus the previous sub-chunk's last row, against one 64-row scan), and with the fused
standard gate it reaches -2400 (log2 units), where float32 rounds it by ~2e-4, which exp2 turns into ~1e-5
relative in kg and the diagonal blocks. There the candidate's blocks are the nearer to float64 (1.0e-6 against
3.8e-6): it takes G_r - G_s from sums local to the sub-chunk rather than from two large prefixes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kda_sessions.kernels.kda.naive import naive_recurrent_kda

from .kernel_helpers import gate_case, kda_inputs, packed_or_batched, rel_rms

CANDIDATE = Path(__file__).resolve().parents[2] / "bench" / "candidates" / "chunk_v7.py"
TOL = 1e-4
K, V = 32, 32
# the midpoint form's products above the diagonal may overflow to inf or NaN (masked after the dot)
ABOVE_DIAG_INF = pytest.mark.filterwarnings("ignore:overflow encountered in matmul",
                                            "ignore:invalid value encountered in matmul")
SPLIT = {"fused_split": 1}
MID = {"fused_mid": 1}
BK16 = {"fused_bkp": 16, "prep_bk": 16}  # two K blocks in both passes (the G prefix per block)


def load_v7() -> ModuleType:
    """chunk_v7.py as a module of ``kda_sessions.kernels.kda`` (as bench/kernels.py ``--old`` loads it), so that its
    relative imports resolve."""
    name = "kda_sessions.kernels.kda._candidate_chunk_v7"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CANDIDATE)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _mixed_steep(g: torch.Tensor) -> torch.Tensor:
    """Log-decays 30x steeper in the first 37 tokens only: tiles both within and past SPAN_MAX in one call."""
    g = g.clone()
    g[:, :37] *= 30
    return g


def _tile_spans(v7: ModuleType, g: torch.Tensor, cu: torch.Tensor, ckpts, bkp: int) -> torch.Tensor:
    """The widest channel span of G (log2 units) of every (sub-chunk, head, K block) tile of the midpoint form."""
    starts, lens, _, _ = v7.shipped._chunk_table(cu.tolist(), ckpts)
    x = g.reshape(-1, *g.shape[2:]) / v7.shipped.LN2  # packed [T, H, K]
    spans = []
    for s, n in zip(starts, lens):
        for r0 in range(0, n, v7.BC):
            G = x[s + r0 : s + min(r0 + v7.BC, n)].cumsum(0)
            spans.append((G.amax(0) - G.amin(0)).unflatten(-1, (-1, bkp)).amax(-1).flatten())
    return torch.cat(spans)


CASES = [  # (decay, H, varlen, h0, checkpoints, l2norm, launch parameters)
    pytest.param("standard", 2, True, True, [[5, 37], [1, 63]], True, None, id="standard-varlen-h0-ckpt"),
    pytest.param("standard", 2, True, True, [[5, 37], [1, 63]], True, {**SPLIT, **BK16}, id="standard-split-bk16"),
    pytest.param("bounded", 2, True, False, [[37], [64]], True, BK16, id="bounded-varlen-bk16"),
    pytest.param("standard", 2, False, True, None, False, SPLIT, id="standard-batch2-no-norm-split"),
    pytest.param("steep", 2, True, True, [[20], [2, 50]], True, None, id="steep-varlen-ckpt"),
    pytest.param("steep", 2, True, True, [[20], [2, 50]], True, {**SPLIT, "fused_warps": 2}, id="steep-split"),
    pytest.param("mixed", 2, True, True, [[20], [2, 50]], True, {**MID, **BK16, "diag_ieee": 1},
                 id="mixed-steep-midpoint-checked-ieee", marks=ABOVE_DIAG_INF),
    pytest.param("standard", 3, True, True, [[5, 37], [1, 63]], True, None, id="standard-3-heads"),
]


@pytest.mark.parametrize("decay,H,varlen,h0,ckpts,norm,tune", CASES)
def test_chunk_v7_matches_recurrent(decay, H, varlen, h0, ckpts, norm, tune):
    """``steep``: log-decays 30x the standard gate's, a 16-token span far past float32's exponent range: the exact
    forms must hold there. ``mixed``: the midpoint form's span check must send the steep tiles to the exact form
    (the test asserts that the input has tiles on both sides of SPAN_MAX)."""
    v7 = load_v7()
    q, k, v, g, beta, cu = packed_or_batched(varlen, H, K, V, decay == "bounded")
    if decay == "steep":
        g = g * 30
    elif decay == "mixed":
        g = _mixed_steep(g)
        spans = _tile_spans(v7, g, cu, ckpts, tune["fused_bkp"])
        assert (spans > v7.shipped.SPAN_MAX).any() and (spans <= v7.shipped.SPAN_MAX).any()
    if not norm:  # unnormalised keys make the delta rule diverge; scale them down instead
        q, k = q * 0.25, k * 0.25
    init = torch.randn(2, H, K, V) if h0 else None
    o, final, ck = v7.chunk_kda_triton(q, k, v, g, beta, None, init, True, cu, norm, ckpts, tune=tune)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu, norm, ckpts)
    assert torch.isfinite(o).all()
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL
    if ckpts is not None:
        assert rel_rms(ck, rck) < TOL


@pytest.mark.parametrize(
    "lower_bound,tune",
    [
        pytest.param(None, None, id="standard"),
        pytest.param(-5.0, MID, id="bounded-midpoint", marks=ABOVE_DIAG_INF),
        pytest.param(-5.0, SPLIT, id="bounded-split"),
    ],
)
def test_chunk_v7_gate_in_kernel(lower_bound, tune):
    """Raw gate logits in (two packed sequences, 30 and 45 tokens, checkpoints)."""
    from kda_sessions.kernels.gate.naive import naive_kda_gate

    v7 = load_v7()
    H = 2
    q, k, v, beta, raw, A_log, dt_bias, cu, ckpts = gate_case(H, K, V)
    init = torch.randn(2, H, K, V)
    g = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
    o, final, ck = v7.chunk_kda_triton(q, k, v, raw, beta, 0.3, init, True, cu, True, ckpts, use_gate_in_kernel=True,
                                       A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, tune=tune)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, 0.3, init, True, cu, True, ckpts)
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL and rel_rms(ck, rck) < TOL


def _prep_buffers(v7: ModuleType, fused: bool, q, k, g, beta, bounds, norm, gate, tune) -> dict[str, torch.Tensor]:
    """The buffers of the prep and diagonal steps (shipped kernels, or v7's fused one), NaN where nothing wrote."""
    chunk = v7.shipped
    T, H, Kd = q.shape
    starts, lens, _, _ = chunk._chunk_table(bounds, None)
    NC = len(starts)
    chunk_start = torch.tensor(starts, dtype=torch.int32)
    chunk_len = torch.tensor(lens, dtype=torch.int32)
    nan = float("nan")
    bufs = {name: torch.full((T, H, Kd), nan) for name in ("qn", "kn", "G2", "qg", "kg")}
    bufs |= {"dl": torch.full((NC, H, Kd), nan), "Aqk": torch.full((T, H, chunk.BT), nan),
             "Ld": torch.full((T, H, chunk.BC), nan)}
    A_log, dt_bias, lb = gate if gate is not None else (None, None, None)
    gate_kind = 0 if gate is None else (1 if lb is None else 2)
    lbf = float(lb) if lb is not None else 0.0
    scale = Kd**-0.5
    cfg = {**v7.DEFAULTS, **(tune or {})}
    b = bufs
    if fused:
        v7._prep_diag_step(cfg, (q, k, g, A_log, dt_bias, b["qn"], b["kn"], b["G2"], b["qg"], b["kg"], b["dl"], beta,
                                 b["Aqk"], b["Ld"], chunk_start, chunk_len, scale, lbf), NC, H, Kd, Kd, norm, gate_kind)
    else:
        chunk._prep_kernel[(NC, H)](
            q, k, g, A_log, dt_bias, b["qn"], b["kn"], b["G2"], b["qg"], b["kg"], b["dl"], chunk_start, chunk_len,
            scale, lbf, H=H, K=Kd, BT=chunk.BT, BK=Kd, NORM=norm, GATE=gate_kind,
        )
        chunk._diag_step(cfg, (b["qn"], b["kn"], b["G2"], beta, b["Aqk"], b["Ld"], chunk_start, chunk_len, scale),
                         NC, H, Kd, Kd, gate)
    # the diagonal blocks' entries s <= r (the only ones read); everything else of A_qk is the off-diagonal step's
    row = torch.cat([torch.arange(s, s + n) - s for s, n in zip(starts, lens)])  # each token's row in its chunk
    col = torch.arange(chunk.BT)
    keep = (col[None, :] <= row[:, None]) & (col[None, :] >= row[:, None] // chunk.BC * chunk.BC)
    b["Aqk"] = torch.where(keep[:, None, :], b["Aqk"], 0.0)
    return bufs


@pytest.mark.parametrize(
    "gate_kind,norm,tune",
    [
        pytest.param(0, True, None, id="precomputed-gate"),
        pytest.param(0, False, SPLIT, id="precomputed-gate-no-norm-split"),
        pytest.param(1, True, {**SPLIT, **BK16}, id="standard-fused-gate-split-bk16"),
        pytest.param(2, True, {**MID, **BK16}, id="bounded-fused-gate-midpoint-bk16", marks=ABOVE_DIAG_INF),
    ],
)
def test_chunk_v7_buffers_match_shipped(gate_kind, norm, tune):
    """Every buffer the fused kernel writes equals the shipped prep kernel's and diagonal step's (packed sequences
    of 37 and 64 tokens; chunks of 37, 64 rows)."""
    from kda_sessions.kernels.gate.naive import gate_params

    v7 = load_v7()
    H = 2
    q, k, _, g, beta = kda_inputs(1, 101, H, K, V, gate_kind == 2, seed=3)
    q, k, g, beta = q[0], k[0], g[0], beta[0]  # packed [T, H, *]
    gate = None
    if gate_kind:  # raw logits in, the kernel computes the log-decay
        gen = torch.Generator().manual_seed(4)
        g = torch.randn(101, H, K, generator=gen) * 3
        A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
        dt_bias = torch.randn(H * K, generator=gen) - 1.0
        gate = gate_params(H, K, A_log, dt_bias, -5.0 if gate_kind == 2 else None)
    bounds = [0, 37, 101]
    ours = _prep_buffers(v7, True, q, k, g, beta, bounds, norm, gate, tune)
    ref = _prep_buffers(v7, False, q, k, g, beta, bounds, norm, gate, tune)
    for name, x in ref.items():
        assert torch.isfinite(x).all() and torch.isfinite(ours[name]).all(), name
        assert rel_rms(ours[name], x) < 5e-5, name


@pytest.mark.parametrize(
    "tune,match",
    [
        pytest.param({"fused_split": 1, "fused_mid": 1}, "exclude each other", id="split-and-midpoint"),
        pytest.param({"fused_bkp": 8}, "fused_bkp", id="bkp-8"),
        pytest.param({"fused_bk": 32}, "fused_bk", id="unknown-key"),
    ],
)
def test_chunk_v7_rejects_bad_launch_parameters(tune, match):
    v7 = load_v7()
    q, k, v, g, beta = kda_inputs(1, 16, 2, K, V, False)
    with pytest.raises(ValueError, match=match):
        v7.chunk_kda_triton(q, k, v, g, beta, tune=tune)
