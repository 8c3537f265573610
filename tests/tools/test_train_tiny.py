"""tools/train_tiny.py's training forward: gradients reach every parameter even where the library's modules run
kernels without a backward (on CUDA its RMSNorm is a Triton kernel: a run trained lm_head alone)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.config import ModelConfig
from kda_sessions.kernels.norm.naive import naive_rms_norm
from kda_sessions.model import HybridModel
from kda_sessions.model import ffn as ffn_module
from tools import train_tiny


def _model() -> HybridModel:
    cfg = ModelConfig.from_file(train_tiny.CONFIG)
    model = HybridModel(cfg)
    train_tiny.init_weights(model, 0)
    return model


def test_every_parameter_learns_when_the_library_norm_has_no_backward(monkeypatch: pytest.MonkeyPatch):
    # what the CUDA kernel does to autograd: a result with no history
    monkeypatch.setattr(ffn_module, "rms_norm", lambda x, w, eps: naive_rms_norm(x, w, eps).detach())
    model = _model()
    ids = torch.randint(0, 256, (1, 48))
    train_tiny.train_logits(model, ids, use_fla=False).float().logsumexp(-1).mean().backward()
    train_tiny.check_gradients(model)  # raises SystemExit naming a parameter without a gradient
    assert all(p.grad is not None for p in model.parameters())


def test_a_parameter_without_a_gradient_stops_the_run():
    model = _model()
    model.lm_head(torch.randn(2, model.config.hidden_size)).sum().backward()
    with pytest.raises(SystemExit, match="got no gradient"):
        train_tiny.check_gradients(model)
