"""Norms and feed-forward blocks: RMSNorm, dense SwiGLU, and the sigmoid-routed MoE with a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..kernels.moe import fused_moe, moe_route
from ..kernels.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def residual(self, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before this norm, fused with it: (x + h, norm(x + h)), x and h [..., D]."""
        return add_rms_norm(x, h, self.weight, self.eps)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One routed expert; checkpoint names w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, width, bias=False)
        self.w3 = nn.Linear(dim, width, bias=False)
        self.w2 = nn.Linear(width, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class MoE(nn.Module):
    """Sigmoid router; experts chosen on score + e_score_correction_bias; weights are the plain scores of the
    chosen experts, renormalised, times routed_scaling_factor; plus the shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.scale = cfg.routed_scaling_factor
        self.gate = Router(D, cfg.num_experts)
        self.experts = nn.ModuleList(Expert(D, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_experts = (
            SwiGLU(D, cfg.moe_intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )
        self._stacked: tuple[Tensor, Tensor] | None = None

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Move the routed experts' weights into two stacked tensors, w13 [E, 2F, D] (w1 rows, then w3) and
        w2 [E, D, F], which the experts' own parameters then view: memory is unchanged, checkpoint names too, and
        the routed experts can run from them in place. On a GPU the routed experts then run in the fused MoE
        kernels (``kernels.moe``), for decode and prefill alike, with no host sync. A later ``.to()`` of the
        module breaks the views; the stacked path then turns itself off."""
        if not len(self.experts) or self._stacked_weights() is not None:
            return
        first = self.experts[0]
        assert isinstance(first, Expert)
        F_, D = first.w1.weight.shape
        E = len(self.experts)
        w13 = first.w1.weight.new_empty(E, 2 * F_, D)
        w2 = first.w2.weight.new_empty(E, D, F_)
        for e, ex in enumerate(self.experts):
            assert isinstance(ex, Expert)
            w13[e, :F_].copy_(ex.w1.weight)
            w13[e, F_:].copy_(ex.w3.weight)
            w2[e].copy_(ex.w2.weight)
        self._view_stacked(w13, w2)

    def allocate_stacked(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Give the routed experts uninitialised stacked storage (w13 [E, 2F, D], w2 [E, D, F]) that their
        parameters view, for a loader to fill expert by expert (the model built on the meta device)."""
        if not len(self.experts):
            return
        first = self.experts[0]
        assert isinstance(first, Expert)
        F_, D = first.w1.weight.shape
        E = len(self.experts)
        w13 = torch.empty(E, 2 * F_, D, device=device, dtype=dtype)
        w2 = torch.empty(E, D, F_, device=device, dtype=dtype)
        self._view_stacked(w13, w2)

    def _view_stacked(self, w13: Tensor, w2: Tensor) -> None:
        F_ = w2.shape[2]
        for e, ex in enumerate(self.experts):
            assert isinstance(ex, Expert)
            grad = ex.w1.weight.requires_grad
            ex.w1.weight = nn.Parameter(w13[e, :F_], requires_grad=grad)
            ex.w3.weight = nn.Parameter(w13[e, F_:], requires_grad=grad)
            ex.w2.weight = nn.Parameter(w2[e], requires_grad=grad)
        self._stacked = (w13, w2)

    def _stacked_weights(self) -> tuple[Tensor, Tensor] | None:
        if self._stacked is None:
            return None
        w13, w2 = self._stacked
        first, last = self.experts[0], self.experts[-1]
        assert isinstance(first, Expert) and isinstance(last, Expert)
        if first.w1.weight.data_ptr() != w13.data_ptr() or last.w2.weight.data_ptr() != w2[-1].data_ptr():
            self._stacked = None  # the parameters were moved or converted since: the views no longer hold
            return None
        return w13, w2

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]. On a GPU with stacked experts: the fused MoE kernels (no host sync, CUDA-graph
        safe); otherwise the loop over the experts that received tokens (one host sync; ``naive_fused_moe``)."""
        chosen, weights = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                    self.renormalize, self.scale)  # [T, k] each
        stacked = self._stacked_weights() if x.is_cuda else None
        if stacked is not None:
            out = fused_moe(x, *stacked, chosen, weights)
        else:
            out = torch.zeros_like(x)
            for e in torch.unique(chosen).tolist():
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
