"""The batched CPU chunk form (``chunk_cpu``) against the token-by-token recurrence, strong decays included."""

import pytest
import torch

from kda_sessions.kernels import chunk_kda, kda_gate
from kda_sessions.kernels.kda.chunk_cpu import chunk_kda_cpu
from kda_sessions.kernels.kda.naive import naive_recurrent_kda


def rel_err(a, b):
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def inputs(T, H, K, V, seed, gate_scale):
    g_ = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, T, H, K, generator=g_), torch.randn(1, T, H, K, generator=g_)
    v = torch.randn(1, T, H, V, generator=g_)
    # gate_scale stretches the raw logits: at 8 some channels decay by e^-20 and more per token, so sub-chunk
    # factors fall below e^-40 and are flushed
    raw = torch.randn(1, T, H, K, generator=g_) * gate_scale
    g = kda_gate(raw, torch.randn(H, generator=g_), torch.randn(H * K, generator=g_), None)
    return q, k, v, g, torch.rand(1, T, H, generator=g_)


@pytest.mark.parametrize("gate_scale", [1.0, 8.0], ids=["mild", "strong"])
@pytest.mark.parametrize("lens", [[1], [37], [5, 64, 150], [1100]], ids=["T1", "T37", "varlen", "blocks"])
def test_chunk_cpu_matches_recurrent(lens, gate_scale):
    H, K, V = 2, 16, 24
    q, k, v, g, beta = inputs(sum(lens), H, K, V, seed=len(lens), gate_scale=gate_scale)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    h0 = torch.randn(len(lens), H, K, V)
    cps = [sorted({1, n // 2 + 1, n}) for n in lens]
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              checkpoint_positions=cps)
    o1, f1, c1 = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o2, f2, c2 = chunk_kda_cpu(q, k, v, g, beta, **kw)
    assert torch.isfinite(o2).all()
    assert rel_err(o2, o1) < 1e-5 and rel_err(f2, f1) < 1e-5 and rel_err(c2, c1) < 1e-5
    o3, _, _ = chunk_kda_cpu(q, k, v, g, beta, **{**kw, "checkpoint_positions": None})
    assert torch.equal(o2, o3)  # asking for checkpoints never changes the output


def test_chunk_cpu_leaves_the_thread_count():
    q, k, v, g, beta = inputs(40, 2, 16, 16, seed=4, gate_scale=1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        chunk_kda_cpu(q, k, v, g, beta)  # its sequential loop runs on one thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_chunk_kda_uses_it_for_inference_only():
    q, k, v, g, beta = inputs(40, 2, 16, 16, seed=3, gate_scale=1.0)
    with torch.no_grad():
        fast = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(fast, chunk_kda_cpu(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0])
    q.requires_grad_(True)
    o = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    o.sum().backward()  # the twin: autograd through every op
    assert q.grad is not None and rel_err(o.detach(), fast) < 1e-5
