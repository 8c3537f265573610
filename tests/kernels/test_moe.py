"""Fused MoE (kernels/moe) against its naive twin, the expert loop.

CPU: the Triton kernels (grouped and direct, the two-kernel and the one-launch router) under TRITON_INTERPRET=1
at tiny sizes, float32 (relative RMS error 1e-5) and float16 (1e-3). GPU (gpu-marked): bfloat16 at the Kimi-Linear-48B shape (256 experts, top 8, D 2304, F 1024) against
the twin in float32, relative RMS error 1e-2; CUDA-graph replay equal to the eager call; no host sync."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.moe import fused_moe
from kda_sessions.kernels.moe.naive import naive_fused_moe

from .kernel_helpers import rel_rms

TOL = 1e-5
TOL_HALF = 1e-3
TOL_BF16 = 1e-2


def moe_case(T: int, E: int, k: int, D: int, Fw: int, seed: int = 0, skew: bool = False, device: str = "cpu",
             dtype: torch.dtype = torch.float32):
    """(x [T, D], w13 [E, 2F, D], w2 [E, D, F], chosen [T, k], weights [T, k]); ``skew`` routes every token to
    the experts 0..k-1 (one expert holds all T tokens)."""
    gen = torch.Generator(device).manual_seed(seed)  # built where it runs: the 48B shape's weights are 1.8 G numbers
    x = torch.randn(T, D, generator=gen, device=device)
    w13 = torch.randn(E, 2 * Fw, D, generator=gen, device=device) / D**0.5
    w2 = torch.randn(E, D, Fw, generator=gen, device=device) / Fw**0.5
    if skew:
        chosen = torch.arange(k, device=device).repeat(T, 1)
    else:
        chosen = torch.argsort(torch.rand(T, E, generator=gen, device=device), dim=1)[:, :k]
    weights = torch.rand(T, k, generator=gen, device=device)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), chosen, weights.to(dtype)


ALIGN_CASES = [(1, 8, 2, 16), (5, 8, 3, 16), (40, 16, 4, 16), (40, 16, 4, 64), (3, 256, 8, 16), (130, 8, 8, 16),
               (64, 256, 9, 16), (20, 12, 3, 16)]


@pytest.mark.parametrize("T,E,k,BM", ALIGN_CASES, ids=[f"T{t}-E{e}-k{k}-BM{b}" for t, e, k, b in ALIGN_CASES])
def test_align_kernel_equals_the_sorted_grouping(T: int, E: int, k: int, BM: int) -> None:
    """The one-program align kernel gives exactly the stable sort's grouping, and that grouping is right: every
    pair once, in pair order within its expert, each expert's run padded to BM, each block on one expert."""
    from kda_sessions.kernels.moe.triton_moe import align_torch, align_triton

    chosen = moe_case(T, E, k, 8, 8, seed=T)[3]
    rids, rblocks, rtotal = align_torch(chosen, E, BM)
    for config in (None, (16, 32, 2), (128, 1024, 8), ("sort", 1024, 4)):  # the library's, loops of other widths, sort
        ids, blocks, total = align_triton(chosen, E, BM, config)
        assert torch.equal(ids, rids) and torch.equal(blocks, rblocks) and torch.equal(total, rtotal), config
    P, n = T * k, int(total)
    used = ids[:n]
    assert sorted(used[used < P].tolist()) == list(range(P)) and bool((ids[n:] == P).all())
    flat = chosen.reshape(-1)
    for b in range(n // BM):
        rows = used[b * BM : (b + 1) * BM]
        real = rows[rows < P].long()
        assert bool((flat[real] == blocks[b]).all()) and torch.equal(real, real.sort().values)
    counts = torch.bincount(flat, minlength=E)
    assert n == int(((counts + BM - 1) // BM * BM).sum())


MOE_CASES = [(1, 8, 2, 48, 40, False), (5, 8, 3, 48, 40, False), (40, 16, 4, 40, 24, False), (12, 8, 4, 32, 16, True)]


@pytest.mark.parametrize("T,E,k,D,Fw,skew", MOE_CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}{'-skew' if c[5] else ''}" for c in MOE_CASES])
def test_fused_moe_matches_the_expert_loop(T: int, E: int, k: int, D: int, Fw: int, skew: bool) -> None:
    from kda_sessions.kernels.moe.triton_moe import MoeLaunch, fused_moe_triton

    x, w13, w2, chosen, weights = moe_case(T, E, k, D, Fw, seed=T, skew=skew)
    ref = naive_fused_moe(x, w13, w2, chosen, weights)
    for cfg in (MoeLaunch(16, 32, 32, 4, 1), MoeLaunch(64, 16, 16, 4, 1)):  # decode-like and prefill-like tiles
        for tma in (False, True):  # pointer loads; TMA descriptors (rows past F / D from the next expert)
            out = fused_moe_triton(x, w13, w2, chosen, weights, cfg, tma=tma)
            assert out.shape == (T, D) and rel_rms(out, ref) < TOL, (cfg, tma)


DIRECT_CASES = [(1, 8, 2, 48, 40, False), (1, 16, 9, 40, 24, False), (5, 8, 3, 48, 40, False),
                (16, 16, 3, 40, 24, False), (16, 16, 9, 40, 24, False), (7, 8, 4, 32, 16, True)]
DIRECT_IDS = [f"T{c[0]}-E{c[1]}-k{c[2]}{'-skew' if c[5] else ''}" for c in DIRECT_CASES]
# the direct kernels' largest batch (16 tokens) with 9 pairs a token: 24 s in the interpreter (k 3 covers the 16 rows);
# 5 tokens: 10 s (7 tokens, skewed, cover a middle batch)
DIRECT_PARAMS = [pytest.param(*c, id=i, marks=[pytest.mark.slow] if i in ("T16-E16-k9", "T5-E8-k3") else [])
                 for c, i in zip(DIRECT_CASES, DIRECT_IDS)]


@pytest.mark.parametrize("T,E,k,D,Fw,skew", DIRECT_PARAMS)
def test_direct_moe_matches_the_expert_loop(T: int, E: int, k: int, D: int, Fw: int, skew: bool) -> None:
    """The decode kernels (no grouping; the down kernel sums each token's k pairs) under tiles that split the
    widths unevenly and tiles wider than them, with 2, 1 and 0 of the down kernel's first tiles loaded ahead (and
    at one token a reduction after every pair)."""
    from kda_sessions.kernels.moe.triton_moe import DirectLaunch, fused_moe_direct, fused_moe_triton

    x, w13, w2, chosen, weights = moe_case(T, E, k, D, Fw, seed=T, skew=skew)
    ref = naive_fused_moe(x, w13, w2, chosen, weights)
    # T 16: each more tile 5-7 s in the interpreter; the default tiles run below
    more = [DirectLaunch(16, 64, 4, 64, 64, 4, 1), DirectLaunch(4, 16, 4, 8, 16, 4, 0, 1)] if T < 16 else []
    for cfg in [DirectLaunch(4, 16, 4, 8, 16, 4), *more]:
        out = fused_moe_direct(x, w13, w2, chosen, weights, cfg)
        assert out.shape == (T, D) and rel_rms(out, ref) < TOL
    assert rel_rms(fused_moe_triton(x, w13, w2, chosen, weights), ref) < TOL  # T <= 16: the direct kernels


# the GPU decode adds and norms in this kernel at one token only (ADD_NORM_MAX_TOKENS): more tokens 7 s (5) and
# 25 s (16) in the interpreter
ADD_NORM_CASES = [(1, 8, 2, 48, 40), pytest.param(5, 8, 3, 48, 40, marks=pytest.mark.slow),
                  pytest.param(16, 16, 9, 40, 24, marks=pytest.mark.slow)]


@pytest.mark.parametrize("T,E,k,D,Fw", ADD_NORM_CASES, ids=["T1-E8-k2", "T5-E8-k3", "T16-E16-k9"])
def test_direct_moe_with_the_norm_after_it_matches_the_twins(T: int, E: int, k: int, D: int, Fw: int) -> None:
    """The down kernel's last program adds the residual and norms (tiles that split D into several programs):
    the expert loop's output added and normed by the norm's twin; the arrival counter back at zero, so a second
    call norms again (as a graph replay would)."""
    from kda_sessions.kernels.moe.route import _COUNTERS
    from kda_sessions.kernels.moe.triton_moe import DirectLaunch, fused_moe_direct_add_norm
    from kda_sessions.kernels.norm.naive import naive_add_rms_norm

    x, w13, w2, chosen, weights = moe_case(T, E, k, D, Fw, seed=T)
    gen = torch.Generator().manual_seed(T + 1)
    res, nw = torch.randn(T, D, generator=gen), torch.rand(D, generator=gen) + 0.5
    rs, rh = naive_add_rms_norm(res, naive_fused_moe(x, w13, w2, chosen, weights), nw, 1e-6)
    for cfg in (DirectLaunch(4, 16, 4, 8, 16, 4), DirectLaunch(2, 512, 2, 2, 512, 2)):
        s, h = fused_moe_direct_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6, cfg)
        assert rel_rms(s, rs) < TOL and rel_rms(h, rh) < TOL
        assert int(_COUNTERS[("cpu", None)][1]) == 0


@pytest.mark.parametrize("T,E,k,D,Fw", [(1, 8, 3, 48, 40), (3, 8, 3, 40, 24), (1, 4, 1, 32, 40)],
                         ids=["T1-k3", "T3-k3", "T1-k1"])
def test_direct_moe_with_an_always_on_expert_read_first_matches_the_twins(
    T: int, E: int, k: int, D: int, Fw: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``always_on`` with ``FIXED_FIRST``: the up kernel's one-axis grid (the fixed expert's programs first, its
    rows loaded whole as D's largest power of two and the padded rest) gives the twins' sum and norm, for one
    token, several, and one expert a token (the dense FFN's case, where every program is the fixed expert's)."""
    from kda_sessions.kernels.moe import triton_moe
    from kda_sessions.kernels.moe.triton_moe import DirectLaunch, fused_moe_direct_add_norm
    from kda_sessions.kernels.norm.naive import naive_add_rms_norm

    monkeypatch.setattr(triton_moe, "FIXED_FIRST", True)
    x, w13, w2, chosen, weights = moe_case(T, E, k, D, Fw, seed=T + k)
    chosen[:, -1] = E - 1
    gen = torch.Generator().manual_seed(T + 2)
    res, nw = torch.randn(T, D, generator=gen), torch.rand(D, generator=gen) + 0.5
    rs, rh = naive_add_rms_norm(res, naive_fused_moe(x, w13, w2, chosen, weights), nw, 1e-6)
    for cfg in (DirectLaunch(4, 16, 4, 8, 16, 4), DirectLaunch(16, 64, 4, 64, 64, 4)):
        s, h = fused_moe_direct_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6, cfg, always_on=E - 1)
        assert rel_rms(s, rs) < TOL and rel_rms(h, rh) < TOL


def test_fused_moe_add_norm_checks_shapes_and_runs_the_twins_on_a_cpu() -> None:
    from kda_sessions.kernels.moe import fused_moe_add_norm
    from kda_sessions.kernels.norm import add_rms_norm

    x, w13, w2, chosen, weights = moe_case(3, 8, 2, 48, 40, seed=9)
    res, nw = torch.randn(3, 48), torch.ones(48)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_moe_add_norm(x, w13, w2, chosen, weights, res[:, :8], nw, 1e-6)
    s, h = fused_moe_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6)
    rs, rh = add_rms_norm(res, naive_fused_moe(x, w13, w2, chosen, weights), nw, 1e-6)
    assert torch.equal(s, rs) and torch.equal(h, rh)


def test_direct_moe_half_precision() -> None:
    from kda_sessions.kernels.moe.triton_moe import fused_moe_direct

    x, w13, w2, chosen, weights = moe_case(3, 8, 2, 48, 40, seed=5)
    ref = naive_fused_moe(x, w13, w2, chosen, weights)
    h = [t.half() if t.is_floating_point() else t for t in (x, w13, w2, chosen, weights)]
    out = fused_moe_direct(*h)
    assert out.dtype == torch.float16 and rel_rms(out, ref) < TOL_HALF


def test_fused_moe_half_precision() -> None:
    from kda_sessions.kernels.moe.triton_moe import MoeLaunch, fused_moe_triton

    x, w13, w2, chosen, weights = moe_case(6, 8, 2, 48, 40, seed=3)
    ref = naive_fused_moe(x, w13, w2, chosen, weights)
    h = [t.half() if t.is_floating_point() else t for t in (x, w13, w2, chosen, weights)]
    out = fused_moe_triton(*h, MoeLaunch(16, 32, 32, 4, 1))
    assert out.dtype == torch.float16 and rel_rms(out, ref) < TOL_HALF


def test_fused_moe_runs_the_tiny_random_moe_layer() -> None:
    """The kernels (grouped and direct) on a real MoE layer's stacked weights, its shared expert stacked last and
    routed as an always-on expert, equal the layer's own CPU loop plus its shared expert."""
    from kda_sessions.kernels.moe import moe_route
    from kda_sessions.kernels.moe.triton_moe import MoeLaunch, fused_moe_direct, fused_moe_triton
    from kda_sessions.model import load_model
    from kda_sessions.model.ffn import MoE

    model = load_model("tiny-random")
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(4))  # 9 s a token
    torch.set_grad_enabled(False)  # restored below; the layer's parameters require grad
    before = moe(x)
    moe.stack_experts()
    fused = moe._fused_weights()
    assert fused is not None and moe.shared_experts is not None
    w13, w2, shared_id = fused
    E = len(moe.experts)
    assert shared_id == E and w13.shape[0] == E + 1  # the shared expert has the routed experts' width
    assert moe.shared_experts.down_proj.weight.data_ptr() == w2[E].data_ptr()
    chosen, w = moe_route(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.top_k, moe.renormalize,
                          moe.scale, shared_id)
    out = fused_moe_triton(x, w13, w2, chosen, w, MoeLaunch(16, 32, 32, 4, 1))
    direct = fused_moe_direct(x, w13, w2, chosen, w)  # the decode kernels
    ref = moe(x)  # the CPU path: the loop over the routed experts, then the shared expert
    shared = moe.shared_experts(x)
    torch.set_grad_enabled(True)
    assert torch.equal(ref, before)
    assert rel_rms(out, ref) < TOL and rel_rms(direct, ref) < TOL
    assert rel_rms(shared, ref) > 0.1  # the routed experts contributed


def test_decode_kernels_launch_without_pdl_off_hopper() -> None:
    """Programmatic dependent launch only on a CUDA device of compute capability 9.0 or more, and only while the
    knob is on."""
    from kda_sessions.kernels.moe import pdl

    assert not pdl.use_pdl(torch.device("cpu"))
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.use_pdl(torch.device("cuda")) == hopper
        pdl.ENABLED = False
        try:
            assert not pdl.use_pdl(torch.device("cuda"))
        finally:
            pdl.ENABLED = True


def test_fused_moe_validates_shapes() -> None:
    x, w13, w2, chosen, weights = moe_case(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x, w13, w2[:, :, :4], chosen, weights)
    with pytest.raises(ValueError, match="chosen and weights"):
        fused_moe(x, w13, w2, chosen[:1], weights)
    assert torch.equal(fused_moe(x, w13, w2, chosen, weights), naive_fused_moe(x, w13, w2, chosen, weights))


GPU_T = [1, 8, 16, 17, 32, 64, 129, 2048]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_align_kernels_on_the_gpu() -> None:
    """Both align kernels compiled for the GPU give the stable sort's grouping at the router's shape (256 experts,
    9 pairs a token), up to the one-program limit."""
    from kda_sessions.kernels.moe.triton_moe import align_torch, align_triton

    for T in (1, 16, 64, 113):
        chosen = torch.stack([torch.randperm(256, device="cuda")[:9] for _ in range(T)])
        for BM in (16, 64):
            want = align_torch(chosen, 256, BM)
            for config in ((64, 64, 4), ("sort", 1024, 4), ("sort", 1024, 8)):
                got = align_triton(chosen, 256, BM, config)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (T, BM, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", GPU_T, ids=[f"T{t}" for t in GPU_T])
def test_fused_moe_bf16_at_the_48b_shape(T: int) -> None:
    """bf16 kernels against the twin in float32 on the same bf16 inputs; no host sync during the call."""
    x, w13, w2, chosen, weights = moe_case(T, 256, 8, 2304, 1024, seed=T, device="cuda", dtype=torch.bfloat16)
    ref = naive_fused_moe(x.float(), w13.float(), w2.float(), chosen, weights.float())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused_moe(x, w13, w2, chosen, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.dtype == torch.bfloat16 and rel_rms(out, ref) < TOL_BF16
    if T > 16:  # the grouped kernels: TMA (the default on sm_90) and pointer loads
        from kda_sessions.kernels.moe.triton_moe import fused_moe_triton

        for tma in (True, False):
            assert rel_rms(fused_moe_triton(x, w13, w2, chosen, weights, tma=tma), ref) < TOL_BF16, tma


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 17, 300], ids=["T1", "T8", "T17", "T300"])
def test_fused_moe_replays_in_a_cuda_graph(T: int) -> None:
    """Captured once, replayed on new routing in the same buffers: equal to the eager call on that routing."""
    x, w13, w2, chosen, weights = moe_case(T, 256, 8, 2304, 1024, seed=1, device="cuda", dtype=torch.bfloat16)
    fused_moe(x, w13, w2, chosen, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, chosen, weights)
    x2, _, _, chosen2, weights2 = moe_case(T, 256, 8, 2304, 1024, seed=2, device="cuda", dtype=torch.bfloat16)
    x.copy_(x2)
    chosen.copy_(chosen2)
    weights.copy_(weights2)
    graph.replay()
    eager = fused_moe(x, w13, w2, chosen, weights)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


ROUTE_CASES = [(1, 16, 4, True, False), (9, 256, 8, True, True), (5, 40, 2, False, True), (70, 80, 4, True, False)]


@pytest.mark.parametrize("T,E,k,renorm,shared", ROUTE_CASES,
                         ids=[f"T{t}-E{e}-k{k}-{'renorm' if r else 'raw'}{'-shared' if a else ''}"
                              for t, e, k, r, a in ROUTE_CASES])
def test_route_kernels_match_the_twin(T: int, E: int, k: int, renorm: bool, shared: bool) -> None:
    """Same experts in the same order (no near-ties in random scores) and the same weights; with a shared expert
    (always_on = E) a last column E with weight 1."""
    from kda_sessions.kernels.moe.naive import naive_moe_route
    from kda_sessions.kernels.moe.route import moe_route_triton

    gen = torch.Generator().manual_seed(E)
    x = torch.randn(T, 48, generator=gen)
    gate = torch.randn(E, 48, generator=gen) / 4
    bias = torch.randn(E, generator=gen) * 0.1
    always_on = E if shared else None
    chosen, w = moe_route_triton(x, gate, bias, k, renorm, 2.446, always_on)
    rc, rw = naive_moe_route(x, gate, bias, k, renorm, 2.446, always_on)
    assert torch.equal(chosen, rc) and rel_rms(w, rw) < TOL
    assert chosen.shape == (T, k + shared)
    if shared:
        assert bool((chosen[:, -1] == E).all()) and bool((w[:, -1] == 1).all())


DECODE_ROUTE_CASES = [(1, 16, 4, True, False), (1, 256, 8, True, True), (3, 40, 2, False, True),
                      (8, 80, 4, True, False), (16, 256, 8, True, True), (9, 33, 8, True, False)]


@pytest.mark.parametrize("T,E,k,renorm,shared", DECODE_ROUTE_CASES,
                         ids=[f"T{t}-E{e}-k{k}-{'renorm' if r else 'raw'}{'-shared' if a else ''}"
                              for t, e, k, r, a in DECODE_ROUTE_CASES])
def test_one_launch_router_matches_the_twin(T: int, E: int, k: int, renorm: bool, shared: bool) -> None:
    """The decode router (logits of 2 experts a program, the last program to arrive selects for every token):
    the twin's experts in its order and its weights; the arrival counter is back at zero, so a second call
    selects again (as a graph replay would)."""
    from kda_sessions.kernels.moe.naive import naive_moe_route
    from kda_sessions.kernels.moe.route import _COUNTERS, moe_route_decode

    gen = torch.Generator().manual_seed(E + T)
    x = torch.randn(T, 48, generator=gen)
    gate = torch.randn(E, 48, generator=gen) / 4
    bias = torch.randn(E, generator=gen) * 0.1
    always_on = E if shared else None
    rc, rw = naive_moe_route(x, gate, bias, k, renorm, 2.446, always_on)
    for _ in range(2):
        chosen, w = moe_route_decode(x, gate, bias, k, renorm, 2.446, always_on)
        assert torch.equal(chosen, rc) and rel_rms(w, rw) < TOL
        assert int(_COUNTERS[("cpu", None)][0]) == 0


NORM_ROUTE_CASES = [(1, 256, 8, True), (3, 40, 2, False), (16, 64, 4, True)]


@pytest.mark.parametrize("T,E,k,shared", NORM_ROUTE_CASES,
                         ids=[f"T{t}-E{e}-k{k}{'-shared' if a else ''}" for t, e, k, a in NORM_ROUTE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_one_launch_router_with_the_norm_matches_the_twins(T: int, E: int, k: int, shared: bool,
                                                           dtype: torch.dtype) -> None:
    """The residual add and RMSNorm in the router's launch (D 80: two width blocks at T 16): the sum and the
    normed rows as the norm's twin gives them (float32 1e-6, float16 within one rounding), the router's twin's
    experts on those rows and its weights."""
    from kda_sessions.kernels.moe.naive import naive_moe_route
    from kda_sessions.kernels.moe.route import add_norm_route_decode
    from kda_sessions.kernels.norm.naive import naive_add_rms_norm

    D = 80
    gen = torch.Generator().manual_seed(E + T)
    x, a = (torch.randn(T, D, generator=gen).to(dtype) for _ in range(2))
    nw = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    gate = (torch.randn(E, D, generator=gen) / 4).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.1
    always_on = E if shared else None
    rs, rh = naive_add_rms_norm(x, a, nw, 1e-6)
    rc, rw = naive_moe_route(rh, gate, bias, k, True, 2.446, always_on)
    s, h, chosen, w = add_norm_route_decode(x, a, nw, 1e-6, gate, bias, k, True, 2.446, always_on)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.equal(s, rs) and rel_rms(h, rh) < tol
    assert torch.equal(chosen, rc) and rel_rms(w, rw) < (TOL if dtype == torch.float32 else TOL_HALF)


def test_add_norm_route_checks_shapes_and_runs_the_twins_on_a_cpu() -> None:
    from kda_sessions.kernels.moe import add_norm_route, moe_route
    from kda_sessions.kernels.norm import add_rms_norm

    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(2, 32, generator=gen), torch.randn(2, 32, generator=gen)
    nw, gate, bias = torch.ones(32), torch.randn(16, 32, generator=gen), torch.zeros(16)
    with pytest.raises(ValueError, match="norm_weight"):
        add_norm_route(x, a, nw[:8], 1e-6, gate, bias, 4, True, 1.0)
    s, h, chosen, _ = add_norm_route(x, a, nw, 1e-6, gate, bias, 4, True, 1.0)
    rs, rh = add_rms_norm(x, a, nw, 1e-6)
    rc, _ = moe_route(rh, gate, bias, 4, True, 1.0)
    assert torch.equal(s, rs) and torch.equal(h, rh) and torch.equal(chosen, rc)


def test_one_launch_router_breaks_ties_by_the_lowest_index() -> None:
    """Equal scores (a zero gate, no bias): experts 0..k-1 in order, weights 1/k each times the scale."""
    from kda_sessions.kernels.moe.route import moe_route_decode

    chosen, w = moe_route_decode(torch.randn(2, 16), torch.zeros(32, 16), torch.zeros(32), 4, True, 2.0)
    assert chosen.tolist() == [[0, 1, 2, 3]] * 2 and torch.allclose(w, torch.full((2, 4), 0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16], ids=["T1", "T8", "T16"])
def test_one_launch_router_replays_in_a_cuda_graph(T: int) -> None:
    """At the 48B shape: captured once, replayed 50 times on new inputs, each replay equal to the eager call (the
    arrival counter resets itself; no stale logits are read)."""
    from kda_sessions.kernels.moe import moe_route

    gen = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, 2304, generator=gen, device="cuda").bfloat16()
    gate = (torch.randn(256, 2304, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.01
    moe_route(x, gate, bias, 8, True, 2.446, 256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside would fail the capture
        chosen, w = moe_route(x, gate, bias, 8, True, 2.446, 256)
    bad = 0
    for _ in range(50):
        x.copy_(torch.randn(T, 2304, generator=gen, device="cuda").bfloat16())
        graph.replay()
        c2, w2 = moe_route(x, gate, bias, 8, True, 2.446, 256)
        bad += int(not (torch.equal(chosen, c2) and torch.equal(w, w2)))
    assert bad == 0 and bool((chosen[:, -1] == 256).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_selection_by_lanes_gives_the_same_choices(monkeypatch) -> None:
    """``route.SELECT_LANES`` (one token, 256 experts: the top k by warp shuffles) against the selection by block
    reductions on the same logits: the same experts in the same order (ties too: a gate of zeros makes every score
    equal, the lowest indices first), weights within one bfloat16 rounding (the renormalising sum in another order)."""
    from kda_sessions.kernels.moe import route

    gen = torch.Generator("cuda").manual_seed(11)
    for trial in range(40):
        x = torch.randn(1, 2304, generator=gen, device="cuda").bfloat16()
        gate = (torch.randn(256, 2304, generator=gen, device="cuda") * 0.02).bfloat16()
        if trial % 10 == 0:
            gate.zero_()
        bias = torch.randn(256, generator=gen, device="cuda") * (0.0 if trial % 20 == 0 else 0.01)
        for renorm in (True, False):
            monkeypatch.setattr(route, "SELECT_LANES", False)
            ref_c, ref_w = route.moe_route_decode(x, gate, bias, 8, renorm, 2.446, 256)
            monkeypatch.setattr(route, "SELECT_LANES", True)
            c, w = route.moe_route_decode(x, gate, bias, 8, renorm, 2.446, 256)
            assert torch.equal(c, ref_c), (trial, c, ref_c)
            assert torch.allclose(w.float(), ref_w.float(), rtol=8e-3, atol=0), (trial, w, ref_w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16], ids=["T1", "T8", "T16"])
def test_direct_moe_with_the_norm_on_the_gpu(T: int) -> None:
    """bf16 at the 48B shape, captured in a CUDA graph, replayed on new routing: equal to the eager call, and
    within bf16 tolerance (1e-2) of the float32 twin added and normed."""
    from kda_sessions.kernels.moe import fused_moe_add_norm
    from kda_sessions.kernels.norm.naive import naive_add_rms_norm

    x, w13, w2, chosen, weights = moe_case(T, 256, 8, 2304, 1024, seed=3, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(T, 2304, device="cuda").bfloat16()
    nw = (torch.rand(2304, device="cuda") + 0.5).bfloat16()
    fused_moe_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, h = fused_moe_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6)
    for seed in (4, 5):
        x2, _, _, chosen2, weights2 = moe_case(T, 256, 8, 2304, 1024, seed=seed, device="cuda", dtype=torch.bfloat16)
        x.copy_(x2)
        chosen.copy_(chosen2)
        weights.copy_(weights2)
        graph.replay()
        es, eh = fused_moe_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6)
        assert torch.equal(s, es) and torch.equal(h, eh)
        ref = naive_fused_moe(x.float(), w13.float(), w2.float(), chosen, weights.float())
        rs, rh = naive_add_rms_norm(res.float(), ref, nw.float(), 1e-6)
        assert rel_rms(s.float(), rs) < TOL_BF16 and rel_rms(h.float(), rh) < TOL_BF16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16], ids=["T1", "T8", "T16"])
def test_one_launch_router_with_the_norm_on_the_gpu(T: int) -> None:
    """bf16 at the 48B shape, captured in a CUDA graph and replayed on new rows: the sum equal to the norm
    kernel's, the normed rows within one bf16 rounding of its (relative RMS 1e-2: the sum of squares runs in
    another order), and the router's experts and weights on the launch's own normed rows (the same sums: at most
    1 in 100 choices may differ, where a compiler's other order of the products meets a near-tie)."""
    from kda_sessions.kernels.moe import add_norm_route, moe_route
    from kda_sessions.kernels.norm import add_rms_norm

    gen = torch.Generator("cuda").manual_seed(T)
    x, a = (torch.randn(T, 2304, generator=gen, device="cuda").bfloat16() for _ in range(2))
    nw = (torch.rand(2304, generator=gen, device="cuda") + 0.5).bfloat16()
    gate = (torch.randn(256, 2304, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.01
    add_norm_route(x, a, nw, 1e-6, gate, bias, 8, True, 2.446, 256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s, h, chosen, w = add_norm_route(x, a, nw, 1e-6, gate, bias, 8, True, 2.446, 256)
    for _ in range(5):
        x.copy_(torch.randn(T, 2304, generator=gen, device="cuda").bfloat16())
        graph.replay()
        rs, rh = add_rms_norm(x, a, nw, 1e-6)
        rc, rw = moe_route(h, gate, bias, 8, True, 2.446, 256)
        assert torch.equal(s, rs) and rel_rms(h, rh) < TOL_BF16
        assert float((chosen != rc).float().mean()) <= 1e-2 and bool((chosen[:, -1] == 256).all())
        same = (chosen == rc).all(-1)
        assert rel_rms(w[same], rw[same]) < TOL_BF16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stamped_router_and_down_give_the_same_bits_and_ordered_clocks(monkeypatch) -> None:
    """``kernels.stamps.ROWS`` (bench/decode_48b.py --stamps): the router with its add and norm and the direct MoE
    with its add and norm, built with clock stamps, give the shipped launches' outputs bit for bit at one token,
    and every program's row is filled in order (a positive globaltimer span, clock readings non-decreasing)."""
    from kda_sessions.kernels import stamps
    from kda_sessions.kernels.moe import add_norm_route, fused_moe_add_norm

    gen = torch.Generator("cuda").manual_seed(11)
    x, a, res = (torch.randn(1, 2304, generator=gen, device="cuda").bfloat16() for _ in range(3))
    nw = (torch.rand(2304, generator=gen, device="cuda") + 0.5).bfloat16()
    gate = (torch.randn(256, 2304, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.01
    _, w13, w2, _, _ = moe_case(1, 257, 9, 2304, 1024, seed=3, device="cuda", dtype=torch.bfloat16)

    def block() -> list[torch.Tensor]:
        s, h, chosen, w = add_norm_route(x, a, nw, 1e-6, gate, bias, 8, True, 2.446, 256)
        s2, h2 = fused_moe_add_norm(h, w13, w2, chosen, w, res, nw, 1e-6, always_on=256)
        return [s, h, chosen, w, s2, h2]

    plain = block()
    monkeypatch.setattr(stamps, "ROWS", {})
    stamped = block()
    assert all(torch.equal(p, q) for p, q in zip(plain, stamped))
    for name, clocks in (("route", 6), ("moe_down", 5)):
        (r,) = stamps.ROWS[name]
        r = r.cpu()
        assert (r[:, 1] > r[:, 0]).all(), name
        c = r[:, 2:2 + clocks]
        assert (c[:, 1:] >= c[:, :-1]).all() and (c[:, -1] > c[:, 0]).all(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16, 64, 2048], ids=["T1", "T8", "T16", "T64", "T2048"])
def test_route_kernels_on_the_gpu(T: int) -> None:
    """bf16 x and gate at the 48B shape; a near-tie may swap an expert: at most 1 in 1,000 choices differ."""
    from kda_sessions.kernels.moe import moe_route
    from kda_sessions.kernels.moe.naive import naive_moe_route

    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(T, 2304, generator=gen, device="cuda").bfloat16()
    gate = (torch.randn(256, 2304, generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.01
    chosen, w = moe_route(x, gate, bias, 8, True, 2.446)
    rc, rw = naive_moe_route(x, gate, bias, 8, True, 2.446)
    assert float((chosen != rc).float().mean()) <= 1e-3
    same = (chosen == rc).all(-1)
    assert rel_rms(w[same], rw[same]) < TOL_BF16


def test_launch_config_keeps_small_blocks_for_a_short_prefill():
    """64 tokens of top 8 + a shared expert at 257 experts are ~2 pairs an expert: 16-row blocks, not 64-row ones of
    mostly padding; 1,024 tokens (36 an expert) get the 64-row blocks."""
    from kda_sessions.kernels.moe.triton_moe import launch_config

    assert launch_config(64 * 9, num_experts=257).BM == 16
    assert launch_config(64 * 9).BM == 64  # without the experts' count: by pairs alone
    assert launch_config(1024 * 9, num_experts=257).BM == 64
    assert launch_config(200, num_experts=8).BM == 16


@pytest.mark.parametrize("pairs", [8, 2048])
@pytest.mark.parametrize("elem_size", [2, 4])
def test_launch_config_fits_the_devices_shared_memory(pairs, elem_size):
    """float32 prefill tiles at the bf16-tuned 4 stages need 240 KB, over an H200's 227 KB (the tiny model's
    prefill on CUDA failed with OutOfResources): the config sheds stages, then BK, until the up kernel fits, and
    the down kernel's own tile likewise."""
    from kda_sessions.kernels.moe.triton_moe import _down_shared_bytes, _up_shared_bytes, launch_config

    bf16 = launch_config(pairs)
    for limit in (232448, 166912, 101376):  # H100/H200, A100, consumer parts
        cfg = launch_config(pairs, elem_size, limit)
        assert _up_shared_bytes(cfg, elem_size) <= limit and _down_shared_bytes(cfg, elem_size) <= limit
        assert cfg.down_tile()[0] == bf16.down_tile()[0] and cfg.down_tile()[3] >= 2
        assert (cfg.BM, cfg.BN) == (bf16.BM, bf16.BN) and cfg.num_stages >= 2
    assert launch_config(pairs, 2, 232448) == bf16  # the tuned bf16 tiles are kept where they fit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_ffn_as_one_expert_at_the_48b_width() -> None:
    """``ffn.DENSE_DIRECT``'s launches at the 48B dense layer (D 2304, width 9216, one expert of weight 1), bf16, one
    token: the sum (and norm) against the float32 twin on the same bf16 inputs."""
    from kda_sessions.kernels.moe import fused_moe_add_norm

    g = torch.Generator(device="cuda").manual_seed(5)
    D, F_ = 2304, 9216

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, res = rnd(1, D), rnd(1, D)
    w13, w2 = rnd(1, 2 * F_, D, scale=D**-0.5), rnd(1, D, F_, scale=F_**-0.5)
    chosen = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
    weights = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
    norm_w = rnd(D).abs() + 0.5
    s_ref = res.float() + naive_fused_moe(x.float(), w13.float(), w2.float(), chosen, weights.float())
    s, h = fused_moe_add_norm(x, w13, w2, chosen, weights, res, norm_w, 1e-5)
    h_ref = s_ref * torch.rsqrt(s_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
    assert rel_rms(h, h_ref) < TOL_BF16
    assert rel_rms(s, s_ref) < TOL_BF16
    # no less exact than the cuBLAS path it replaces (bf16 gate and up, SiLU and product in bf16): the direct
    # kernels round the activation once, from float32
    gate, up = torch.nn.functional.linear(x, w13[0]).chunk(2, dim=-1)
    y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[0])
    y_ref = s_ref - res.float()
    err_direct = rel_rms(s.float() - res.float(), y_ref)
    err_cublas = rel_rms((res + y).float() - res.float(), y_ref)  # s rounded as the step rounds it
    assert err_direct <= 1.25 * err_cublas, (err_direct, err_cublas)
