"""The KDA layer (checkpoint prefix ``model.layers.{i}.self_attn.``), over a state pool slot per sequence."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..kernels import causal_conv, chunk_kda, fused_recurrent_kda, kda_gate
from ..kernels.kda.decode import kda_decode
from ..kernels.linear import MATVEC_MAX_ROWS, linear
from ..kernels.norm import gated_rms_norm
from .batch import ForwardBatch, PaddedPrefill
from .fused import (
    DerivedWeights,
    reduction_weight,
    residual_matmul,
    row_matmul,
    row_matmul_weight,
    row_mm,
    weights,
)

GATE_IN_KERNEL_MAX_ROWS = 8
"""Decode batches of up to this many sequences run the gates' second projections (f_b, g_b) inside
``kda_decode``'s launch; larger ones as one matvec over the merged block-diagonal weight before it. H200, 48B
shape, graph replays of the decode with the gate projections inside against the separate matvec and the decode
(measured on its earlier two-launch form, not re-measured on the one launch): 9.5 against 11.0 us at 1 sequence,
15.4 against 16.4 at 8, but 54.2 against 52.5 at 32 (every program re-reads its head's [K, K] rows)."""


PREFILL_FUSED = True
"""A prefill on a GPU runs KDA's merged projections and the planar conv (``KDAAttention._prefill_inputs``); False:
eight projections and their concatenation, q, k and v copied out of the conv's rows (``bench/prefill_48b.py
--kda-ab``). The gate is one Triton pass either way (``kernels.gate``); inside the chunk kernel's prep
(``use_gate_in_kernel``) it made that kernel 3.6x slower (H100, 32K through the Engine: 41.2 ms against 11.4 of
the prep kernels' time; a prep program's registers spill)."""


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
        self._cpu = DerivedWeights(self.cpu_decode_sources, self.cpu_decode_weights)
        """CPU decode only (a GPU decode uses ``_gpu``); see ``cpu_decode_weights``."""
        self._gpu = DerivedWeights(self._cpu_sources, self._gpu_weights)
        """GPU decode's merged weights (``_gpu_weights``), built once rather than concatenated in every step."""
        self.fast_cpu = True
        """Decode on a CPU through ``_decode_cpu`` (False: through the kernels' naive twins, the reference)."""
        self.fused_decode = True
        """Decode on a GPU in three launches: the input matvec, ``kda_decode``'s one (the gates' second projections
        inside it up to ``GATE_IN_KERNEL_MAX_ROWS`` sequences, else one more matvec) and o_proj (False: the
        separate conv, gate and recurrence kernels, its twin in the model)."""

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
        q, k, v, g, beta, og, ck_tail = self._prefill_inputs(x, batch, conv_state, x.is_cuda and PREFILL_FUSED)
        o, final, ck_state = chunk_kda(
            q, k, v, g, beta, initial_state=state[slots], output_final_state=True,
            cu_seqlens=batch.cu_seqlens, use_qk_l2norm_in_kernel=True,
            checkpoint_positions=batch.checkpoint_positions, cu_seqlens_cpu=batch.offsets,
        )
        assert final is not None
        state[slots] = final
        return self._output(x, o, og), ck_state, ck_tail

    def prefill_padded(self, x: Tensor, inp: PaddedPrefill, valid: Tensor, state: Tensor, conv_state: Tensor
                       ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``forward`` of a padded prefill (``PaddedPrefill``: N chunks of Tb tokens, lens[n] of them real), graph-safe
        (fixed shapes, no host sync): x [N * Tb, D], valid [N * Tb] bool (``inp.valid()``). The padding's gate and beta
        are zeroed, so each state ends as its real tokens leave it; the conv tail is taken after the real tokens.
        Updates ``state`` and ``conv_state`` at the slots in place. Returns (y [N * Tb, D] (padding rows: garbage),
        with ``inp.ck_lens`` the states [N, H, K, V] float32 and conv tails [N, W - 1, Dc] after ck_lens[n] tokens:
        the recurrence run a second time with every later token zeroed as padding is, else None, None)."""
        N, Tb = inp.num_seqs, inp.chunk
        H, K, V, W = self.H, self.K, self.V, self.W
        slots = inp.slots
        qkv, raw, b, og = self._projections(x)
        tails = conv_state[slots]  # [N, W - 1, Dc]
        y, _, _ = causal_conv(qkv, self.conv_weight(), tails, inp.bounds)
        seq = torch.cat([tails.to(qkv.dtype), qkv.view(N, Tb, -1)], dim=1)  # [N, W - 1 + Tb, Dc]

        def tail_after(lens: Tensor) -> Tensor:  # the W - 1 pre-conv rows before position lens[n] of cat(tail, chunk)
            at = lens[:, None] + torch.arange(W - 1, device=x.device)  # [N, W - 1]
            return seq.gather(1, at[..., None].expand(-1, -1, seq.shape[-1])).to(conv_state.dtype)

        q, k, v, g, beta = self._qkv_gate(y, raw, b)
        q, k, v = q.view(N, Tb, H, K), k.view(N, Tb, H, K), v.view(N, Tb, H, V)
        g, beta = g.view(N, Tb, H, K), beta.view(N, Tb, H)
        h0 = state[slots]

        def recurrence(keep: Tensor) -> tuple[Tensor, Tensor]:  # no decay and no update where keep [N * Tb] is False
            k_ = keep.to(g.dtype).view(N, Tb)
            o, final, _ = chunk_kda(q, k, v, g * k_[..., None, None], beta * k_[..., None], initial_state=h0,
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert final is not None
            return o, final

        ck_state = ck_tail = None
        if inp.ck_lens is not None:
            _, ck_state = recurrence(inp.valid(inp.ck_lens))
            ck_tail = tail_after(inp.ck_lens)
        o, final = recurrence(valid)
        state[slots] = final
        conv_state[slots] = tail_after(inp.lens)
        return self._output(x, o.view(1, N * Tb, H, V), og), ck_state, ck_tail

    def decode(self, x: Tensor, slots: Tensor, cu_seqlens: Tensor, state: Tensor, conv_state: Tensor) -> Tensor:
        """One new token per sequence, graph-safe (no host sync, fixed shapes): x [N, D], slots [N] int,
        cu_seqlens [N + 1] (arange). Updates ``state`` and ``conv_state`` at the slots in place; returns [N, D]."""
        if self._use_fast_cpu(x):
            return self.decode_cpu(x, slots, state, conv_state)
        if x.is_cuda and self.fused_decode and x.shape[0] > GATE_IN_KERNEL_MAX_ROWS:
            qkv, raw, b, og = self._projections_merged(x)
            # [N, H, V]: the output norm and gate applied inside kda_decode's launch
            o = kda_decode(qkv, raw, b, self._gpu.get()[2], conv_state, self.A_log, self.dt_bias, self.lower_bound,
                           state, slots, out_norm=(self.o_norm.weight, og, self.o_norm.eps))
            return linear(o.reshape(x.shape[0], self.H * self.V).to(x.dtype), self.o_proj.weight)
        if x.is_cuda and self.fused_decode:
            Dc, K = self.conv_dim, self.K
            w_in, _, conv_w = self._gpu.get()
            y = linear(x, w_in)  # [N, Dc + K + V + H]: q | k | v | f_a | g_a | b
            qkv, fa, ga, b = y[:, :Dc], y[:, Dc : Dc + K], y[:, Dc + K : Dc + K + self.V], y[:, Dc + K + self.V :]
            # [N, H, V]: f_b, g_b, the output norm and gate inside kda_decode's one launch
            # a PDL launch where o_proj is a PDL matvec, which then loads its weight while it runs (H200, 48B shape,
            # graph replays: 1 x 128K 2.453 ms a step against 2.486 without; 8 x 32K, o_proj in cuBLAS: 7.80 / 7.79)
            o = kda_decode(qkv, fa, b, conv_w, conv_state, self.A_log, self.dt_bias, self.lower_bound, state, slots,
                           out_norm=(self.o_norm.weight, ga, self.o_norm.eps), gate_proj=self.f_b_proj.weight,
                           out_gate_proj=self.g_b_proj.weight, pdl=x.shape[0] <= MATVEC_MAX_ROWS)
            return linear(o.reshape(x.shape[0], self.H * self.V).to(x.dtype), self.o_proj.weight)
        # the kernels' public functions: Triton on CUDA, their naive twins on a CPU
        qkv, raw, b, og = self._projections_merged(x) if x.is_cuda else self._projections(x)
        qkv, new_tail, _ = causal_conv(qkv, self.conv_weight(), conv_state[slots], cu_seqlens)
        conv_state[slots] = new_tail
        q, k, v, g, beta = self._qkv_gate(qkv, raw, b)
        o, _ = fused_recurrent_kda(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
            state_pool=state, slot_indices=slots,
        )
        return self._output(x, o, og)

    def _use_fast_cpu(self, x: Tensor) -> bool:
        # the fused weights are detached copies: training (autograd on) goes through the parameters themselves
        return self.fast_cpu and not x.is_cuda and not torch.is_grad_enabled()

    def _projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, D] -> (pre-conv q|k|v [T, Dc], raw gate logits [T, H*K], beta logits [T, H], output gate logits
        [T, H*V]), one linear each: for prefill a CPU runs these as fast as the fused matmul of ``_decode_cpu``."""
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return qkv, self.f_b_proj(self.f_a_proj(x)), self.b_proj(x), self.g_b_proj(self.g_a_proj(x))

    def _prefill_inputs(self, x: Tensor, batch: ForwardBatch, conv_state: Tensor, merged: bool
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """A prefill's projections and conv (updating ``conv_state`` at the batch's slots) -> (q, k [1, T, H, K],
        v [1, T, H, V], log-decays g [1, T, H, K] float32, beta [1, T, H] float32, output gate logits [T, H*V],
        conv tails at the checkpoints | None). ``merged`` (a GPU's): ``_prefill_projections`` and the conv writing
        q, k and v as three contiguous planes (no copies of them before the chunk kernels); else ``_projections``."""
        T = x.shape[0]
        H, K, V = self.H, self.K, self.V
        plane = H * K if merged and K == V else 0
        qkv, raw, b, og = self._prefill_projections(x) if merged else self._projections(x)
        conv_w = self._gpu.get()[2] if merged else self.conv_weight()
        qkv, new_tail, ck_tail = causal_conv(
            qkv, conv_w, conv_state[batch.slots], batch.cu_seqlens, batch.checkpoint_positions, plane
        )
        conv_state[batch.slots] = new_tail
        if plane:
            q, k, v = (qkv[i].view(1, T, H, K) for i in range(3))
            g = kda_gate(raw.view(T, H, K), self.A_log, self.dt_bias, self.lower_bound)
            return q, k, v, g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0), og, ck_tail
        q, k, v, g, beta = self._qkv_gate(qkv, raw, b)
        return q, k, v, g, beta, og, ck_tail

    def _prefill_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``_projections`` on a GPU: q | k | v | f_a | g_a | b in one matmul of the merged ``w_in`` (the pre-conv
        q|k|v and the beta logits strided views of it), then f_b and g_b on their columns: three launches, no
        concatenation copy."""
        Dc, K, V = self.conv_dim, self.K, self.V
        y = linear(x, self._gpu.get()[0])  # [T, Dc + K + V + H]
        raw = linear(y[:, Dc : Dc + K], self.f_b_proj.weight)
        og = linear(y[:, Dc + K : Dc + K + V], self.g_b_proj.weight)
        return y[:, :Dc], raw, y[:, Dc + K + V :], og

    def _projections_merged(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``_projections`` from the merged weights of ``_gpu_weights``: two matvecs instead of eight launches
        (GPU decode: each small projection costs a launch and reads its weight at a fraction of the bandwidth)."""
        H, K, V = self.H, self.K, self.V
        Dc = self.conv_dim
        w_in, w_gate = self._gpu.get()[:2]  # [out, in]
        y = linear(x, w_in)  # [N, Dc + K + V + H]
        fg = linear(y[:, Dc : Dc + K + V], w_gate)  # [N, H*K + H*V]: raw gate | output gate
        return y[:, :Dc], fg[:, : H * K], y[:, Dc + K + V :], fg[:, H * K :]

    def _merged_projections(self) -> tuple[Tensor, Tensor]:
        """[out, in]: w_in, the q | k | v | f_a | g_a | b rows; w_gate, f_b and g_b block-diagonal, so one matmul
        of [f_a | g_a] gives [raw gate | output gate]."""
        H, K, V = self.H, self.K, self.V
        w_in = torch.cat([m.weight for m in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj,
                                             self.b_proj)])
        w_gate = w_in.new_zeros(H * K + H * V, K + V)
        w_gate[: H * K, :K] = self.f_b_proj.weight
        w_gate[H * K :, K:] = self.g_b_proj.weight
        return w_in, w_gate

    def _gpu_weights(self) -> tuple[Tensor, ...]:
        """(w_in [Dc + K + V + H, D]: q | k | v | f_a | g_a | b rows; w_gate [H*K + H*V, K + V]: f_b and g_b
        block-diagonal, so one matmul of [f_a | g_a] gives [raw gate | output gate]; conv [Dc, W]).

        Matmul weights stay [out, in] as ``F.linear`` takes them. Kept apart from ``cpu_decode_weights``, whose layout
        follows what a CPU's one-row matmul reads fastest."""
        w_in, w_gate = self._merged_projections()
        return w_in, w_gate, self.conv_weight().contiguous()

    def _cpu_sources(self) -> list[Tensor]:
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj", "f_b_proj", "g_b_proj", "q_conv1d",
                 "k_conv1d", "v_conv1d")
        params = self._parameters  # A_log and dt_bias straight from the dict, as ``weights`` does
        return [*weights(self, names), params["A_log"], params["dt_bias"]]  # type: ignore[list-item]

    def cpu_decode_sources(self) -> list[Tensor]:
        """The parameters ``cpu_decode_weights`` reads."""
        return [*self._cpu_sources(), *weights(self, ("o_proj", "o_norm"))]

    def cpu_decode_weights(self, compiled: bool = False, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
        """``decode_rows``'s weights: (w_in [D, Dc + K + V + H]: q | k | v | f_a | g_a | b columns; w_gate
        [K + V, H*K + H*V]: f_b and g_b block-diagonal, so one matmul of [f_a | g_a] gives [raw gate | output gate];
        conv [W, Dc] float32; gate_bias [H*K + H*V] float32: dt_bias for the raw gate columns, 0 for the output
        gate's; neg_a [H*K] float32 = -exp(A_log) per channel; qk_scale [2H, 1, 1] float32: K^-0.5 for the q heads
        (the read's scale), 1 for the k heads; w_out [H*V, D]: o_proj times o_norm's weight and sqrt(V) per input
        row, so the output norm is one rsqrt of each head's sum of squares); eps_qk, eps_o: 0-dim float32, the
        epsilons of the q/k l2norm (1e-6) and of the output norm (V times o_norm's) as tensors (a Python number is
        wrapped in a tensor and cast on every op: two more ops each time)).

        Matmul weights are [in, out] operands of ``x @ w``, laid out as a CPU's one-row matmul reads them fastest
        (``row_matmul_weight``), or with ``compiled`` as ``row_matmul`` sums them under torch.compile
        (``reduction_weight``, in ``dtype``, default the model's)."""
        w_in, w_gate = self._merged_projections()
        H, K, V = self.H, self.K, self.V
        f32 = torch.float32
        mm = (lambda w: reduction_weight(w, dtype)) if compiled else row_matmul_weight
        a = self.A_log.float().view(H, 1).exp().expand(H, K).reshape(H * K)
        gate_bias = torch.cat([self.dt_bias.float(), self.dt_bias.new_zeros(H * V, dtype=f32)])
        qk_scale = torch.cat([torch.full((H, 1, 1), K**-0.5), torch.ones(H, 1, 1)])
        row_scale = self.o_norm.weight.float().repeat(H) * V**0.5  # [H*V]
        w_out = (self.o_proj.weight.float() * row_scale).to(self.o_proj.weight.dtype)  # [D, H*V]
        eps_qk, eps_o = torch.tensor(1e-6, dtype=f32), torch.tensor(V * self.o_norm.eps, dtype=f32)
        return (mm(w_in), mm(w_gate), self.conv_weight().t().float().contiguous(), gate_bias, -a, qk_scale, mm(w_out),
                eps_qk, eps_o)

    def decode_cpu(self, x: Tensor, slots: Tensor | int, state: Tensor, conv_state: Tensor,
                   residual: Tensor | None = None) -> Tensor:
        """``decode`` on a CPU: ``decode_rows`` over the N sequences' pool rows (for one sequence views of them,
        updated in place: a CPU syncs for free; for several, gathered copies written back, or views of them where
        their slots are consecutive). ``slots``: [N], or the first of N consecutive slots as an int (read once a
        step rather than once a layer). With ``residual`` [N, D] it returns residual + the layer's output, the add
        inside the output projection's matmul."""
        if isinstance(slots, int) or x.shape[0] == 1:
            s0 = slots if isinstance(slots, int) else int(slots[0])
            s1 = s0 + x.shape[0]
            return self.decode_rows(x, state[s0:s1], conv_state[s0:s1], self._cpu.get(), residual)
        S, tails = state.index_select(0, slots), conv_state.index_select(0, slots)
        out = self.decode_rows(x, S, tails, self._cpu.get(), residual)
        state[slots] = S
        conv_state[slots] = tails
        return out

    def decode_rows(self, x: Tensor, S: Tensor, tails: Tensor, w: tuple[Tensor, ...],
                    residual: Tensor | None = None) -> Tensor:
        """One new token of N sequences on a CPU in few, large ops (a step there is bound by per-op overhead):
        one matmul for the six input projections, one for both gates, the conv over [N, W, Dc], the recurrence
        batched over the N sequences and heads, the output norm folded into ``w_out``. Traceable by
        ``torch.compile`` (no host sync, no branch on values).

        x [N, D]; S [N, H, K, V] float32 and tails [N, W - 1, Dc], the sequences' KDA states and conv tails,
        updated in place; w, ``cpu_decode_weights``. Returns [N, D], plus ``residual`` [N, D] where given
        (``fused.residual_matmul``, eager only). The same math as the twins in another order of sums: outputs match to float
        rounding."""
        N = x.shape[0]
        if N == 1 and not torch.compiler.is_compiling():
            return self.decode_one(x, S[0], tails[0], w, residual)
        H, K, V = self.H, self.K, self.V
        HK, Dc = H * K, self.conv_dim
        f32 = torch.float32
        w_in, w_gate, conv_w, gate_bias, neg_a, qk_scale, w_out, eps_qk, eps_o = w
        # (each op of a step costs a few microseconds: views taken by one split, casts skipped where they change
        # nothing)
        new, fa_ga, b = torch.split_with_sizes(row_matmul(x, w_in), [Dc, K + V, H], 1)  # [N, Dc + K + V + H]
        # [N, H*K + H*V]: raw gate + dt_bias | output gate logits, float32
        fg = row_matmul(fa_ga, w_gate)
        raw, og = torch.split_with_sizes((fg if fg.dtype == f32 else fg.float()).add_(gate_bias), [HK, H * V], 1)
        # causal conv over the last W - 1 pre-conv rows and the new one
        new = new.unsqueeze(1)
        seq = torch.cat([tails, new if new.dtype == tails.dtype else new.to(tails.dtype)], dim=1)  # [N, W, Dc]
        tails.copy_(seq[:, 1:])
        qkv = torch.nn.functional.silu((seq if seq.dtype == f32 else seq.float()).mul_(conv_w).sum(1))  # [N, Dc]
        qk, v = torch.split_with_sizes(qkv, [2 * HK, H * V], 1)
        qk = qk.view(N, 2 * H, 1, K)  # the q heads, then the k heads
        # l2norm of every q and k head at once, the q heads also times K^-0.5
        qk = qk * (qk * qk).sum(-1, keepdim=True).add_(eps_qk).rsqrt_().mul_(qk_scale)
        q, k = torch.split_with_sizes(qk, [H, H], 1)
        q, k, v = q.reshape(N * H, 1, K), k.reshape(N * H, 1, K), v.reshape(N * H, 1, V)
        if self.lower_bound is None:
            g = torch.nn.functional.softplus(raw, beta=1.0, threshold=20.0).mul_(neg_a)
        else:
            g = torch.sigmoid(-neg_a * raw).mul_(self.lower_bound)
        beta = torch.sigmoid(b if b.dtype == f32 else b.float()).view(N * H, 1, 1)
        # one recurrence step per head: decay, delta update, read (KDA.md)
        S3 = S.view(N * H, K, V)
        S3.mul_(g.exp_().view(N * H, K, 1))
        delta = torch.baddbmm(v, k, S3, alpha=-1).mul_(beta)  # (v - k S) beta [N*H, 1, V]
        S3.addcmul_(k.transpose(1, 2), delta)  # the rank-one update k^T delta, broadcast
        o = torch.bmm(q, S3).view(N, H, V)
        # o_norm per head: its weight and sqrt(V) are in w_out, so rsqrt(sum o^2 + V eps) is all that is left
        o = o.mul_((o * o).sum(-1, keepdim=True).add_(eps_o).rsqrt_())
        o = o.mul_(torch.sigmoid(og).view(N, H, V)).view(N, H * V)
        o = o if o.dtype == x.dtype else o.to(x.dtype)
        if residual is not None:
            return residual_matmul(residual, o, w_out)
        return row_matmul(o, w_out)

    def decode_one(self, x: Tensor, S: Tensor, tails: Tensor, w: tuple[Tensor, ...],
                   residual: Tensor | None = None) -> Tensor:
        """``decode_rows`` of one sequence, eagerly (what it runs for N = 1): the same ops on the same values, less the
        batch dimension and the reshapes it needs (seven ops fewer: each costs a step a microsecond or two, the caches
        cold after the layer's weight stream). x [1, D]; S [H, K, V] float32 and tails
        [W - 1, Dc], the sequence's state and conv tails (views of its pool rows, updated in place); w,
        ``cpu_decode_weights``. Returns [1, D], plus ``residual`` [1, D] where given."""
        H, K, V = self.H, self.K, self.V
        HK, Dc = H * K, self.conv_dim
        f32 = torch.float32
        w_in, w_gate, conv_w, gate_bias, neg_a, qk_scale, w_out, eps_qk, eps_o = w
        new, fa_ga, b = torch.split_with_sizes(row_mm(x, w_in), [Dc, K + V, H], 1)  # [1, Dc + K + V + H]
        fg = row_mm(fa_ga, w_gate)  # [1, H*K + H*V]: raw gate + dt_bias | output gate logits, float32
        raw, og = torch.split_with_sizes((fg if fg.dtype == f32 else fg.float()).add_(gate_bias), [HK, H * V], 1)
        seq = torch.cat([tails, new if new.dtype == tails.dtype else new.to(tails.dtype)])  # [W, Dc]
        tails.copy_(seq[1:])
        qkv = (seq if seq.dtype == f32 else seq.float()).mul_(conv_w).sum(0)  # [Dc]
        torch.nn.functional.silu(qkv, inplace=True)
        # [3H, 1, K]: the q heads, the k heads, the v heads (V == K), split once with no view of each part
        qk, v = torch.split_with_sizes(qkv.view(3 * H, 1, K), [2 * H, H])
        qk = qk * (qk * qk).sum(-1, keepdim=True).add_(eps_qk).rsqrt_().mul_(qk_scale)  # l2norm, q also * K^-0.5
        q, k = torch.split_with_sizes(qk, [H, H])  # [H, 1, K] each
        if self.lower_bound is None:
            g = torch.nn.functional.softplus(raw, beta=1.0, threshold=20.0).mul_(neg_a)
        else:
            g = torch.sigmoid(-neg_a * raw).mul_(self.lower_bound)
        beta = torch.sigmoid(b if b.dtype == f32 else b.float()).view(H, 1, 1)
        # one recurrence step per head: decay, delta update, read (KDA.md)
        S.mul_(g.exp_().view(H, K, 1))
        delta = torch.baddbmm(v, k, S, alpha=-1).mul_(beta)  # (v - k S) beta [H, 1, V]
        S.addcmul_(k.transpose(1, 2), delta)
        o = torch.bmm(q, S)  # [H, 1, V]
        o.mul_((o * o).sum(-1, keepdim=True).add_(eps_o).rsqrt_())  # o_norm: its weight and sqrt(V) are in w_out
        o = o.view(1, H * V).mul_(torch.sigmoid(og))
        o = o if o.dtype == x.dtype else o.to(x.dtype)
        if residual is not None:
            return residual_matmul(residual, o, w_out)
        return row_mm(o, w_out)

    def _qkv_gate(self, qkv: Tensor, raw: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Post-conv qkv [T, Dc], raw gate [T, H*K], beta logits [T, H] -> q, k [1, T, H, K], v [1, T, H, V],
        g [1, T, H, K] float32, beta [1, T, H]."""
        T = qkv.shape[0]
        H, K, V = self.H, self.K, self.V
        q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        g = kda_gate(raw.reshape(T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(b.float())  # [T, H]
        # [T, H*K] -> [1, T, H, K]: packed sequences are one varlen batch
        q, k, v = q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, H, V)
        return q, k, v, g.unsqueeze(0), beta.unsqueeze(0)

    def _output(self, x: Tensor, o: Tensor, og: Tensor) -> Tensor:
        """o [1, T, H, V], output gate logits og [T, H*V] -> gated head norm -> o_proj -> [T, D]."""
        T = x.shape[0]
        H, V = self.H, self.V
        if o.is_cuda:  # norm, gate and cast in one kernel
            o = gated_rms_norm(o[0], self.o_norm.weight, og.reshape(T, H, V), self.o_norm.eps, x.dtype)
            return self.o_proj(o.reshape(T, H * V))
        o = self.o_norm(o[0]) * torch.sigmoid(og.reshape(T, H, V))  # [T, H, V]
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
