"""Triton short conv and MLA paged decode against their twins, under TRITON_INTERPRET=1.

Tolerance: relative RMS error 1e-5 (float32), 1e-3 (float16 inputs and output; the "tokens" form of MLA decode
keeps its partials in float16 too). Half precision is tested as float16: Triton 3.9's interpreter gets even a
bfloat16 load-multiply-store wrong, so bfloat16 is checked on the GPU only (bench/kernels.py --only checkmla)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.conv.naive import naive_causal_conv
from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

from .kernel_helpers import rel_rms

TOL = 1e-5
TOL_HALF = 1e-3


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


@pytest.mark.parametrize("plane", [0, 16, 64])
def test_conv_reads_strided_rows_and_writes_planes(plane):
    """x as columns of a wider projection (rows 72 apart) and y as [D // plane, T, plane] (KDA's q, k, v each
    contiguous; plane 16 under a column block of 32: the block shrinks to the plane), on both paths, with tails."""
    from kda_sessions.kernels.conv import causal_conv
    from kda_sessions.kernels.conv.triton_conv import causal_conv_triton

    gen = torch.Generator().manual_seed(3)
    D, W = 64, 4
    cu = torch.tensor([0, 3, 11, 20])
    wide = torch.randn(20, D + 8, generator=gen)
    x = wide[:, 4 : 4 + D]  # row stride D + 8
    w = torch.randn(D, W, generator=gen)
    tail = torch.randn(3, W - 1, D, generator=gen)
    pos = [[2], [], [1, 9]]
    ry, rt, rck = naive_causal_conv(x.contiguous(), w, tail, cu, pos)
    want = ry.view(20, -1, plane).transpose(0, 1) if plane else ry
    for fn in (causal_conv_triton, causal_conv):
        y, t, ck = fn(x, w, tail, cu, pos, plane)
        assert y.shape == want.shape and y.is_contiguous() and rel_rms(y, want) < TOL
        assert torch.equal(t, rt) and torch.equal(ck, rck)


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
    # the twin's decode path (all sequences at once) against its per-sequence path (forced by tail positions)
    ly, lt, _ = naive_causal_conv(x, w, tail, cu, [[] for _ in range(5)])
    assert rel_rms(ry, ly) < 1e-6 and torch.equal(rt, lt) and ry.dtype == ly.dtype


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


def _mla_inputs(lens: list[int], P: int, max_pages: int | None = None, dtype: torch.dtype = torch.float32):
    """(q_lat [N, 4, 32], q_pe [N, 4, 16], kv_pages, page_table [N, max_pages], seq_lens [N]) over a shuffled
    pool whose rows past each sequence's end are NaN, and whose table entries past a sequence's pages name a
    page of NaN: a read past the end, or a split past it that the merge does not ignore, shows in the output."""
    gen = torch.Generator().manual_seed(len(lens) * 100 + P)
    N, H, R, DR = len(lens), 4, 32, 16
    need = [-(-L // P) for L in lens]
    max_pages = max_pages or max(need)
    used = sum(need)
    kv = torch.randn(used + 1, P, R + DR, generator=gen)
    kv[used] = float("nan")
    pages = torch.randperm(used, generator=gen).int()
    pt = torch.full((N, max_pages), used, dtype=torch.int32)
    for n, (L, k) in enumerate(zip(lens, need)):
        pt[n, :k] = pages[sum(need[:n]) : sum(need[:n]) + k]
        kv[pt[n, k - 1], L - (k - 1) * P :] = float("nan")
    ql, qp = torch.randn(N, H, R, generator=gen), torch.randn(N, H, DR, generator=gen)
    return ql.to(dtype), qp.to(dtype), kv.to(dtype), pt, torch.tensor(lens)


# (lens, P, table width, num_splits): one sequence, three, nine (eight waves of splits by default), and short
# sequences in a wide table split 16 ways (64-token splits: at most 2 of 16 hold tokens)
MLA_CASES = {
    "N1-P16": ([300], 16, None, None),
    "N3-P64": ([1, 37, 80], 64, None, None),
    "N3-P16-3splits": ([1, 37, 80], 16, None, 3),
    "N9-P16": ([1, 2, 5, 17, 33, 64, 65, 100, 7], 16, None, None),
    "empty-splits-P16": ([1, 5, 70], 16, 64, 16),
    "empty-splits-P64": ([1, 5, 70], 64, 16, 16),
}


@pytest.mark.parametrize("form", [None, "heads", "tokens"], ids=lambda f: f or "by-N")
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_decode_paged_forms(case, form):
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    lens, P, max_pages, num_splits = MLA_CASES[case]
    ql, qp, kv, pt, sl = _mla_inputs(lens, P, max_pages)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, num_splits, form=form)
    assert not o.isnan().any()
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, 0.1)) < TOL


@pytest.mark.parametrize("form", ["heads", "tokens"])
@pytest.mark.parametrize("lens", [[300], [1, 37, 80]], ids=["N1", "N3"])
def test_mla_decode_paged_half(lens, form):
    """float16 q and cache: the "tokens" form stores float16 partials."""
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    ql, qp, kv, pt, sl = _mla_inputs(lens, 16, 64, dtype=torch.float16)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, 8, form=form)
    assert o.dtype == torch.float16
    assert rel_rms(o, naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, 0.1)) < TOL_HALF


@pytest.mark.parametrize("N,form", [(1, "tokens"), (7, "tokens"), (8, "tokens")], ids=lambda x: str(x))
def test_mla_decode_paged_dispatch_by_n(N, form):
    """Every N runs the "tokens" form: the same bits as forcing it."""
    from kda_sessions.kernels.mla.paged_decode import _default_form, mla_decode_paged_triton

    assert _default_form(N) == form
    ql, qp, kv, pt, sl = _mla_inputs([1 + 9 * n for n in range(N)], 16)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1)
    assert torch.equal(o, mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, form=form))


@pytest.mark.parametrize("P", [16, 64])
def test_mla_decode_paged_tokens_form_long_splits(P):
    """Splits of many tiles in the "tokens" form (BN 64, 4 warps, 2 stages at every split length): 2 splits of a
    1,024-token table, sequences ending inside the first split, in the second and at the table's end."""
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    ql, qp, kv, pt, sl = _mla_inputs([200, 700, 1024], P, 1024 // P)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, 2)
    assert not o.isnan().any()
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, 0.1)) < TOL
    # the same bits as those tiles asked for explicitly; other tiles (the earlier long-split default) agree
    from kda_sessions.kernels.mla.paged_decode import _launch

    args = (ql, qp, kv, pt, sl, 0.1, 2)
    assert torch.equal(o, _launch(*args, BN=64, num_warps=4, num_stages=2, form="tokens"))
    assert rel_rms(_launch(*args, BN=32, num_warps=4, num_stages=3, form="tokens"), o) < TOL


def test_mla_decode_paged_tokens_split_counts():
    """One wave of the GPU below 8 sequences, ``many_waves`` from 8 up (eight for the Triton kernel, two for the
    Gluon one), rounded down to whole waves, at least 256 tokens of capacity per split (the counts measured on the
    H200's 132 SMs)."""
    from kda_sessions.kernels.mla.paged_decode import _num_splits_tokens

    assert _num_splits_tokens(1, 1 << 20, 132) == 132
    assert _num_splits_tokens(1, 1 << 15, 132) == 128  # capacity-bound: 256 tokens per split
    assert _num_splits_tokens(7, 1 << 20, 132) == 18  # 126 programs: not a second wave of 7
    assert _num_splits_tokens(32, 1 << 15, 132) == 33
    assert _num_splits_tokens(32, 1 << 15, 132, many_waves=2) == 8  # 256 programs, not 9 splits' 288
    assert _num_splits_tokens(300, 1 << 15, 132, many_waves=2) == 1
    assert _num_splits_tokens(1, 100, 132) == 1


def test_mla_decode_paged_rejects_unknown_form():
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    ql, qp, kv, pt, sl = _mla_inputs([5], 16)
    with pytest.raises(ValueError, match="form must be one of"):
        mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, form="rows")


def test_mla_decode_paged_tokens_merge_over_many_splits():
    """Below 8 sequences the merge reads the splits 16 .. 256 at a time in one running pass: 300 splits of one
    64-token tile each (two passes, the second partly masked), most of them past the sequence's end. One
    sequence: each split is a program in the interpreter (the forms tests above run several sequences)."""
    from kda_sessions.kernels.mla.paged_decode import mla_decode_paged_triton

    ql, qp, kv, pt, sl = _mla_inputs([1000], 16, 300 * 64 // 16)
    o = mla_decode_paged_triton(ql, qp, kv, pt, sl, 0.1, 300, form="tokens")
    assert not o.isnan().any()
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, 0.1)) < TOL
