"""``mla_decode_prep`` (the latent's norm and page write, the absorbed query: one Triton launch) against its twin,
the separate ops; under TRITON_INTERPRET=1 at small shapes on a CPU, at the 48B shape with ``-m gpu``.

Tolerance: relative RMS 1e-6 for float32; 8e-3 for bfloat16 (both round the same float32 values, and only
results within a sum-order error of a rounding boundary differ, by one ulp)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.mla import mla_decode_prep, naive_mla_decode_prep

from .kernel_helpers import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted without one


def _case(H: int, dn: int, dr: int, dv: int, r: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(H + r)
    N, P = 3, 8
    y = torch.randn(N, H * (dn + dr) + r + dr + 5, generator=gen).to(dtype)[:, 5:]  # a strided column slice
    w = (torch.randn(H * (dn + dv), r, generator=gen) * dn**-0.5).to(dtype)
    nw = torch.rand(r, generator=gen) + 0.5
    kv = torch.randn(4, P, r + dr, generator=gen).to(dtype)
    rows = torch.tensor([3, 17, 30])
    return [t.to(device) for t in (y, w, nw, kv, rows)]


def _check(H: int, dn: int, dr: int, dv: int, r: int, dtype: torch.dtype, device: str) -> None:
    y, w, nw, kv, rows = _case(H, dn, dr, dv, r, dtype, device)
    ref_kv = kv.cpu().clone()
    q_lat, q_pe = mla_decode_prep(y, w, nw, 1e-6, kv, rows, H, dn)
    r_lat, r_pe = naive_mla_decode_prep(y.cpu(), w.cpu(), nw.cpu(), 1e-6, ref_kv, rows.cpu(), H, dn)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert q_lat.shape == (3, H, r) and q_pe.shape == (3, H, dr) and q_lat.dtype == dtype
    assert rel_rms(q_lat.cpu(), r_lat) < tol
    assert torch.equal(q_pe.cpu(), r_pe)  # copied
    assert rel_rms(kv.cpu(), ref_kv) < tol  # the three new rows; every other row untouched:
    untouched = torch.ones(kv.shape[0] * kv.shape[1], dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(kv.cpu().view(-1, kv.shape[-1])[untouched], ref_kv.view(-1, kv.shape[-1])[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_prep_matches_the_twin(dtype):
    from kda_sessions.kernels.mla.decode_prep import mla_decode_prep_triton

    y, w, nw, kv, rows = _case(2, 16, 8, 16, 32, dtype, DEV)
    ref_kv = kv.cpu().clone()
    q_lat, q_pe = mla_decode_prep_triton(y, w, nw, 1e-6, kv, rows, 2, 16)
    r_lat, r_pe = naive_mla_decode_prep(y.cpu(), w.cpu(), nw.cpu(), 1e-6, ref_kv, rows.cpu(), 2, 16)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert rel_rms(q_lat.cpu(), r_lat) < tol and torch.equal(q_pe.cpu(), r_pe)
    assert rel_rms(kv.cpu(), ref_kv) < tol


def test_decode_prep_checks_shapes():
    y, w, nw, kv, rows = _case(2, 16, 8, 16, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="y must be"):
        mla_decode_prep(y[:, 1:], w, nw, 1e-6, kv, rows, 2, 16)
    with pytest.raises(ValueError, match="contiguous"):
        mla_decode_prep(y, w, nw, 1e-6, kv[:, :4], rows, 2, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_prep_matches_the_twin_on_cuda(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(32, 128, 64, 128, 512, dtype, "cuda")  # Kimi-Linear's MLA
