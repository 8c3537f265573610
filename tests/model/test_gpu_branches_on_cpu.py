"""The model's GPU-only branches (fused MoE with the shared expert stacked in, fused residual norms, KDA's fused
output norm and merged projections) run on the CPU through Triton's interpreter, whose float32 dots are exact:
their logits equal the CPU path's. This separates the branches' logic from the GPU's arithmetic (on an H200
the float32 logits of tiny-random differ by 5e-2 relative RMS; see test_cuda_model_matches_the_cpu_model)."""

from __future__ import annotations

import os

import pytest
import torch

from kda_sessions.model import load_model


@pytest.mark.slow  # ~25 s: every kernel of the forward runs in Triton's interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (a CPU run)")
def test_gpu_branches_match_the_cpu_path(monkeypatch: pytest.MonkeyPatch):
    model = load_model("tiny-random")
    ids = torch.randint(0, 272, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        out = model(ids)
        monkeypatch.undo()
    err = float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert err < 1e-4, err
    assert bool((out.argmax(-1) == ref.argmax(-1)).all())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (a CPU run)")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_ffn_block_with_the_norm_deferred_equals_the_block(kind: str, monkeypatch) -> None:
    """One token through an FFN block's GPU branch (Triton's interpreter, ``is_cuda`` claimed; float32): with
    ``defer`` the block returns the residual sum and no normed rows, and the next input matvec norming them in its
    launch (``linear``'s ``norm``) gives what the block's own norm and a plain matvec give (1e-5)."""
    from kda_sessions.kernels.linear import linear
    from kda_sessions.model import ffn

    monkeypatch.setattr(ffn, "DENSE_DIRECT", True)
    model = load_model("tiny-random")
    model.stack_experts()
    layers = list(model.model.layers)
    i = next(j for j, la in enumerate(layers) if hasattr(la, "mlp" if kind == "dense" else "block_sparse_moe"))
    layer, nxt = layers[i], layers[i + 1]
    block = layer.mlp if kind == "dense" else layer.block_sparse_moe
    gen = torch.Generator().manual_seed(8)
    x, a = (torch.randn(1, model.config.hidden_size, generator=gen) for _ in range(2))
    w = torch.randn(40, model.config.hidden_size, generator=gen)
    norm = nxt.input_layernorm
    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        s, h = block.residual_block(x, a, layer.post_attention_layernorm, norm)
        s2, none = block.residual_block(x, a, layer.post_attention_layernorm, norm, defer=True)
        y2 = linear(s2, w, norm=(norm.weight, norm.eps))
        y = linear(h, w)
    assert none is None and torch.allclose(s2, s, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y2, y, rtol=1e-5, atol=1e-5)
