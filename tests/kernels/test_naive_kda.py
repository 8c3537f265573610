"""The chunked WY form against the token-by-token recurrence, and the special cases of KDA.md."""

import pytest
import torch

from kda_sessions.kernels import chunk_kda, fused_recurrent_kda, kda_gate
from kda_sessions.kernels.kda.naive import l2norm, naive_chunk_kda, naive_recurrent_kda


def rel_err(a, b):
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def inputs(B, T, H, K, V, seed, bounded=False):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g_)
    k = torch.randn(B, T, H, K, generator=g_)
    v = torch.randn(B, T, H, V, generator=g_)
    raw = torch.randn(B, T, H, K, generator=g_)
    A_log = torch.randn(H, generator=g_)
    dt_bias = torch.randn(H * K, generator=g_)
    g = kda_gate(raw, A_log, dt_bias, -5.0 if bounded else None)
    beta = torch.rand(B, T, H, generator=g_)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 130], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("bounded", [False, True], ids=["standard", "bounded"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["fresh", "h0"])
def test_chunk_matches_recurrent(T, bounded, with_h0):
    q, k, v, g, beta = inputs(2, T, 3, 16, 24, seed=T, bounded=bounded)
    h0 = torch.randn(2, 3, 16, 24) if with_h0 else None
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, f1, _ = naive_recurrent_kda(q, k, v, g, beta, **kw)
    for chunk in (16, 32, 64):  # the default (16), and chunks shorter and longer than T
        o2, f2, _ = naive_chunk_kda(q, k, v, g, beta, chunk_size=chunk, **kw)
        assert rel_err(o2, o1) < 1e-5 and rel_err(f2, f1) < 1e-5


def test_varlen_and_checkpoint_positions():
    lens = [7, 64, 100]
    q, k, v, g, beta = inputs(1, sum(lens), 2, 16, 16, seed=5)
    cu = torch.tensor([0, 7, 71, 171])
    h0 = torch.randn(3, 2, 16, 16)
    cps = [[3, 7], [1, 64], [50, 63, 64, 65, 100]]
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o1, f1, c1 = naive_recurrent_kda(q, k, v, g, beta, checkpoint_positions=cps, **kw)
    o2, f2, c2 = naive_chunk_kda(q, k, v, g, beta, checkpoint_positions=cps, **kw)
    o3, _, _ = naive_chunk_kda(q, k, v, g, beta, **kw)
    assert c1.shape == (9, 2, 16, 16)
    assert rel_err(o2, o1) < 1e-5 and rel_err(f2, f1) < 1e-5 and rel_err(c2, c1) < 1e-5
    assert torch.equal(o2, o3)  # asking for checkpoints never changes the output
    # the state at a sequence's end is its final state
    assert torch.allclose(c1[1], f1[0]) and torch.allclose(c1[3], f1[1]) and torch.allclose(c1[8], f1[2])
    # each varlen sequence equals running it alone
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        o_alone, _, _ = naive_recurrent_kda(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=h0[n : n + 1], use_qk_l2norm_in_kernel=True
        )
        assert rel_err(o1[:, sl], o_alone) < 1e-6


def test_beta_one_overwrites_exactly():
    H, K, V = 2, 8, 5
    S = torch.randn(1, H, K, V)
    k = l2norm(torch.randn(1, 1, H, K))
    v = torch.randn(1, 1, H, V)
    g = torch.zeros(1, 1, H, K)
    _, S1, _ = naive_recurrent_kda(k, k, v, g, torch.ones(1, 1, H), initial_state=S, output_final_state=True)
    read = torch.einsum("hk,hkv->hv", k[0, 0], S1[0])
    assert torch.allclose(read, v[0, 0], atol=1e-5)


def test_zero_gate_is_deltanet_and_zero_beta_only_decays():
    H, K, V, T = 1, 4, 3, 6
    q, k, v, _, beta = inputs(1, T, H, K, V, seed=9)
    k = l2norm(k)
    S = torch.zeros(K, V)
    for t in range(T):  # plain DeltaNet: S += beta k (v - S^T k)^T
        S = S + beta[0, t, 0] * torch.outer(k[0, t, 0], v[0, t, 0] - S.t() @ k[0, t, 0])
    _, f, _ = naive_recurrent_kda(q, k, v, torch.zeros(1, T, H, K), beta, output_final_state=True)
    assert torch.allclose(f[0, 0], S, atol=1e-6)
    h0 = torch.randn(1, H, K, V)
    g = -torch.rand(1, T, H, K)
    _, f, _ = naive_recurrent_kda(q, k, v, g, torch.zeros(1, T, H), initial_state=h0, output_final_state=True)
    assert torch.allclose(f, h0 * g.sum(1).exp()[..., None], atol=1e-6)


def test_pool_decode_updates_only_its_slots():
    q, k, v, g, beta = inputs(1, 3, 2, 8, 8, seed=11)
    pool = torch.randn(5, 2, 8, 8)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    o, _ = fused_recurrent_kda(
        q, k, v, g, beta, cu_seqlens=torch.tensor([0, 1, 2, 3]), use_qk_l2norm_in_kernel=True,
        state_pool=pool, slot_indices=slots,
    )
    o_ref, f_ref, _ = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=before[slots], output_final_state=True,
        cu_seqlens=torch.tensor([0, 1, 2, 3]), use_qk_l2norm_in_kernel=True,
    )
    assert torch.equal(o, o_ref) and torch.equal(pool[slots], f_ref)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_bad_shapes_are_named():
    q, k, v, g, beta = inputs(1, 4, 2, 8, 8, seed=1)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 7))
    with pytest.raises(ValueError, match="checkpoint_positions"):
        chunk_kda(q, k, v, g, beta, checkpoint_positions=[[5]])


def test_chunk_differentiates_and_matches_its_inference_path():
    """Training on a CPU backpropagates through the chunk twin: the in-place inference path must not run then,
    and both paths give the same output."""
    q, k, v, g, beta = inputs(1, 40, 2, 16, 8, seed=9)
    with torch.no_grad():
        ref, _, _ = naive_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, _, _ = naive_chunk_kda(*leaves, use_qk_l2norm_in_kernel=True)
    o.square().sum().backward()
    assert torch.equal(o.detach(), ref)
    assert all(x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0 for x in leaves)
