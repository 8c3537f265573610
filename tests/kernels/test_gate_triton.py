"""The KDA gate's Triton pass (kernels/gate/triton_gate.py) against its twin, under TRITON_INTERPRET=1: standard
and bounded gates, logits past softplus's linear threshold, rows at a stride (columns of a wider projection), half
precision in; the GPU dispatch on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.gate.naive import naive_kda_gate

from .kernel_helpers import rel_rms


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp of the masked branch
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_pass_matches_the_twin(lower_bound):
    from kda_sessions.kernels.gate.triton_gate import kda_gate_triton

    gen = torch.Generator().manual_seed(0)
    T, H, K = 37, 3, 16
    wide = torch.randn(T, H * K + 8, generator=gen) * 12  # some logits above 20
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    for raw in (wide[:, : H * K].contiguous().view(T, H, K), wide[:, : H * K].view(T, H, K),
                wide[:, : H * K].half().view(T, H, K)):
        ref = naive_kda_gate(raw, A_log, dt_bias, lower_bound)
        out = kda_gate_triton(raw, A_log, dt_bias, lower_bound)
        assert out.dtype == torch.float32 and out.shape == (T, H, K) and rel_rms(out, ref) < 1e-6
        assert bool((out <= 0).all())


def test_gate_pass_checks_its_parameters():
    from kda_sessions.kernels.gate.triton_gate import kda_gate_triton

    raw = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate_triton(raw, torch.zeros(3), torch.zeros(16))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate_triton(raw, torch.zeros(2), torch.zeros(16), lower_bound=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gate_pass_on_the_gpu():
    from kda_sessions.kernels.gate import kda_gate

    gen = torch.Generator(device="cuda").manual_seed(1)
    raw = (torch.randn(8192, 32 * 128 + 256, device="cuda", generator=gen) * 10).bfloat16()[:, : 32 * 128]
    A_log, dt_bias = torch.randn(32, device="cuda", generator=gen), torch.randn(4096, device="cuda", generator=gen)
    raw = raw.view(8192, 32, 128)
    for lb in (None, -5.0):
        assert rel_rms(kda_gate(raw, A_log, dt_bias, lb), naive_kda_gate(raw, A_log, dt_bias, lb)) < 1e-6
