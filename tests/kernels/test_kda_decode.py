"""The fused KDA decode step (conv + gate + norm + recurrence, pools updated in place) against its twin, the
separate ops it replaces; under TRITON_INTERPRET=1 at small shapes on a CPU, compiled with ``-m gpu``.

Tolerance: relative RMS 1e-5 for float32 (the same sums in another order), 2e-2 for bfloat16 (the conv output
is rounded to bf16 in both, but one ulp of a rounding flip moves the normalised q and k)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.kda.decode import kda_decode, naive_kda_decode
from kda_sessions.kernels.norm.naive import naive_gated_rms_norm

from .kernel_helpers import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted without one
H, K, V, W = 2, 16, 32, 4
S = 6
Dc = 2 * H * K + H * V


def _case(dtype: torch.dtype, device: str, seed: int = 0):
    """Projection rows as strided slices of one [N, Dc + H*K + H + 5] output, as the layer hands them over."""
    gen = torch.Generator().manual_seed(seed)
    N = 3
    y = torch.randn(N, Dc + H * K + H + 5, generator=gen)
    conv_w = torch.randn(W, Dc, generator=gen) * 0.5  # [W, Dc] storage, passed as a [Dc, W] view
    conv_state = torch.randn(S, W - 1, Dc, generator=gen)
    state = torch.randn(S, H, K, V, generator=gen) * 0.1
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 - 2.0
    slots = torch.tensor([4, 0, 2])
    y, conv_w, conv_state = y.to(dtype), conv_w.to(dtype), conv_state.to(dtype)
    t = [y, conv_w, conv_state, state, A_log, dt_bias, slots]
    y, conv_w, conv_state, state, A_log, dt_bias, slots = (x.to(device) for x in t)
    qkv, raw, b = y[:, :Dc], y[:, Dc : Dc + H * K], y[:, Dc + H * K : Dc + H * K + H]
    return qkv, raw, b, conv_w.t(), conv_state, A_log, dt_bias, state, slots


def _run(fn, case, lower_bound):
    qkv, raw, b, cw, conv_state, A_log, dt_bias, state, slots = case
    conv_state, state = conv_state.clone(), state.clone()
    o = fn(qkv, raw, b, cw, conv_state, A_log, dt_bias, lower_bound, state, slots, K**-0.5)
    return o, conv_state, state


def _out_norm(case) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight [V], gate [N, H*V] as a strided column slice, eps) for ``kda_decode``'s output norm."""
    qkv = case[0]
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(qkv.shape[0], H * V + 3, generator=gen).to(qkv.device, qkv.dtype)[:, 3:]
    return (torch.rand(V, generator=gen) + 0.5).to(qkv.device), gate, 1e-5


def _check(dtype: torch.dtype, device: str, lower_bound: float | None, norm: bool = False, config=None) -> None:
    from kda_sessions.kernels.kda.decode_triton import kda_decode_triton

    case = _case(dtype, device)
    out_norm = _out_norm(case) if norm else None

    def fused(*a):
        return kda_decode_triton(*a, out_norm, config=config)

    def twin(*a):
        o = naive_kda_decode(*a)
        if out_norm is None:
            return o
        nw, gate, eps = out_norm
        return naive_gated_rms_norm(o, nw.cpu(), gate.cpu().reshape(-1, H, V), eps, dtype)

    o, conv, st = _run(fused, case, lower_bound)
    ro, rconv, rst = _run(twin, tuple(x.cpu() for x in case), lower_bound)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert o.shape == (3, H, V) and o.dtype == dtype
    assert rel_rms(o.cpu(), ro) < tol
    assert rel_rms(st.cpu(), rst) < tol
    assert torch.equal(conv.cpu(), rconv)  # the tails are moved, not computed
    untouched = [1, 3, 5]
    assert torch.equal(st.cpu()[untouched], case[7].cpu()[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["standard", "bounded"])
@pytest.mark.parametrize("norm", [False, True], ids=["o", "gated-norm"])
@pytest.mark.parametrize("config", [None, (16, 1), (8, 1)], ids=["default", "two-blocks", "four-blocks"])
def test_fused_decode_matches_the_separate_ops(dtype, lower_bound, norm, config):
    """Every V-block split of a head (V 32: the default's one block, two, four): the tails shift and the norm
    reads the head's whole output whichever program does it."""
    _check(dtype, DEV, lower_bound, norm, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [False, True], ids=["o", "gated-norm"])
def test_fused_decode_matches_the_separate_ops_on_cuda(dtype, norm):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(dtype, "cuda", None, norm)


def _two_steps(device: str, config, norm: bool, n_seq: int = 3, h: int = H, k: int = K, v: int = V):
    """Two consecutive decode steps of n_seq sequences (slots out of order, two left untouched) through
    ``kda_decode_triton`` and through the twin, each step with new rows, the pools carried over. Returns the
    fused (outputs, tails, states) and the twin's, on the CPU."""
    from kda_sessions.kernels.kda.decode_triton import kda_decode_triton

    gen = torch.Generator().manual_seed(3)
    dc, w, s = 2 * h * k + h * v, W, n_seq + 2
    conv_w = torch.randn(w, dc, generator=gen).t() * 0.5
    conv_state = torch.randn(s, w - 1, dc, generator=gen)
    state = torch.randn(s, h, k, v, generator=gen) * 0.1
    A_log = torch.log(torch.empty(h).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(h * k, generator=gen) * 0.5 - 2.0
    slots = torch.randperm(s, generator=gen)[:n_seq]
    nw = torch.rand(v, generator=gen) + 0.5
    steps = [(torch.randn(n_seq, dc, generator=gen), torch.randn(n_seq, h * k, generator=gen),
              torch.randn(n_seq, h, generator=gen), torch.randn(n_seq, h * v, generator=gen)) for _ in range(2)]
    fused = [conv_state.to(device), state.to(device)]
    twin = [conv_state.clone(), state.clone()]
    outs, refs = [], []
    for qkv, raw, b, gate in steps:
        out_norm = (nw.to(device), gate.to(device), 1e-5) if norm else None
        outs.append(kda_decode_triton(qkv.to(device), raw.to(device), b.to(device), conv_w.to(device), fused[0],
                                      A_log.to(device), dt_bias.to(device), -5.0, fused[1], slots.to(device),
                                      k**-0.5, out_norm, config=config).cpu())
        o = naive_kda_decode(qkv, raw, b, conv_w, twin[0], A_log, dt_bias, -5.0, twin[1], slots, k**-0.5)
        refs.append(naive_gated_rms_norm(o, nw, gate.reshape(n_seq, h, v), 1e-5, torch.float32) if norm else o)
    return (outs, fused[0].cpu(), fused[1].cpu()), (refs, twin[0], twin[1])


def _assert_two_steps(fused, twin, tol: float) -> None:
    (outs, conv, st), (refs, rconv, rst) = fused, twin
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and rel_rms(o, r) < tol
    assert rel_rms(outs[1], outs[0]) > 0.1  # the steps differ
    assert rel_rms(st, rst) < tol
    assert torch.equal(conv, rconv)


@pytest.mark.parametrize("norm", [False, True], ids=["o", "gated-norm"])
@pytest.mark.parametrize("config", [(32, 1), (8, 1)], ids=["one-block", "four-blocks"])
def test_two_consecutive_steps_match_the_twin(norm, config):
    """The second step (the arrival counters reset by the first step's last programs, the tails shifted once)
    gives what the twin gives, and the counters are zero again after it."""
    from kda_sessions.kernels.kda.decode_triton import head_counters

    fused, twin = _two_steps(DEV, config, norm)
    _assert_two_steps(fused, twin, 1e-5)
    assert not head_counters(torch.device(DEV), 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(128, 4), (64, 4), (32, 2), (16, 1)], ids=["bv128", "bv64", "bv32", "bv16"])
def test_two_steps_at_the_48b_head_shape_on_cuda(config):
    """H 32, K = V = 128, 64 sequences, float32: every (sequence, head) of a full launch finishes in its last
    program (up to eight V blocks racing), two steps in a row, against the twin on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels.kda.decode_triton import head_counters

    fused, twin = _two_steps("cuda", config, True, n_seq=64, h=32, k=128, v=128)
    _assert_two_steps(fused, twin, 1e-4)
    assert not head_counters(torch.device("cuda", torch.cuda.current_device()), 1).any()


@pytest.mark.gpu
def test_stamped_launches_give_the_same_bits_and_ordered_clocks_on_cuda(monkeypatch):
    """``kernels.stamps.ROWS`` (bench/decode_48b.py --stamps): the launch built with clock stamps gives the
    shipped launch's outputs, tails and states bit for bit, and each program's row is filled in order: its
    globaltimer span positive, its clock readings non-decreasing phase after phase."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels import stamps

    plain = _two_steps("cuda", (64, 4), True, n_seq=2, h=32, k=128, v=128)[0]
    monkeypatch.setattr(stamps, "ROWS", {})
    stamped = _two_steps("cuda", (64, 4), True, n_seq=2, h=32, k=128, v=128)[0]
    rows = stamps.ROWS["kda_decode"]
    (po, pc, ps), (so, sc, ss) = plain, stamped
    assert all(torch.equal(x, y) for x, y in zip(po, so)) and torch.equal(pc, sc) and torch.equal(ps, ss)
    assert len(rows) == 2 and rows[0].shape == (2 * 2 * 32, 16)
    for r in rows:
        r = r.cpu()
        assert (r[:, 1] > r[:, 0]).all()
        assert (r[:, 3:11] >= r[:, 2:10]).all() and (r[:, 10] > r[:, 2]).all()


def test_public_function_checks_shapes():
    qkv, raw, b, cw, conv_state, A_log, dt_bias, state, slots = _case(torch.float32, "cpu")
    with pytest.raises(ValueError, match="conv_state"):
        kda_decode(qkv, raw, b, cw, conv_state[:, :2], A_log, dt_bias, None, state, slots)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, 1.0, state, slots)
    o = kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots)  # the CPU twin
    assert o.shape == (3, H, V)
    nw, gate, eps = _out_norm((qkv,))
    with pytest.raises(ValueError, match="out_norm"):
        kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots, out_norm=(nw[1:], gate, eps))
    y = kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots, out_norm=(nw, gate, eps))
    assert y.shape == (3, H, V) and not torch.equal(y, o)


def _check_gate_proj(dtype: torch.dtype, device: str, lower_bound: float | None, config=None,
                     widths: tuple[int, int] = (8, 12)) -> None:
    """The gates' second projections inside the launch (``gate_proj``, ``out_gate_proj``) against the twin fed
    the logits of a separate ``naive_linear``: the same values, the logits rounded to the dtype in both. Low-rank
    widths (KF, VF) unlike K and V, by default one not a power of two; equal ones (as the model's) run both
    matvecs in one loop."""
    from kda_sessions.kernels.kda.decode_triton import kda_decode_triton
    from kda_sessions.kernels.linear import naive_linear

    qkv, _, b, cw, conv_state, A_log, dt_bias, state, slots = _case(dtype, device)
    gen = torch.Generator().manual_seed(11)
    KF, VF = widths
    fa = torch.randn(qkv.shape[0], KF + VF + 3, generator=gen).to(device, dtype)  # f_a | g_a, strided slices
    w_fb = (torch.randn(H * K, KF, generator=gen) * 0.5).to(device, dtype)
    w_gb = (torch.randn(H * V, VF, generator=gen) * 0.5).to(device, dtype)
    nw = (torch.rand(V, generator=gen) + 0.5).to(device)
    f, g = fa[:, :KF], fa[:, KF : KF + VF]
    s1, c1 = state.clone(), conv_state.clone()
    out = kda_decode_triton(qkv, f, b, cw, c1, A_log, dt_bias, lower_bound, s1, slots, K**-0.5, (nw, g, 1e-5),
                            w_fb, w_gb, config)
    cpu = [t.cpu() for t in (qkv, f, g, b, cw, conv_state, A_log, dt_bias, state, slots, w_fb, w_gb, nw)]
    qkv, f, g, b, cw, c2, A_log, dt_bias, s2, slots, w_fb, w_gb, nw = cpu
    o = naive_kda_decode(qkv, naive_linear(f, w_fb), b, cw, c2, A_log, dt_bias, lower_bound, s2, slots, K**-0.5)
    ref = naive_gated_rms_norm(o, nw, naive_linear(g, w_gb).reshape(-1, H, V), 1e-5, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == ref.shape and rel_rms(out.cpu(), ref) < tol
    assert rel_rms(s1.cpu(), s2) < tol
    assert torch.equal(c1.cpu(), c2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["standard", "bounded"])
@pytest.mark.parametrize("widths", [(8, 12), (16, 16)], ids=["kf8-vf12", "kf16-vf16"])
def test_gate_projections_in_the_launches(dtype, lower_bound, widths):
    _check_gate_proj(dtype, DEV, lower_bound, widths=widths)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [None, (16, 1), (128, 4)], ids=["default", "bv16", "bv128"])
def test_gate_projections_in_the_launches_on_cuda(dtype, config):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_gate_proj(dtype, "cuda", None, config)
    _check_gate_proj(dtype, "cuda", None, config, widths=(128, 128))


def test_public_function_checks_gate_proj_shapes():
    qkv, raw, b, cw, conv_state, A_log, dt_bias, state, slots = _case(torch.float32, "cpu")
    w = torch.randn(H * K, 8)
    with pytest.raises(ValueError, match="raw"):  # raw must then be [N, KF]
        kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots, gate_proj=w)
    o = kda_decode(qkv, raw[:, :8], b, cw, conv_state, A_log, dt_bias, None, state, slots, gate_proj=w)
    assert o.shape == (3, H, V)
    with pytest.raises(ValueError, match="out_gate_proj"):
        kda_decode(qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots, out_gate_proj=w)


def _pdl_layers(steps: int, graph: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A chain of KDA layers at the 48B shape (one sequence) as the model's decode runs them: the input matvec,
    ``kda_decode`` with the gates' projections inside and ``pdl``, the output matvec, whose output is the next
    layer's input; ``steps`` steps, eagerly or as replays of one CUDA graph. Returns (each step's output, the
    states, the conv tails)."""
    from kda_sessions.kernels.linear import linear

    D_, H_, K_ = 2304, 32, 128
    Dc_ = 3 * H_ * K_
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen) * scale

    layers = []
    for _ in range(4):
        layers.append({
            "w_in": randn(Dc_ + 2 * K_ + H_, D_, scale=D_**-0.5).bfloat16(),
            "w_o": randn(D_, H_ * K_, scale=(H_ * K_) ** -0.5).bfloat16(),
            "cw": randn(Dc_, 4, scale=0.5).bfloat16(), "fb": randn(H_ * K_, K_, scale=K_**-0.5).bfloat16(),
            "gb": randn(H_ * K_, K_, scale=K_**-0.5).bfloat16(), "nw": randn(K_).abs() + 0.5,
            "A_log": torch.log(torch.rand(H_, device="cuda", generator=gen) * 15 + 1),
            "dt": randn(H_ * K_, scale=0.5) - 2.0,
            "state": randn(2, H_, K_, K_, scale=0.1), "conv": randn(2, 3, Dc_).bfloat16(),
        })
    slots = torch.tensor([1], device="cuda")
    x0 = randn(1, D_).bfloat16()

    def step(x: torch.Tensor) -> torch.Tensor:
        for L in layers:
            y = linear(x, L["w_in"])
            qkv, fa, ga, b = y[:, :Dc_], y[:, Dc_ : Dc_ + K_], y[:, Dc_ + K_ : Dc_ + 2 * K_], y[:, Dc_ + 2 * K_ :]
            o = kda_decode(qkv, fa, b, L["cw"], L["conv"], L["A_log"], L["dt"], None, L["state"], slots,
                           out_norm=(L["nw"], ga, 1e-5), gate_proj=L["fb"], out_gate_proj=L["gb"], pdl=True)
            x = linear(o.reshape(1, H_ * K_), L["w_o"])
        return x

    outs = []
    if graph:
        step(x0.clone())  # compile outside the capture (the pools are reset below)
        g = torch.cuda.CUDAGraph()
        inp = x0.clone()
        with torch.cuda.graph(g):
            out = step(inp)
        for L, fresh in zip(layers, _pdl_fresh_pools(len(layers))):
            L["state"].copy_(fresh[0])
            L["conv"].copy_(fresh[1])
        for _ in range(steps):
            g.replay()
            outs.append(out.clone())
            inp.copy_(out)
    else:
        for L, fresh in zip(layers, _pdl_fresh_pools(len(layers))):
            L["state"].copy_(fresh[0])
            L["conv"].copy_(fresh[1])
        x = x0
        for _ in range(steps):
            x = step(x)
            outs.append(x.clone())
    torch.cuda.synchronize()
    return outs, [L["state"] for L in layers], [L["conv"] for L in layers]


def _pdl_fresh_pools(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(9)
    return [(torch.randn(2, 32, 128, 128, device="cuda", generator=gen) * 0.1,
             torch.randn(2, 3, 3 * 32 * 128, device="cuda", generator=gen).bfloat16()) for _ in range(n)]


@pytest.mark.gpu
def test_pdl_launches_in_a_graph_match_plain_launches():
    """The model's KDA decode chain with PDL (Hopper: the matvecs and the decode launch start early, the
    matvecs load their weights before they wait) as CUDA-graph replays, against the same chain with PDL off,
    eagerly: each step's output, the states and the tails agree (a launch reading its input before the launch
    before wrote it would give another step's values)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels.moe import pdl

    pdl.ENABLED = False
    try:
        ref_outs, ref_states, ref_conv = _pdl_layers(4, graph=False)
    finally:
        pdl.ENABLED = True
    outs, states, conv = _pdl_layers(4, graph=True)
    for o, r in zip(outs, ref_outs):
        assert rel_rms(o.float(), r.float()) < 1e-2
    for s, r in zip(states, ref_states):
        assert rel_rms(s, r) < 1e-3
    for c, r in zip(conv, ref_conv):
        assert torch.equal(c, r)
    assert rel_rms(outs[-1].float(), outs[0].float()) > 0.1  # the steps differ: a stale read would show


@pytest.mark.parametrize("norm", [False, True], ids=["o", "gated-norm"])
def test_a_batch_above_the_grid_limit_runs_in_several_launches(monkeypatch, norm):
    """More sequences than the grid's second axis holds (``MAX_GRID_Y`` // H, lowered here to 1 and 2 a launch)
    give what one launch gives: every row's output, state and tails, the untouched slots left as they were."""
    from kda_sessions.kernels.kda import decode_triton

    case = _case(torch.float32, DEV)
    out_norm = _out_norm(case) if norm else None
    whole = _run(lambda *a: decode_triton.kda_decode_triton(*a, out_norm), case, -5.0)
    inner = decode_triton.kda_decode_triton
    batches: list[int] = []

    def counted(qkv, *a, **k):
        batches.append(qkv.shape[0])
        return inner(qkv, *a, **k)

    monkeypatch.setattr(decode_triton, "kda_decode_triton", counted)
    for per, launches in ((1, [3, 1, 1, 1]), (2, [3, 2, 1])):
        monkeypatch.setattr(decode_triton, "MAX_GRID_Y", per * H)
        batches.clear()
        split = _run(lambda *a: decode_triton.kda_decode_triton(*a, out_norm), case, -5.0)
        assert batches == launches  # the whole batch, then one call per launch of at most `per` sequences
        assert split[0].shape == whole[0].shape
        for a, b in zip(split, whole):
            assert rel_rms(a, b) < 1e-6
        assert torch.equal(split[1], whole[1]) and torch.equal(split[2][[1, 3, 5]], case[7][[1, 3, 5]])
