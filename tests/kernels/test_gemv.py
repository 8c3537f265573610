"""The skinny linear (decode's matvecs) against its twin; TRITON_INTERPRET=1 on a CPU, compiled with ``-m gpu``.
Tolerance: relative RMS 1e-5 (float32 inputs), 1e-2 (bf16 output rounding)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.gemv import skinny_linear
from kda_sessions.kernels.gemv.naive import naive_skinny_linear

from .kernel_helpers import rel_rms


def _check(N: int, O: int, D: int, dtype: torch.dtype, device: str) -> None:
    from kda_sessions.kernels.gemv.triton_gemv import skinny_linear_triton

    g = torch.Generator().manual_seed(N * 7 + O)
    base = torch.randn(N, D + 8, generator=g).to(dtype)
    x = base[:, 3 : 3 + D]  # a strided row view, as slices of a projection are
    w = torch.randn(O, D, generator=g).to(dtype)
    y = skinny_linear_triton(x.to(device), w.to(device)).cpu()
    ref = naive_skinny_linear(x, w)
    assert y.shape == (N, O) and y.dtype == dtype
    assert rel_rms(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("N,O,D", [(1, 70, 200), (3, 64, 256), (16, 33, 130)], ids=["1row", "3rows", "16rows"])
def test_skinny_linear_matches_the_twin(N, O, D):
    _check(N, O, D, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8])
def test_skinny_linear_on_cuda(N):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(N, 12576, 2304, torch.bfloat16, "cuda")
    _check(N, 96, 160, torch.float32, "cuda")


def test_skinny_linear_checks_its_inputs():
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        skinny_linear(torch.zeros(2, 8), torch.zeros(4, 9))
