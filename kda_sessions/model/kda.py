"""The KDA layer (checkpoint prefix ``model.layers.{i}.self_attn.``), over a state pool slot per sequence."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..kernels import causal_conv, chunk_kda, fused_recurrent_kda, kda_gate
from .batch import ForwardBatch


class KDAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        V = K
        W = cfg.conv_size
        self.H, self.K, self.V, self.W = H, K, V, W
        self.eps = cfg.rms_norm_eps
        self.lower_bound = cfg.kda_gate_lower_bound
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(H * V, H * V, W, groups=H * V, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, H, 1))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, V, bias=False)
        self.g_b_proj = nn.Linear(V, H * V, bias=False)
        self.o_norm = _HeadNorm(V, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)

    @property
    def conv_dim(self) -> int:
        return 2 * self.H * self.K + self.H * self.V

    def conv_weight(self) -> Tensor:
        """The three depthwise convs as one [Dc, W] weight (q | k | v channels)."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0, :]

    def forward(
        self, x: Tensor, batch: ForwardBatch, state: Tensor, conv_state: Tensor
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x [T, D] packed. Reads and writes ``state`` [S, H, K, V] and ``conv_state`` [S, W - 1, Dc] at the
        batch's slots. Returns (y [T, D], kda states at checkpoints [M, H, K, V], conv tails [M, W - 1, Dc])."""
        if batch.is_decode:
            return self.decode(x, batch.slots, batch.cu_seqlens, state, conv_state), None, None
        slots = batch.slots
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, Dc]
        qkv, new_tail, ck_tail = causal_conv(
            qkv, self.conv_weight(), conv_state[slots], batch.cu_seqlens, batch.checkpoint_positions
        )
        conv_state[slots] = new_tail
        q, k, v, g, beta = self._qkv_gate(x, qkv)
        o, final, ck_state = chunk_kda(
            q, k, v, g, beta, initial_state=state[slots], output_final_state=True,
            cu_seqlens=batch.cu_seqlens, use_qk_l2norm_in_kernel=True,
            checkpoint_positions=batch.checkpoint_positions,
        )
        assert final is not None
        state[slots] = final
        return self._output(x, o), ck_state, ck_tail

    def decode(self, x: Tensor, slots: Tensor, cu_seqlens: Tensor, state: Tensor, conv_state: Tensor) -> Tensor:
        """One new token per sequence, graph-safe (no host sync, fixed shapes): x [N, D], slots [N] int,
        cu_seqlens [N + 1] (arange). Updates ``state`` and ``conv_state`` at the slots in place; returns [N, D]."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [N, Dc]
        qkv, new_tail, _ = causal_conv(qkv, self.conv_weight(), conv_state[slots], cu_seqlens)
        conv_state[slots] = new_tail
        q, k, v, g, beta = self._qkv_gate(x, qkv)
        o, _ = fused_recurrent_kda(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
            state_pool=state, slot_indices=slots,
        )
        return self._output(x, o)

    def _qkv_gate(self, x: Tensor, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Post-conv qkv [T, Dc] -> q, k [1, T, H, K], v [1, T, H, V], g [1, T, H, K] float32, beta [1, T, H]."""
        T = x.shape[0]
        H, K, V = self.H, self.K, self.V
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        # [T, H*K] -> [1, T, H, K]: packed sequences are one varlen batch
        q, k, v = q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, H, V)
        return q, k, v, g.unsqueeze(0), beta.unsqueeze(0)

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """o [1, T, H, V] -> gated head norm -> o_proj -> [T, D]."""
        T = x.shape[0]
        H, V = self.H, self.V
        o = self.o_norm(o[0]) * torch.sigmoid(self.g_b_proj(self.g_a_proj(x)).view(T, H, V))  # [T, H, V]
        return self.o_proj(o.reshape(T, H * V).to(x.dtype))


class _HeadNorm(nn.Module):
    """RMSNorm over each head's V values (``o_norm``, weight [V])."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


__all__ = ["KDAAttention"]
