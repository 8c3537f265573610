"""The model's GPU-only branches (fused MoE with the shared expert stacked in, fused residual norms, KDA's fused
output norm and merged projections, the prefill's planar conv and gate inside the chunk kernel) run on the CPU
through Triton's interpreter, whose float32 dots are exact: their logits equal the CPU path's. This separates the
branches' logic from the GPU's arithmetic (on an H200 the float32 logits of tiny-random differ by 5e-2 relative
RMS; see test_cuda_model_matches_the_cpu_model)."""

from __future__ import annotations

import os

import pytest
import torch

from kda_sessions.model import load_model


# ~25 s a variant (every kernel of the forward runs in Triton's interpreter), in the default suite: it is the only CPU run of
# the prefill's GPU branches as a whole (KDA's merged projections, planar conv and gate in the chunk kernel; the
# MLA and MoE prefill kernels' host code)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (a CPU run)")
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gpu_branches_match_the_cpu_path(tma: bool, monkeypatch: pytest.MonkeyPatch):
    """``tma``: the MoE's grouped kernels and MLA's flash kernel through TMA descriptors (at any size)."""
    from kda_sessions.kernels.mla import prefill
    from kda_sessions.kernels.moe import triton_moe

    if tma:
        monkeypatch.setattr(triton_moe, "GROUPED_TMA_MIN_PAIRS", 0)
        monkeypatch.setattr(prefill, "TMA", True)
    model = load_model("tiny-random")
    model.stack_experts()  # as loading onto a GPU does: the MoE layers then run the fused kernels
    ids = torch.randint(0, 272, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            out = model(ids)
    err = float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert err < 1e-4, err
    assert bool((out.argmax(-1) == ref.argmax(-1)).all())
