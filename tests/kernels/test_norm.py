"""RMSNorm kernel against its twin under TRITON_INTERPRET=1: relative RMS error 1e-6 (float32), 1e-3 (float16)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.norm import rms_norm
from kda_sessions.kernels.norm.naive import naive_rms_norm

from .kernel_helpers import rel_rms


@pytest.mark.parametrize("shape", [(1, 48), (7, 100), (2, 3, 64)], ids=["1x48", "7x100", "2x3x64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_rms_norm_matches_the_twin(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from kda_sessions.kernels.norm.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen)
    y = rms_norm_triton(x, w, 1e-5)
    ref = naive_rms_norm(x.float(), w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y, ref) < (1e-6 if dtype == torch.float32 else 1e-3)


def test_rms_norm_of_a_strided_slice_and_validation() -> None:
    from kda_sessions.kernels.norm.triton_norm import rms_norm_triton

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 80, generator=gen)[:, 16:]  # rows strided, last dimension contiguous
    w = torch.randn(64, generator=gen)
    assert rel_rms(rms_norm_triton(x, w, 1e-6), naive_rms_norm(x, w, 1e-6)) < 1e-6
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w[:8], 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("D", [512, 2304], ids=["D512", "D2304"])
def test_rms_norm_bf16_on_the_gpu(D: int) -> None:
    gen = torch.Generator("cuda").manual_seed(D)
    x = torch.randn(33, D, generator=gen, device="cuda").bfloat16()
    w = torch.randn(D, generator=gen, device="cuda").bfloat16()
    assert rel_rms(rms_norm(x, w, 1e-5), naive_rms_norm(x, w, 1e-5)) < 1e-2
