"""Triton short conv and MLA paged decode against their twins, under TRITON_INTERPRET=1.

Tolerance: relative RMS error 1e-5 (float32)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.conv.naive import naive_causal_conv
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

from .kernel_helpers import rel_rms

TOL = 1e-5


def test_conv_prefill_varlen_with_tail_positions():
    from kda_sessions.kernels.conv.triton_conv import causal_conv_triton

    gen = torch.Generator().manual_seed(0)
    D, W = 48, 4
    cu = torch.tensor([0, 2, 3, 9, 30])
    x = torch.randn(30, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    tail = torch.randn(4, W - 1, D, generator=gen)
    pos = [[1, 2], [], [3, 6], [21]]
    y, t, ck = causal_conv_triton(x, w, tail, cu, pos)
    ry, rt, rck = naive_causal_conv(x, w, tail, cu, pos)
    assert rel_rms(y, ry) < TOL and torch.equal(t, rt) and torch.equal(ck, rck)


def test_conv_empty_sequence_keeps_its_tail():
    """A sequence with no new token inside cu_seqlens: no output rows, its tail unchanged, on both paths."""
    from kda_sessions.kernels.conv.triton_conv import causal_conv_triton

    gen = torch.Generator().manual_seed(2)
    D, W = 16, 4
    cu = torch.tensor([0, 2, 2, 5])
    x = torch.randn(5, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    tail = torch.randn(3, W - 1, D, generator=gen)
    pos = [[1], [0], [3]]
    ry, rt, rck = naive_causal_conv(x, w, tail, cu, pos)
    assert ry.shape == (5, D) and torch.equal(rt[1], tail[1]) and torch.equal(rck[1], tail[1])
    y, t, ck = causal_conv_triton(x, w, tail, cu, pos)
    assert rel_rms(y, ry) < TOL and torch.equal(t, rt) and torch.equal(ck, rck)


def test_conv_decode():
    from kda_sessions.kernels.conv.triton_conv import causal_conv_triton

    gen = torch.Generator().manual_seed(1)
    D, W = 40, 4
    x = torch.randn(5, D, generator=gen)
    w = torch.randn(D, W, generator=gen)
    tail = torch.randn(5, W - 1, D, generator=gen)
    cu = torch.arange(6)
    y, t, ck = causal_conv_triton(x, w, tail, cu)
    ry, rt, _ = naive_causal_conv(x, w, tail, cu)
    assert ck is None and rel_rms(y, ry) < TOL and torch.equal(t, rt)


@pytest.mark.parametrize("P,num_splits", [(8, None), (8, 1), (16, 3), (4, 7)], ids=lambda x: str(x))
def test_mla_decode_paged(P, num_splits):
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    gen = torch.Generator().manual_seed(2)
    N, H, R, DR = 3, 4, 32, 16
    lens = [1, 37, 80]
    max_pages = -(-max(lens) // P)
    kv = torch.randn(N * max_pages + 2, P, R + DR, generator=gen)
    pt = torch.randperm(N * max_pages + 2, generator=gen)[: N * max_pages].view(N, max_pages).int()
    sl = torch.tensor(lens)
    ql, qp = torch.randn(N, H, R, generator=gen), torch.randn(N, H, DR, generator=gen)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, num_splits)
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, 0.1)) < TOL
