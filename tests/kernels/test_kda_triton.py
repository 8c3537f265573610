"""Triton KDA kernels against the token-by-token twin, under TRITON_INTERPRET=1 at small shapes.

Tolerance: relative RMS error 1e-4 (float32 inputs; the interpreter computes dots in float32)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.kda.naive import naive_recurrent_kda

from .kernel_helpers import gate_case, kda_inputs, packed_or_batched, rel_rms

TOL = 1e-4
H, K, V = 2, 32, 32
# several K and V blocks in every launch
SMALL_BLOCKS = {"prep_bk": 16, "offdiag_bk": 16, "wu_bk": 16, "wu_bv": 16, "state_bv": 16, "out_bv": 16}
IEEE_4WARPS = {"inv_ieee": 1, "offdiag_warps": 4, "tok_warps": 2}  # the inverse's IEEE dots, other warps


def _tuning(overrides: dict | None):
    """The chunk kernel's launch parameters with ``overrides`` (None: the defaults)."""
    from kda_sessions.kernels.kda.chunk import ChunkTuning

    return ChunkTuning(**overrides) if overrides is not None else None


@pytest.mark.parametrize(
    "bounded,varlen,h0,l2norm,ckpts,tune",
    [
        pytest.param(True, False, True, False, None, None, id="bounded-batch2-h0-no-l2norm"),
        pytest.param(False, True, True, True, [[20], [2, 50]], IEEE_4WARPS, id="standard-varlen-ieee-inverse",
                     marks=pytest.mark.slow),
    ],
)
def test_chunk_kda_matches_recurrent(bounded, varlen, h0, l2norm, ckpts, tune):
    """Batches without cu_seqlens and keys left unnormalised; the varlen, checkpoint and tuning cases are in
    ``CHUNK_CASES`` below."""
    from kda_sessions.kernels.kda.chunk import chunk_kda_triton

    q, k, v, g, beta, cu = packed_or_batched(varlen, H, K, V, bounded)
    N = 2
    if not l2norm:  # unnormalised keys make the delta rule diverge; scale them down instead
        q, k = q * 0.25, k * 0.25
    init = torch.randn(N, H, K, V) if h0 else None
    o, final, ck = chunk_kda_triton(q, k, v, g, beta, None, init, True, cu, l2norm, ckpts, tuning=_tuning(tune))
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu, l2norm, ckpts)
    assert rel_rms(o, ro) < TOL
    assert rel_rms(final, rfinal) < TOL
    if ckpts is not None:
        assert ck.shape == rck.shape
        assert rel_rms(ck, rck) < TOL
    else:
        assert ck is None


@pytest.mark.slow
def test_chunk_kda_steep_decay():
    """Per-step log-decays down to -30: 16-token sub-chunks spanning far more than e^160, where factoring a
    diagonal block through one reference point would overflow (the diagonal kernel forms each pair's decay).
    The default run covers steep decays with the ``steep`` case of ``CHUNK_CASES``."""
    from kda_sessions.kernels.kda.chunk import chunk_kda_triton

    q, k, v, _, beta = kda_inputs(1, 90, H, K, V, False, seed=7)
    gen = torch.Generator().manual_seed(8)
    g = -30.0 * torch.rand(1, 90, H, K, generator=gen) ** 3
    assert (-g[0, :16].sum(0)).max() > 160.0
    o, final, _ = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True)
    ro, rfinal, _ = naive_recurrent_kda(q, k, v, g, beta, None, None, True, None, True)
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["standard", "bounded"])
def test_chunk_kda_gate_in_kernel_on_cpu(lower_bound):
    """Raw gate logits + A_log + dt_bias into the public ``chunk_kda`` on CPU tensors (its CPU path): the same as
    the naive gate followed by the recurrence. The Triton kernel's fused gate is checked on the same inputs by
    ``test_shipped_chunk_gate_in_kernel``."""
    from kda_sessions.kernels import chunk_kda
    from kda_sessions.kernels.gate.naive import naive_kda_gate

    q, k, v, beta, raw, A_log, dt_bias, cu, ckpts = gate_case(H, K, V)
    g = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, None, True, cu, True, ckpts)
    co, cfinal, cck = chunk_kda(q, k, v, raw, beta, None, None, True, cu, True, ckpts, **kw)
    assert rel_rms(co, ro) < 1e-5 and rel_rms(cfinal, rfinal) < 1e-5 and rel_rms(cck, rck) < 1e-5


@pytest.mark.slow
def test_chunk_kda_checkpoints_leave_output_alone():
    """Asking for checkpoints changes neither the output nor the final state. (The default run checks the same
    through the checkpoint cases of ``CHUNK_CASES``, whose outputs and checkpoints match the twin.)"""
    from kda_sessions.kernels.kda.chunk import chunk_kda_triton

    q, k, v, g, beta = kda_inputs(1, 80, H, K, V, False, seed=3)
    o1, f1, _ = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, None)
    o2, f2, ck = chunk_kda_triton(q, k, v, g, beta, None, None, True, None, True, [[3, 80]])
    assert rel_rms(o2, o1) < TOL and rel_rms(f2, f1) < TOL
    assert rel_rms(ck[1], f1[0]) < TOL  # the state after all 80 tokens is the final state


def test_fused_recurrent_pool_in_place_varlen():
    from kda_sessions.kernels.kda.fused_recurrent import fused_recurrent_kda_triton

    q, k, v, g, beta = kda_inputs(1, 9, H, K, V, False, seed=4)
    cu = torch.tensor([0, 1, 4, 9])  # one decode token, then 3 and 5 tokens
    pool = torch.randn(6, H, K, V)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    before = pool.clone()
    o, final = fused_recurrent_kda_triton(q, k, v, g, beta, None, None, True, cu, True, pool, slots)
    ro, rfinal, _ = naive_recurrent_kda(q, k, v, g, beta, None, before[slots.long()], True, cu, True)
    assert rel_rms(o, ro) < TOL
    assert rel_rms(final, rfinal) < TOL
    assert rel_rms(pool[slots.long()], rfinal) < TOL
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("bounded", [False, True], ids=["standard", "bounded"])
def test_fused_recurrent_batch_decode(bounded):
    from kda_sessions.kernels.kda.fused_recurrent import fused_recurrent_kda_triton

    q, k, v, g, beta = kda_inputs(3, 1, H, K, V, bounded, seed=5)
    h0 = torch.randn(3, H, K, V)
    o, final = fused_recurrent_kda_triton(q, k, v, g, beta, None, h0, True, None, True)
    ro, rfinal, _ = naive_recurrent_kda(q, k, v, g, beta, None, h0, True, None, True)
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dispatch_cuda_bf16():
    from kda_sessions.kernels import chunk_kda

    q, k, v, g, beta = (x.cuda() for x in kda_inputs(1, 300, 4, 64, 64, False, seed=6))
    o, f, _ = chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), None, None, True, None, True)
    ro, rf, _ = naive_recurrent_kda(q, k, v, g, beta, None, None, True, None, True)
    assert rel_rms(o, ro) < 2e-2 and rel_rms(f, rf) < 2e-2


# (gate, heads, varlen, h0, checkpoints, l2norm, launch parameters); the launch-parameter variants that only the
# benches' tuning uses run with -m slow (each is 4-9 s in the interpreter)
CHUNK_CASES = [
    pytest.param("standard", H, True, True, [[5, 21], [1, 66]], True, None, id="standard-varlen-h0-ckpt"),
    pytest.param("bounded", H, True, False, [[21], [70]], True, SMALL_BLOCKS,
                 id="bounded-varlen-small-blocks"),
    pytest.param("standard", H, False, True, None, False,
                 {"inv_ieee": 1, "offdiag_warps": 4, "prep_bk": 32, "tok_bh": 1, "tok_warps": 1},
                 id="standard-batch2-no-norm-ieee-inverse-1-head-per-program", marks=pytest.mark.slow),
    pytest.param("steep", H, True, True, [[20], [2, 50]], True, None, id="steep-decay-varlen-ckpt"),
    pytest.param("standard", 3, True, True, [[5, 21], [1, 66]], True, {"tok_bh": 2, "tok_order": 0},
                 id="3-heads-2-per-program-chunks-fastest-grid", marks=pytest.mark.slow),
    pytest.param("standard", 3, True, True, [[5, 21], [1, 66]], True, None, id="3-heads-4-per-program"),
    # chunk starts loaded from the table; by default the checkpoint-cut case below loads them too
    pytest.param("standard", H, False, True, None, True, {"state_reg": 0, "state_stages": 2},
                 id="batch2-state-chunk-starts-loaded", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("gate,heads,varlen,h0,ckpts,norm,tune", CHUNK_CASES)
def test_shipped_chunk_tunables_match_recurrent(gate, heads, varlen, h0, ckpts, norm, tune):
    """The shipped chunk kernel (prep, token-parallel exact diagonal, off-diagonal + inverse, w/u kernels)
    with its launch parameters; 3 heads leave the last program of the diagonal step with masked heads.
    ``steep``: log-decays 30x the standard gate's, far past the tensor-core limit for diagonal blocks (e^160),
    where the off-diagonal factors underflow: the diagonal blocks are exact here for any span."""
    from kda_sessions.kernels.kda import chunk
    q, k, v, g, beta, cu = packed_or_batched(varlen, heads, K, V, gate == "bounded")
    if gate == "steep":
        g = g * 30
        assert (-g[0, :16].sum(0)).max() > 160.0  # a 16-token sub-chunk spans more than e^160
    init = torch.randn(2, heads, K, V) if h0 else None
    o, final, ck = chunk.chunk_kda_triton(q, k, v, g, beta, None, init, True, cu, norm, ckpts, tuning=_tuning(tune))
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu, norm, ckpts)
    assert torch.isfinite(o).all()
    assert rel_rms(o, ro) < 1e-4 and rel_rms(final, rfinal) < 1e-4
    if ckpts is not None:
        assert rel_rms(ck, rck) < 1e-4


@pytest.mark.parametrize("cu,ckpts", [
    pytest.param([0, 86, 100], None, id="computed-2-sequences"),
    pytest.param([0, 86], [[30]], id="checkpoint-cut-loaded-table"),
])
def test_shipped_chunk_computed_chunk_starts(cu, ckpts):
    """The state kernel computes where a chunk starts (``state_reg``, the default) instead of loading it: a
    sequence of a whole chunk and a 22-token tail beside a 14-token one, with two V blocks; and, where a checkpoint
    cuts a chunk (the second chunk starts at 30, not at a multiple of 64), its fallback to the loaded chunk
    table."""
    from kda_sessions.kernels.kda import chunk
    q, k, v, g, beta = kda_inputs(1, cu[-1], H, K, V, False, seed=4)
    cu_t = torch.tensor(cu)
    init = torch.randn(len(cu) - 1, H, K, V)
    tune = {"state_reg": 1, "state_bv": 16}
    o, final, ck = chunk.chunk_kda_triton(q, k, v, g, beta, None, init, True, cu_t, True, ckpts, tuning=_tuning(tune))
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, None, init, True, cu_t, True, ckpts)
    assert rel_rms(o, ro) < TOL and rel_rms(final, rfinal) < TOL
    if ckpts is not None:
        assert rel_rms(ck, rck) < TOL


class _LaunchCount:
    """Stands in for a ``@triton.jit`` kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(
    "lower_bound,tune,midpoint",
    [
        pytest.param(None, None, False, id="standard"),
        pytest.param(-5.0, {"diag_mid": 1}, True, id="bounded-midpoint"),
        pytest.param(-5.0, {"diag_mid": 1, "diag_ieee": 1, "diag_warps": 2}, True, id="bounded-midpoint-ieee"),
        pytest.param(-5.0, None, False, id="bounded-exact-by-default"),
        pytest.param(-20.0, {"diag_mid": 1}, False, id="bounded-lb20-too-wide-for-midpoint"),
    ],
)
def test_shipped_chunk_gate_in_kernel(lower_bound, tune, midpoint, monkeypatch):
    """Raw gate logits in. With ``diag_mid`` 1 the bounded gate with lb -5 takes the midpoint diagonal kernel (no
    span check: a sub-chunk spans at most 15 * 5 / ln 2 < SPAN_MAX), by default the exact one; with lb -20 a
    sub-chunk may span 15 * 20 / ln 2 > SPAN_MAX, so the launcher must keep it on the exact kernel."""
    from kda_sessions.kernels.gate.naive import naive_kda_gate
    from kda_sessions.kernels.kda import chunk
    mid = _LaunchCount(chunk._diag_mid_kernel)
    monkeypatch.setattr(chunk, "_diag_mid_kernel", mid)
    q, k, v, beta, raw, A_log, dt_bias, cu, ckpts = gate_case(H, K, V)
    init = torch.randn(2, H, K, V)
    g = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
    o, final, ck = chunk.chunk_kda_triton(q, k, v, raw, beta, 0.3, init, True, cu, True, ckpts,
                                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                       lower_bound=lower_bound, tuning=_tuning(tune))
    ro, rfinal, rck = naive_recurrent_kda(q, k, v, g, beta, 0.3, init, True, cu, True, ckpts)
    assert mid.launches == int(midpoint)
    assert rel_rms(o, ro) < 1e-4 and rel_rms(final, rfinal) < 1e-4 and rel_rms(ck, rck) < 1e-4


@pytest.mark.parametrize("key", ["intra_bk", "diag_span_check", "state_k2"])
def test_chunk_tuning_rejects_unknown_launch_parameter(key):
    """A launch parameter the kernel does not have is an error, not silently ignored."""
    with pytest.raises(TypeError, match=key):
        _tuning({key: 16})
