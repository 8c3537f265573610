"""The skinny linear kernel against ``x @ w.T`` under TRITON_INTERPRET=1 (float32: relative RMS error 1e-5,
float16: 1e-3); bf16 at the 48B decode shapes on the GPU (gpu-marked, 1e-2)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.linear import skinny_linear
from kda_sessions.kernels.linear.naive import naive_linear

from .kernel_helpers import rel_rms

CASES = [(1, 40, 48), (5, 100, 300), (16, 33, 64)]


@pytest.mark.parametrize("T,N,D", CASES, ids=[f"T{t}-N{n}-D{d}" for t, n, d in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_skinny_linear_matches_the_twin(T: int, N: int, D: int, dtype: torch.dtype) -> None:
    from kda_sessions.kernels.linear.skinny import skinny_linear_triton

    gen = torch.Generator().manual_seed(T + N)
    x = torch.randn(T, D, generator=gen)
    w = torch.randn(N, D, generator=gen) / D**0.5
    ref = naive_linear(x, w)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    y = skinny_linear_triton(x.to(dtype), w.to(dtype), (16, 32, 4, 1))
    assert y.dtype == dtype and y.shape == (T, N)
    assert rel_rms(y, ref) < tol
    w_t = w.to(dtype).t().contiguous()  # a [D, N] weight, passed as its [N, D] view
    assert rel_rms(skinny_linear_triton(x.to(dtype), w_t.t(), (16, 32, 4, 1)), ref) < tol
    with pytest.raises(ValueError, match="x must be"):
        skinny_linear(x, w[:, :-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 8, 16], ids=["T1", "T8", "T16"])
def test_skinny_linear_bf16_on_the_gpu(T: int) -> None:
    gen = torch.Generator("cuda").manual_seed(T)
    for N, D in [(12576, 2304), (2304, 4096), (163840, 2304)]:
        x = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
        w = (torch.randn(N, D, generator=gen, device="cuda") / D**0.5).bfloat16()
        ref = naive_linear(x.float(), w.float())
        assert rel_rms(skinny_linear(x, w), ref) < 1e-2
        assert rel_rms(skinny_linear(x, w.t().contiguous().t()), ref) < 1e-2  # the [D, N] layout
