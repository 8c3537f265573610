"""Norms and feed-forward blocks: RMSNorm, dense SwiGLU, and the sigmoid-routed MoE with a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..kernels.moe import (
    ROUTE_DECODE_MAX_TOKENS,
    add_norm_route,
    fused_moe,
    fused_moe_add_norm,
    moe_route,
)
from ..kernels.norm import add_rms_norm, rms_norm
from .fused import DerivedWeights, residual_matmul, row_matmul_weight, row_mm, weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._rows_consts: tuple[int, Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def rows(self, x: Tensor) -> Tensor:
        """``self(x)`` on a CPU without autograd in six ops where x and the weight are float32 (``rms_rows``)."""
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return self(x)
        dim, eps = self.rows_consts(x)
        return rms_rows(x, self.weight, dim, eps)

    def rows_consts(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``rms_rows``'s (dim, eps) for rows like x: 0-dim float32 tensors, as a Python number is wrapped in a tensor
        and cast on every call (2 more ops)."""
        if self._rows_consts is None or self._rows_consts[0] != x.shape[-1]:
            self._rows_consts = (x.shape[-1], x.new_tensor(float(x.shape[-1])), x.new_tensor(self.eps))
        return self._rows_consts[1], self._rows_consts[2]

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
        self._stacked: Tensor | None = None
        self._cpu = DerivedWeights(lambda: weights(self, ("gate_proj", "up_proj", "down_proj")), self._cpu_weights)
        self.fast_cpu = True
        """On a CPU without autograd: gate and up in one matmul, weights [in, out] (False: the three linears)."""

    def _cpu_weights(self) -> tuple[Tensor, Tensor]:
        """(w13 [D, 2F]: gate | up columns; w2 [F, D]), [in, out] operands of ``x @ w`` in the layout a CPU's
        one-row matmul reads fastest (``row_matmul_weight``: w13 a copy, w2 a view of down_proj's weight)."""
        w13 = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        return row_matmul_weight(w13), row_matmul_weight(self.down_proj.weight)

    def residual_cpu(self, x: Tensor, residual: Tensor) -> Tensor:
        """residual + this FFN of x, both [N, D], on a CPU without autograd (``swiglu_residual_rows``)."""
        return swiglu_residual_rows(x, residual, *self._cpu.get())

    @torch.no_grad()
    def stack(self) -> None:
        """Move gate_proj's and up_proj's weights into one tensor w13 [1, 2F, D] (gate rows, then up) that the two
        parameters then view, down_proj's viewed as w2 [1, D, F]: memory and checkpoint names unchanged. On a GPU
        a decode batch then runs this FFN as a one-expert MoE in the direct MoE kernels (``residual_block``): two
        PDL launches with the residual add and norm after it, not three GEMMs and two elementwise kernels. A later
        ``.to()`` breaks the views; the path then turns itself off."""
        if self._fused_weights() is not None:
            return
        g = self.gate_proj.weight
        w13 = g.new_empty(1, 2 * g.shape[0], g.shape[1])
        w13[0, : g.shape[0]].copy_(g)
        w13[0, g.shape[0]:].copy_(self.up_proj.weight)
        self._view_stacked(w13)

    def allocate_stacked(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Uninitialised stacked storage (as ``stack`` lays it out) for gate_proj and up_proj, for a loader to fill
        (the model built on the meta device)."""
        F_, D = self.gate_proj.weight.shape
        self._view_stacked(torch.empty(1, 2 * F_, D, device=device, dtype=dtype))

    def _view_stacked(self, w13: Tensor) -> None:
        F_ = w13.shape[1] // 2
        self.gate_proj.weight = nn.Parameter(w13[0, :F_], requires_grad=self.gate_proj.weight.requires_grad)
        self.up_proj.weight = nn.Parameter(w13[0, F_:], requires_grad=self.up_proj.weight.requires_grad)
        self._stacked = w13

    def _fused_weights(self) -> tuple[Tensor, Tensor] | None:
        """(w13 [1, 2F, D], w2 [1, D, F]) while gate_proj and up_proj view the stacked storage and down_proj's
        weight is contiguous, else None."""
        w13 = self._stacked
        if w13 is None:
            return None
        F_ = w13.shape[1] // 2
        g, u, w2 = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if g.data_ptr() != w13.data_ptr() or u.data_ptr() != w13[0, F_:].data_ptr() or g.dtype != w13.dtype \
                or g.device != w13.device or not w2.is_contiguous() or w2.dtype != w13.dtype:
            self._stacked = None
            return None
        return w13, w2.unsqueeze(0)

    def residual_block(self, x: Tensor, a: Tensor, norm: RMSNorm, next_norm: RMSNorm) -> tuple[Tensor, Tensor]:
        """The residual add and ``norm`` before this FFN, the FFN, and the residual add and ``next_norm`` after
        it: x, a [T, D] -> (s = x + a + ffn(norm(x + a)), next_norm(s)). On a GPU, stacked (``stack``), up to
        ``DENSE_DIRECT_MAX_TOKENS`` tokens: the FFN as a one-expert MoE (``kernels.moe.fused_moe_add_norm``, the
        add and norm after it in its launches). Otherwise ``norm.residual``, this module's call (its hooks run),
        ``next_norm.residual``."""
        s, h = norm.residual(x, a)
        fused = self._fused_weights() if x.is_cuda and 0 < x.shape[0] <= DENSE_DIRECT_MAX_TOKENS else None
        if fused is None or not DENSE_DIRECT:
            return next_norm.residual(s, self(h))
        chosen, weights = _one_expert(x.shape[0], x.dtype, x.device)
        return fused_moe_add_norm(h, fused[0], fused[1], chosen, weights, s, next_norm.weight, next_norm.eps, 0)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]."""
        if self.fast_cpu and not x.is_cuda and not torch.is_grad_enabled():  # the derived weights are detached
            w13, w2 = self._cpu.get()
            gate, up = (x @ w13).chunk(2, dim=-1)  # [T, F] each
            return (F.silu(gate).mul_(up)) @ w2
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


DENSE_DIRECT = True
"""A stacked dense FFN's decode batch on a GPU runs in the direct MoE kernels (``SwiGLU.residual_block``): two PDL
launches after the norm where cuBLAS takes seven (GEMMs, SiLU, product, split-K reduce, norms; 51.5 us at the 48B
shape, docs/benchmarks.md). Against off (``bench/decode_48b.py`` mode ``old-dense``): the 1 x 128K step -15 us on
the H200 (2026-12-05); on an H100 at 16 layers of the 48B shape, two alternations, -14 us at 1 x 128K and -19 at
1 x 1M (2026-12-06). No less exact than the cuBLAS path (``test_dense_ffn_as_one_expert_at_the_48b_width``); the
pinned greedy check gives the twins' tokens (docs/benchmarks.md)."""

DENSE_DIRECT_MAX_TOKENS = 16
"""Up to this many tokens (the direct MoE kernels' range); more run the three GEMMs."""

_ONE_EXPERT: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}


def _one_expert(T: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The routing of a dense FFN run as a one-expert MoE: expert 0, weight 1, for T tokens ([T, 1] each). Made
    once per dtype and device outside a CUDA graph capture and sliced; during a capture without them, fresh ones."""
    key = (dtype, device)
    got = _ONE_EXPERT.get(key)
    if got is None:
        got = (torch.zeros(DENSE_DIRECT_MAX_TOKENS, 1, dtype=torch.int64, device=device),
               torch.ones(DENSE_DIRECT_MAX_TOKENS, 1, dtype=dtype, device=device))
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONE_EXPERT[key] = got
    return got[0][:T], got[1][:T]


def rms_rows(x: Tensor, weight: Tensor, dim: Tensor, eps: Tensor) -> Tensor:
    """RMSNorm of float32 rows x [N, D] with weight [D] on a CPU in six ops: ``F.rms_norm``'s own arithmetic (square,
    mean as sum then divide, + eps, rsqrt, times x, times the weight; the same values) without its dozen inner
    calls, each a few microseconds in a decode step whose weights evict the caches. dim, eps: 0-dim float32
    (``RMSNorm.rows_consts``); ``addcdiv`` is eps + sum / dim, each rounded as the two ops round them."""
    r = torch.addcdiv(eps, (x * x).sum(-1, keepdim=True), dim).rsqrt_()
    return torch.mul(x, r).mul_(weight)


def swiglu_residual_rows(x: Tensor, residual: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """residual + a dense SwiGLU FFN of x, both [N, D], on a CPU without autograd in three ops and two views: gate and
    up in one matmul (w13 [D, 2F]: gate | up columns), silu and the product in place on its gate half, the add
    inside the down matmul (w2 [F, D]; ``fused.residual_matmul``: outputs match ``residual + ffn(x)`` to float
    rounding)."""
    gu = row_mm(x, w13)  # [N, 2F]: gate | up
    gate, up = torch.split_with_sizes(gu, [w2.shape[0], w2.shape[0]], 1)
    return residual_matmul(residual, F.silu(gate, inplace=True).mul_(up), w2)


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
        """Move the routed experts' weights into two stacked tensors, w13 [E', 2F, D] (w1 rows, then w3) and
        w2 [E', D, F], which the experts' own parameters then view: memory is unchanged, checkpoint names too, and
        the experts can run from them in place. When the shared expert has the routed experts' width it is stacked
        last (E' = E + 1, its gate/up/down views too) and runs as an always-on expert in the same launches. On a
        GPU the layer then runs in the fused MoE kernels (``kernels.moe``), for decode and prefill alike, with no
        host sync. A later ``.to()`` of the module breaks the views; the stacked path then turns itself off."""
        if not len(self.experts) or self._stacked_weights() is not None:
            return
        first = self.experts[0]
        assert isinstance(first, Expert)
        F_, D = first.w1.weight.shape
        E = len(self.experts)
        shared = self._foldable_shared()
        w13 = first.w1.weight.new_empty(E + (shared is not None), 2 * F_, D)
        w2 = first.w2.weight.new_empty(E + (shared is not None), D, F_)
        for e, ex in enumerate(self.experts):
            assert isinstance(ex, Expert)
            w13[e, :F_].copy_(ex.w1.weight)
            w13[e, F_:].copy_(ex.w3.weight)
            w2[e].copy_(ex.w2.weight)
        if shared is not None:
            w13[E, :F_].copy_(shared.gate_proj.weight)
            w13[E, F_:].copy_(shared.up_proj.weight)
            w2[E].copy_(shared.down_proj.weight)
        self._view_stacked(w13, w2)

    def allocate_stacked(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Give the experts (the shared one too when it is stacked, see ``stack_experts``) uninitialised stacked
        storage that their parameters view, for a loader to fill expert by expert (the model built on the meta
        device)."""
        if not len(self.experts):
            return
        first = self.experts[0]
        assert isinstance(first, Expert)
        F_, D = first.w1.weight.shape
        E = len(self.experts) + (self._foldable_shared() is not None)
        w13 = torch.empty(E, 2 * F_, D, device=device, dtype=dtype)
        w2 = torch.empty(E, D, F_, device=device, dtype=dtype)
        self._view_stacked(w13, w2)

    def _foldable_shared(self) -> SwiGLU | None:
        """The shared expert when it has the routed experts' shapes (then it can be stacked with them)."""
        sh, first = self.shared_experts, self.experts[0]
        assert isinstance(first, Expert)
        if sh is None or sh.gate_proj.weight.shape != first.w1.weight.shape:
            return None
        if sh.down_proj.weight.shape != first.w2.weight.shape:
            return None
        return sh

    def _view_stacked(self, w13: Tensor, w2: Tensor) -> None:
        F_ = w2.shape[2]

        def view(t: Tensor, like: Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=like.requires_grad)

        for e, ex in enumerate(self.experts):
            assert isinstance(ex, Expert)
            ex.w1.weight = view(w13[e, :F_], ex.w1.weight)
            ex.w3.weight = view(w13[e, F_:], ex.w3.weight)
            ex.w2.weight = view(w2[e], ex.w2.weight)
        if w13.shape[0] > len(self.experts):
            sh = self.shared_experts
            assert sh is not None
            E = len(self.experts)
            sh.gate_proj.weight = view(w13[E, :F_], sh.gate_proj.weight)
            sh.up_proj.weight = view(w13[E, F_:], sh.up_proj.weight)
            sh.down_proj.weight = view(w2[E], sh.down_proj.weight)
        self._stacked = (w13, w2)

    def _fused_weights(self) -> tuple[Tensor, Tensor, int | None] | None:
        """(w13 [E', 2F, D], w2 [E', D, F], the shared expert's index E when it is stacked, else None), or None
        when the parameters no longer view the stacked storage (moved or converted since)."""
        if self._stacked is None:
            return None
        w13, w2 = self._stacked
        E = len(self.experts)
        first, last = self.experts[0], self.experts[-1]
        assert isinstance(first, Expert) and isinstance(last, Expert)
        views = [(first.w1.weight, w13[0]), (last.w2.weight, w2[E - 1])]
        shared_id = E if w13.shape[0] > E else None
        if shared_id is not None:
            assert self.shared_experts is not None
            views.append((self.shared_experts.down_proj.weight, w2[E]))
        if any(p.data_ptr() != t.data_ptr() for p, t in views):
            self._stacked = None
            return None
        return w13, w2, shared_id

    def _stacked_weights(self) -> tuple[Tensor, Tensor] | None:
        """The routed experts' stacked weights (w13 [E, 2F, D], w2 [E, D, F]), or None (see ``_fused_weights``)."""
        fused = self._fused_weights()
        if fused is None:
            return None
        E = len(self.experts)
        return fused[0][:E], fused[1][:E]

    def residual_block(self, x: Tensor, a: Tensor, norm: RMSNorm, next_norm: RMSNorm) -> tuple[Tensor, Tensor]:
        """The residual add and ``norm`` before this layer, the layer, and the residual add and ``next_norm`` after
        it: x, a [T, D] -> (s = x + a + this layer of norm(x + a), next_norm(s)). On a GPU with stacked experts
        (the shared one among them), for a decode batch, both adds and norms run inside the layer's launches:
        the first in the router's (``add_norm_route``), the second in the down kernel's (``fused_moe_add_norm``),
        three launches for the whole block. Otherwise ``norm.residual``, this module's call (its hooks run),
        ``next_norm.residual``."""
        fused = self._fused_weights() if x.is_cuda else None
        if fused is not None and (
            x.shape[0] > ROUTE_DECODE_MAX_TOKENS or fused[2] is None or self.shared_experts is None
        ):
            fused = None
        if fused is None:
            s, h = norm.residual(x, a)
            return next_norm.residual(s, self(h))
        w13, w2, shared_id = fused
        s, h, chosen, weights = add_norm_route(x, a, norm.weight, norm.eps, self.gate.weight,
                                               self.gate.e_score_correction_bias, self.top_k, self.renormalize,
                                               self.scale, shared_id)
        return fused_moe_add_norm(h, w13, w2, chosen, weights, s, next_norm.weight, next_norm.eps, shared_id)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, D]. On a GPU with stacked experts: the fused MoE kernels (no host sync, CUDA-graph
        safe), the shared expert among them when stacked; otherwise the loop over the experts that received
        tokens (one host sync; ``naive_fused_moe``) and the shared expert on its own."""
        fused = self._fused_weights() if x.is_cuda else None
        shared_id = fused[2] if fused is not None else None
        chosen, weights = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                    self.renormalize, self.scale, shared_id)  # [T, k] each, [T, k + 1] shared
        if fused is not None:
            out = fused_moe(x, fused[0], fused[1], chosen, weights)
        else:
            out = torch.zeros_like(x)
            for e in torch.unique(chosen).tolist():
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        if self.shared_experts is not None and shared_id is None:
            out = out + self.shared_experts(x)
        return out
