"""Norm kernels against their twins under TRITON_INTERPRET=1: relative RMS error 1e-6 (float32), 1e-3 (float16);
bf16 on the GPU (gpu-marked) 1e-2."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm
from kda_sessions.kernels.norm.naive import naive_add_rms_norm, naive_gated_rms_norm, naive_rms_norm

from .kernel_helpers import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted without one


def on(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (2, 3, 64)], ids=["1x48", "7x100", "2x3x64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_rms_norm_matches_the_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from kda_sessions.kernels.norm.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen)
    y = rms_norm_triton(*on(x, w), 1e-5).cpu()
    ref = naive_rms_norm(x.float(), w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y, ref) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_rms_norm_of_a_strided_slice_and_validation() -> None:
    from kda_sessions.kernels.norm.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, generator=gen)
    xd = torch.randn(6, 80, generator=gen).to(DEV)[:, 16:]  # rows strided, last dimension contiguous
    x = xd.cpu()
    assert rel_rms(rms_norm_triton(xd, w.to(DEV), 1e-6).cpu(), naive_rms_norm(x, w, 1e-6)) < 1e-6
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w[:8], 1e-6)


@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (2, 3, 64)], ids=["1x48", "7x100", "2x3x64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_add_rms_norm_matches_the_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Both results: the sum exactly as x + h in x's dtype, the norm of that rounded sum."""
    from kda_sessions.kernels.norm.triton_norm import add_rms_norm_triton

    gen = torch.Generator().manual_seed(len(shape) + 10)
    x, h = ((torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=gen)
    s, y = (t.cpu() for t in add_rms_norm_triton(*on(x, h, w), 1e-5))
    rs, ry = naive_add_rms_norm(x, h, w, 1e-5)
    assert s.dtype == y.dtype == dtype and y.shape == x.shape
    assert torch.equal(s, rs)
    assert rel_rms(y, naive_rms_norm(rs.float(), w, 1e-5)) < (1e-6 if dtype == torch.float32 else 1e-3)
    cs, cy = add_rms_norm(x, h, w, 1e-5)  # the CPU path (F.rms_norm)
    assert torch.equal(cs, rs) and rel_rms(cy, ry) < 1e-3


@pytest.mark.parametrize("T,H,V", [(1, 3, 16), (5, 4, 24), (33, 2, 128)], ids=["1x3x16", "5x4x24", "33x2x128"])
def test_gated_rms_norm_matches_the_twin(T: int, H: int, V: int) -> None:
    from kda_sessions.kernels.norm.triton_norm import gated_rms_norm_triton

    gen = torch.Generator().manual_seed(T * V)
    o = torch.randn(T, H, V, generator=gen) * 2
    g = torch.randn(T, H, V, generator=gen) * 3
    w = torch.randn(V, generator=gen)
    ref = naive_gated_rms_norm(o, w, g, 1e-5, torch.float32)
    assert rel_rms(gated_rms_norm_triton(*on(o, w, g), 1e-5, torch.float32).cpu(), ref) < 1e-6
    y = gated_rms_norm_triton(*on(o, w, g.half()), 1e-5, torch.float16).cpu()
    assert y.dtype == torch.float16 and rel_rms(y, ref) < 1e-3
    with pytest.raises(ValueError, match="gate must have"):
        gated_rms_norm(o, w, g[:, :1], 1e-5, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("D", [512, 2304], ids=["D512", "D2304"])
def test_norms_bf16_on_the_gpu(D: int) -> None:
    gen = torch.Generator("cuda").manual_seed(D)
    x, h = (torch.randn(33, D, generator=gen, device="cuda").bfloat16() for _ in range(2))
    w = torch.randn(D, generator=gen, device="cuda").bfloat16()
    assert rel_rms(rms_norm(x, w, 1e-5), naive_rms_norm(x, w, 1e-5)) < 1e-2
    s, y = add_rms_norm(x, h, w, 1e-5)
    rs, ry = naive_add_rms_norm(x, h, w, 1e-5)
    assert torch.equal(s, rs) and rel_rms(y, ry) < 1e-2
    o, g = (torch.randn(33, 32, 128, generator=gen, device="cuda") for _ in range(2))
    wv = torch.randn(128, generator=gen, device="cuda")
    ref = naive_gated_rms_norm(o, wv, g.bfloat16(), 1e-5, torch.float32)
    assert rel_rms(gated_rms_norm(o, wv, g.bfloat16(), 1e-5, torch.bfloat16), ref) < 1e-2
