"""Norms and feed-forward blocks: RMSNorm, dense SwiGLU, and the sigmoid-routed MoE with a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig

DENSE_ROUTING_MAX_TOKENS = 64
"""On a GPU, batches of at most this many tokens (decode) run every expert instead of gathering tokens per
expert, which needs the chosen experts on the host."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


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

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]."""
        scores = torch.sigmoid(x.float() @ self.gate.weight.float().t())  # [T, E]
        _, chosen = torch.topk(scores + self.gate.e_score_correction_bias.float(), self.top_k, dim=-1)  # [T, k]
        weights = scores.gather(-1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = (weights * self.scale).to(x.dtype)
        if x.is_cuda and x.shape[0] <= DENSE_ROUTING_MAX_TOKENS:
            out = self._all_experts(x, chosen, weights)
        else:
            out = torch.zeros_like(x)
            # loop over experts that received tokens; the host sync is fine on a CPU and in a long prefill
            for e in torch.unique(chosen).tolist():
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _all_experts(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Every expert on every token, each scaled by its routing weight (zero where not chosen): no host sync
        and fixed shapes, so a decode step can be captured in a CUDA graph. For a few tokens this reads the same
        expert weights as the sparse loop (nearly every expert is chosen by someone) and the extra FLOPs are
        negligible."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
        dense.scatter_(1, chosen, weights)  # [T, E]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * dense[:, e, None]
        return out
