"""The CPU inference conv (shifted multiply-adds) against the conv1d twin: ragged sequences, empty ones, tails."""

import pytest
import torch

from kda_sessions.kernels import causal_conv
from kda_sessions.kernels.conv.cpu import causal_conv_cpu
from kda_sessions.kernels.conv.naive import naive_causal_conv


@pytest.mark.parametrize("lens", [[1], [70], [0, 5, 1, 33, 3], [1, 1, 1]], ids=["T1", "T70", "ragged", "decode"])
def test_conv_cpu_matches_twin(lens):
    g = torch.Generator().manual_seed(len(lens))
    D, W, N = 24, 4, len(lens)
    x = torch.randn(sum(lens), D, generator=g)
    weight, tail = torch.randn(D, W, generator=g), torch.randn(N, W - 1, D, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    at = [sorted({p for p in (1, n // 2 + 1, n) if 1 <= p <= n}) for n in lens]
    for positions in (None, at):
        want = naive_causal_conv(x, weight, tail, cu, positions)
        got = causal_conv_cpu(x, weight, tail, cu, positions)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_causal_conv_uses_it_for_inference_only():
    x, weight, tail = torch.randn(9, 8), torch.randn(8, 4), torch.zeros(1, 3, 8)
    cu = torch.tensor([0, 9])
    with torch.no_grad():
        assert torch.equal(causal_conv(x, weight, tail, cu)[0], causal_conv_cpu(x, weight, tail, cu)[0])
    weight.requires_grad_(True)
    causal_conv(x, weight, tail, cu)[0].sum().backward()  # the twin: autograd through conv1d
    assert weight.grad is not None
