"""Views the decode kernels' public functions accept and their Triton launches must read right (found in a review
of issue 26's kernels): a beta of column stride 2, non-contiguous slots and cache rows, a strided norm weight.
Each test takes one of two answers: the public function refuses the input with a ValueError, or the launch
computes what the twin computes. The launches run under TRITON_INTERPRET=1 here, as on a CUDA device; the public
functions run their CPU twins. None of these views is one the model passes. Likewise the residual-add-and-norm
functions with a residual in another dtype than x: every path returns x's dtype.

Tolerance: relative RMS 1e-5, float32 (the same sums in another order); a wrong read is off by O(1)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kda_sessions.kernels.kda.decode import kda_decode, naive_kda_decode
from kda_sessions.kernels.mla import mla_decode_prep, naive_mla_decode_prep

from .kernel_helpers import rel_rms

TOL = 1e-5


def _refused(call: Callable[[], object]) -> bool:
    """Whether the public function refuses the input with a ValueError (on a CPU it otherwise runs the twin)."""
    try:
        call()
    except ValueError:
        return True
    return False


def _kda_case(b_col_stride: int, slots: torch.Tensor):
    """KDA decode inputs of 3 sequences (H 2, K 16, V 32, W 4, pool of 6 slots); b [N, H] taken with the given
    column stride from one projection output."""
    gen = torch.Generator().manual_seed(26)
    H, K, V, W, S, N = 2, 16, 32, 4, 6, 3
    Dc = 2 * H * K + H * V
    y = torch.randn(N, Dc + H * K + H * b_col_stride, generator=gen)
    qkv, raw = y[:, :Dc], y[:, Dc : Dc + H * K]
    b = y[:, Dc + H * K :: b_col_stride]  # [N, H]
    cw = torch.randn(Dc, W, generator=gen) * 0.5
    conv_state = torch.randn(S, W - 1, Dc, generator=gen)
    state = torch.randn(S, H, K, V, generator=gen) * 0.1
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 - 2.0
    return qkv, raw, b, cw, conv_state, A_log, dt_bias, None, state, slots


def _check_kda(case) -> None:
    from kda_sessions.kernels.kda.decode_triton import kda_decode_triton

    qkv, raw, b, cw, conv_state, A_log, dt_bias, lb, state, slots = case
    if _refused(lambda: kda_decode(qkv, raw, b, cw, conv_state.clone(), A_log, dt_bias, lb, state.clone(), slots)):
        return
    c1, s1, c2, s2 = conv_state.clone(), state.clone(), conv_state.clone(), state.clone()
    scale = 16**-0.5
    o = kda_decode_triton(qkv, raw, b, cw, c1, A_log, dt_bias, lb, s1, slots, scale)
    ref = naive_kda_decode(qkv, raw, b, cw, c2, A_log, dt_bias, lb, s2, slots, scale)
    assert rel_rms(o, ref) < TOL and rel_rms(s1, s2) < TOL and torch.equal(c1, c2)


def test_kda_decode_takes_or_refuses_a_beta_with_a_column_stride():
    _check_kda(_kda_case(b_col_stride=2, slots=torch.tensor([4, 0, 2])))


def test_kda_decode_takes_or_refuses_non_contiguous_slots():
    slots = torch.tensor([4, 1, 5, 2, 3, 0])[::2]  # [4, 5, 3], stride 2
    _check_kda(_kda_case(b_col_stride=1, slots=slots))


def _prep_case(kv_rows: torch.Tensor, norm_w_stride: int):
    """MLA decode_prep inputs of 3 sequences (H 2, dn 16, dr 8, dv 16, r 32; 4 pages of 8 rows)."""
    gen = torch.Generator().manual_seed(26)
    H, dn, dr, dv, r = 2, 16, 8, 16, 32
    y = torch.randn(3, H * (dn + dr) + r + dr, generator=gen)
    w = torch.randn(H * (dn + dv), r, generator=gen) * dn**-0.5
    norm_w = (torch.rand(r * norm_w_stride, generator=gen) + 0.5)[::norm_w_stride]
    kv = torch.randn(4, 8, r + dr, generator=gen)
    return y, w, norm_w, 1e-6, kv, kv_rows, H, dn


def _check_prep(case) -> None:
    from kda_sessions.kernels.mla.decode_prep import mla_decode_prep_triton

    y, w, norm_w, eps, kv, rows, H, dn = case
    if _refused(lambda: mla_decode_prep(y, w, norm_w, eps, kv.clone(), rows, H, dn)):
        return
    kv1, kv2 = kv.clone(), kv.clone()
    q1, pe1 = mla_decode_prep_triton(y, w, norm_w, eps, kv1, rows, H, dn)
    q2, pe2 = naive_mla_decode_prep(y, w, norm_w, eps, kv2, rows, H, dn)
    assert rel_rms(q1, q2) < TOL and torch.equal(pe1, pe2)
    assert rel_rms(kv1, kv2) < TOL  # the new rows where they belong, every other row untouched


def test_mla_decode_prep_takes_or_refuses_non_contiguous_kv_rows():
    rows = torch.tensor([3, 9, 17, 1, 30, 2])[::2]  # [3, 17, 30], stride 2
    _check_prep(_prep_case(rows, norm_w_stride=1))


def test_mla_decode_prep_takes_or_refuses_a_strided_norm_weight():
    _check_prep(_prep_case(torch.tensor([3, 17, 30]), norm_w_stride=2))


def _mixed_dtype_call(fn: str):
    """One of the residual-add-and-norm public functions on x [1, 32] bfloat16 with the residual in float32."""
    from kda_sessions.kernels.moe import add_norm_route, fused_moe_add_norm
    from kda_sessions.kernels.norm import add_rms_norm

    gen = torch.Generator().manual_seed(26)
    E, k, D, F = 8, 2, 32, 16
    x = torch.randn(1, D, generator=gen).bfloat16()
    res = torch.randn(1, D, generator=gen)  # float32
    nw = torch.rand(D, generator=gen) + 0.5
    if fn == "add_rms_norm":
        return lambda: add_rms_norm(x, res, nw, 1e-6), x
    if fn == "add_norm_route":
        gate = (torch.randn(E, D, generator=gen) / D**0.5).bfloat16()
        return lambda: add_norm_route(x, res, nw, 1e-6, gate, torch.zeros(E), k, True, 1.0)[:2], x
    w13 = (torch.randn(E, 2 * F, D, generator=gen) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=gen) / F**0.5).bfloat16()
    chosen, weights = torch.tensor([[1, 5]]), torch.rand(1, k, generator=gen).bfloat16()
    return lambda: fused_moe_add_norm(x, w13, w2, chosen, weights, res, nw, 1e-6), x


@pytest.mark.parametrize("fn", ["add_rms_norm", "add_norm_route", "fused_moe_add_norm"])
def test_residual_norms_give_x_dtype_or_refuse_a_residual_of_another_dtype(fn: str):
    call, x = _mixed_dtype_call(fn)
    if _refused(call):
        return
    s, h = call()
    assert s.dtype == x.dtype and h.dtype == x.dtype
