"""The chunk_kda candidate of bench/candidates (chunk_v6: the shipped forward with a cheaper diagonal step) against
the token-by-token twin, under TRITON_INTERPRET=1 at small shapes.

A candidate may replace kernels/kda/chunk.py only if these pass and the device run shows it correct and faster.
Tolerance: relative RMS error 1e-4, as tests/kernels/test_kda_triton.py (float32 inputs; the interpreter computes
dots in float32)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kda_sessions.kernels.kda.naive import naive_recurrent_kda

from .kernel_helpers import gate_case, kda_inputs, packed_or_batched, rel_rms

CANDIDATES = Path(__file__).resolve().parents[2] / "bench" / "candidates"
TOL = 1e-4
K, V = 32, 32
# the midpoint kernel's products above the diagonal may overflow to inf (masked after the dot)
ABOVE_DIAG_INF = pytest.mark.filterwarnings("ignore:overflow encountered in matmul")
SMALL_BLOCKS = {"prep_bk": 16, "offdiag_bk": 16, "wu_bk": 16, "wu_bv": 16, "state_bv": 16, "out_bv": 16}


def load_candidate(stem: str, package: str = "kda_sessions.kernels.kda") -> ModuleType:
    """bench/candidates/<stem>.py as a module of ``package``, so that its relative imports resolve."""
    name = f"{package}._candidate_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CANDIDATES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _mixed_steep(g: torch.Tensor) -> torch.Tensor:
    """Log-decays 30x steeper in the first 37 tokens only: sub-chunks both above and below the midpoint path's span
    limit in one call."""
    g = g.clone()
    g[:, :37] *= 30
    return g


V6_CASES = [  # (decay, H, varlen, h0, checkpoints, l2norm, launch parameters)
    pytest.param("standard", 2, True, True, [[5, 37], [1, 63]], True, None, id="standard-varlen-h0-ckpt"),
    pytest.param("bounded", 2, True, False, [[37], [64]], True, SMALL_BLOCKS, id="bounded-varlen-small-blocks"),
    pytest.param("standard", 2, False, True, None, False, {"tok_bh": 1, "tok_warps": 1},
                 id="standard-batch2-no-norm-1-head-per-program"),
    pytest.param("steep", 2, True, True, [[20], [2, 50]], True, None, id="steep-varlen-ckpt"),
    pytest.param("standard", 3, True, True, [[5, 37], [1, 63]], True, {"tok_bh": 4},
                 id="standard-3-heads-masked-head"),
    pytest.param("standard", 2, True, True, [[5, 37], [1, 63]], True, {"diag_span_check": 1},
                 id="standard-span-check", marks=ABOVE_DIAG_INF),
    pytest.param("mixed", 2, True, True, [[20], [2, 50]], True, {"diag_span_check": 1, "diag_ieee": 1},
                 id="mixed-steep-span-check-ieee", marks=ABOVE_DIAG_INF),
    pytest.param("steep", 2, True, True, [[20], [2, 50]], True, {"diag_form": 0}, id="steep-shipped-diag"),
]


@pytest.mark.parametrize("decay,H,varlen,h0,ckpts,norm,tune", V6_CASES)
def test_chunk_v6_matches_recurrent(decay, H, varlen, h0, ckpts, norm, tune):
    """``steep``: log-decays 30x the standard gate's (16-token spans far past e^160), where factoring the diagonal
    blocks through one point would overflow: the exact kernels must hold there, and the span check must route
    those sub-chunks to its exact walk."""
    v6 = load_candidate("chunk_v6")
    q, k, v, g, beta, cu = packed_or_batched(varlen, H, K, V, decay == "bounded")
    if decay == "steep":
        g = g * 30
    elif decay == "mixed":
        g = _mixed_steep(g)
    if not norm:  # unnormalised keys make the delta rule diverge; scale them down instead
        q, k = q * 0.25, k * 0.25
    init = torch.randn(2, H, K, V) if h0 else None
    o, final, ck = v6.chunk_kda_triton(q, k, v, g, beta, None, init, True, cu, norm, ckpts, tune=tune)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu, norm, ckpts)
    assert torch.isfinite(o).all()
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL
    if ckpts is not None:
        assert rel_rms(ck, rck) < TOL


@pytest.mark.parametrize(
    "lower_bound,tune",
    [
        pytest.param(None, None, id="standard"),
        pytest.param(-5.0, None, id="bounded-midpoint"),
        pytest.param(-5.0, {"diag_mid": 0}, id="bounded-exact"),
        pytest.param(-20.0, None, id="bounded-lb20-too-wide-for-midpoint"),
    ],
)
def test_chunk_v6_gate_in_kernel(lower_bound, tune):
    """Raw gate logits in (two packed sequences, 30 and 45 tokens, checkpoints): the bounded gate with lb -5 takes
    the midpoint kernel without a span check; with lb -20 a sub-chunk may span 15 * 20 / ln 2 > SPAN_MAX, so the
    launcher must keep it on the exact kernel."""
    from kda_sessions.kernels.gate.naive import naive_kda_gate

    v6 = load_candidate("chunk_v6")
    H = 2
    q, k, v, beta, raw, A_log, dt_bias, cu, ckpts = gate_case(H, K, V)
    init = torch.randn(2, H, K, V)
    g = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
    o, final, ck = v6.chunk_kda_triton(q, k, v, raw, beta, 0.3, init, True, cu, True, ckpts, use_gate_in_kernel=True,
                                       A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, tune=tune)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, 0.3, init, True, cu, True, ckpts)
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL and rel_rms(ck, rck) < TOL


def test_chunk_v6_rejects_unknown_launch_parameter():
    v6 = load_candidate("chunk_v6")
    q, k, v, g, beta = kda_inputs(1, 16, 2, K, V, False)
    with pytest.raises(ValueError, match="diag_bh"):
        v6.chunk_kda_triton(q, k, v, g, beta, tune={"diag_bh": 2})
