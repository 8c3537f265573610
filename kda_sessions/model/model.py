"""The hybrid KDA + MLA decoder (checkpoint names of Kimi-Linear) and its two entry points.

``step(batch, pools)`` runs a batch of sequences of any lengths from their pooled states (prefill, or decode
when every sequence feeds one token) and returns logits plus states at requested checkpoint positions;
``forward(input_ids [B, T])`` runs fresh sequences and returns logits [B, T, vocab]. ``decode(inputs, pools)``
is the decode step over device tensors only, the function a CUDA graph captures (``graphs.DecodeGraphs``);
``step`` runs decode batches through the same code.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .batch import CheckpointStates, DecodeInputs, ForwardBatch, PaddedPrefill, StatePools
from .ffn import MoE, RMSNorm, SwiGLU, rms_rows, swiglu_residual_rows
from .fused import (
    DerivedWeights,
    ParamWatch,
    huge_page_zeros,
    reduction_weight,
    row_matmul,
    row_matmul_weight,
    row_mm,
    weights,
)
from .kda import KDAAttention
from .mla import MLAttention

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_kda = cfg.is_kda(layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: KDAAttention | MLAttention = KDAAttention(cfg) if self.is_kda else MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe(layer):
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def ffn(self, x: Tensor) -> Tensor:
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x)
        return self.mlp(x)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if torch.empty(0).is_meta:  # built to be loaded into: skip the init, which on meta tensors imports
            # torch._dynamo through torch._refs (~2 s for every process that opens a model)
            weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._compiled_rows: Callable[..., tuple[Tensor, list[Tensor]]] | None = None
        self._compiled_weights: list[DerivedWeights] = []
        self._compiled_for: tuple[torch.dtype, torch.device] | None = None
        self._compiled_warm = False
        self._cpu_plan: _CpuDecodePlan | None = None
        """``_decode_cpu``'s layers and weights (``_CpuDecodePlan``), built by the first CPU decode step."""
        self._cpu_head = DerivedWeights(lambda: weights(self, ("lm_head",)),
                                        lambda: (row_matmul_weight(self.lm_head.weight),))
        """``_decode_cpu``'s lm_head weight [D, vocab], laid out as a CPU's one-row matmul reads it fastest."""

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def stack_experts(self) -> None:
        """Stack every MoE layer's routed experts (``MoE.stack_experts``: memory-neutral views) so decode batches
        on a GPU run them in batched matmuls, and every dense FFN's gate and up (``SwiGLU.stack``); done once
        before decode steps are captured in CUDA graphs."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.stack_experts()
        for layer in self._layers():
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, SwiGLU):
                mlp.stack()  # the dense FFNs' gate and up too (``SwiGLU.stack``)

    def allocate_pools(self, num_slots: int, num_pages: int, page_size: int, scratch: bool = True) -> StatePools:
        """Zeroed pools: KDA states [S, H, K, V] float32 and conv tails per KDA layer, latent pages per MLA layer.
        With ``scratch`` one more slot (index ``num_slots``) and page (index ``num_pages``) are allocated for the
        padded rows of CUDA-graph decode batches; callers never hand them out."""
        cfg = self.config
        H, K = cfg.kda_heads, cfg.kda_head_dim
        Dc = 3 * H * K
        nk, nm = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
        S, NP = num_slots + int(scratch), num_pages + int(scratch)
        kda = self._zeros((nk, S, H, K, K), torch.float32)  # a slot's state in every layer: one strided block
        conv = self._zeros((nk, S, cfg.conv_size - 1, Dc), self.dtype)
        return StatePools(
            kda=[kda[i] for i in range(nk)],  # views by indexing: unbind's may not be written under autograd
            conv=[conv[i] for i in range(nk)],
            kv=[self._zeros((NP, page_size, cfg.latent_dim), self.dtype) for _ in range(nm)],
            page_size=page_size,
            scratch_slot=num_slots if scratch else None,
            scratch_page=num_pages if scratch else None,
            kda_layers=kda,
            conv_layers=conv,
        )

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A zeroed pool tensor on the model's device; on a Linux CPU on huge pages that cost nothing until written
        (``fused.huge_page_zeros``): a CPU engine opens without zeroing its whole pool, and decode reads its
        latent rows through fewer TLB entries."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        if not sys.platform.startswith("linux"):  # offset as huge_page_zeros's are: see there
            return torch.zeros(math.prod(shape) + 64, dtype=dtype)[64:].view(shape)
        return huge_page_zeros(math.prod(shape), dtype).view(shape)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, pools: StatePools, check_weights: bool = True
             ) -> tuple[Tensor, CheckpointStates | None]:
        """Run the batch; returns logits [N, vocab] (each sequence's last token) or [T_total, vocab] with
        ``all_logits``, and the states at ``batch.checkpoint_positions`` (None when none were asked).

        ``check_weights`` False: a CPU decode step skips its check that no parameter changed since the last step that
        checked (``_CpuDecodePlan``; ~0.15 ms of a 3 ms ``tiny`` step, every parameter object a cache miss), for a
        caller that knows none did (the engine, between steps of the requests it is running)."""
        if batch.is_decode:
            if self._compiled_rows is None and self._fast_cpu_decode(batch.input_ids):
                # the context lengths from the host: no seq_lens tensor to build, nor to read back each layer
                lens = [s + 1 for s in batch.start]
                return self._decode_cpu(batch.input_ids, batch.slots, batch.page_table, lens, pools, batch.kv_rows,
                                        check_weights), None
            inp = DecodeInputs.from_batch(batch)
            return self._decode(inp, pools, batch.kv_rows), None
        x = self.model.embed_tokens(batch.input_ids)  # [T_total, D]
        h, checkpoints = self._layer_stack(
            x, lambda attn, h, i: attn(h, batch, pools.kda[i], pools.conv[i]), lambda attn, h, j: attn(h, batch, pools.kv[j]))
        assert (checkpoints is not None) == (batch.checkpoint_positions is not None) or not self.config.kda_layer_ids
        if not batch.all_logits:
            h = h[batch.cu_seqlens[1:] - 1]  # each sequence's last token
        return self.lm_head(h).float(), checkpoints

    @torch.inference_mode()
    def decode(self, inp: DecodeInputs, pools: StatePools, kv_rows: Tensor | None = None,
               logits_out: Tensor | None = None) -> Tensor:
        """The graph-safe decode step: one new token per sequence, every input a device tensor of ``inp``; no
        host sync and no shape that depends on values, so it can be captured in a CUDA graph. ``kv_rows``: the new
        tokens' flat cache rows [N] int64 (``DecodeInputs.kv_rows``'s values) where the caller has them, else
        computed on the device. Returns logits [N, vocab] float32: on the GPU path into ``logits_out`` where given
        (a buffer graphs of several batch sizes share)."""
        return self._decode(inp, pools, kv_rows, logits_out)

    @torch.inference_mode()
    def prefill_padded(self, inp: PaddedPrefill, pools: StatePools, logits_out: Tensor | None = None,
                       states_out: CheckpointStates | None = None) -> tuple[Tensor, CheckpointStates | None]:
        """The graph-safe prefill step of short chunks (``PaddedPrefill``: N chunks padded to Tb tokens), what
        ``prefill_graphs.PrefillGraphs`` captures: the same states, cache rows and last-token logits as ``step`` of
        the real tokens, to float rounding (MLA attends absorbed at every context). Returns (logits [N, vocab]
        float32, each chunk's last real token's; with ``inp.ck_lens`` the states after ck_lens[n] tokens of each
        chunk, kda [N, L_kda, H, K, V] float32 and conv [N, L_kda, W - 1, Dc], else None). ``logits_out`` and
        ``states_out``, where given, are written and returned (buffers that graphs of several shapes share)."""
        x = self.model.embed_tokens(inp.input_ids)  # [N * Tb, D]
        valid = inp.valid()
        h, checkpoints = self._layer_stack(
            x, lambda attn, h, i: attn.prefill_padded(h, inp, valid, pools.kda[i], pools.conv[i]),
            lambda attn, h, j: attn.prefill_padded(h, inp, pools.kv[j]), states_out if inp.ck_lens is not None else None)
        logits = self.lm_head(h[inp.last])
        return (logits.float() if logits_out is None else logits_out.copy_(logits)), checkpoints

    def _layer_stack(
        self, x: Tensor, kda: Callable[[KDAAttention, Tensor, int], tuple[Tensor, Tensor | None, Tensor | None]],
        mla: Callable[[MLAttention, Tensor, int], Tensor], states_out: CheckpointStates | None = None,
    ) -> tuple[Tensor, CheckpointStates | None]:
        """Every layer over x [T, D] (a prefill's): the i-th KDA layer's attention through ``kda(attn, h, i)`` ->
        (out [T, D], states [M, H, K, V] | None, conv tails [M, W - 1, Dc] | None), the j-th MLA layer's through
        ``mla(attn, h, j)`` -> [T, D], each with its residual adds and norms. Returns (the final norm's output
        [T, D], the states the KDA layers returned, stacked kda [M, L_kda, H, K, V] and conv [M, L_kda, W - 1, Dc],
        or None where they returned none); with ``states_out`` each layer's are copied into it as they come."""
        ck_kda: list[Tensor] = []
        ck_conv: list[Tensor] = []
        ik = im = 0
        layers = self._layers()
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if isinstance(attn, KDAAttention):
                a, s_at, c_at = kda(attn, h, ik)
                if s_at is not None and c_at is not None:
                    if states_out is not None:
                        states_out.kda[:, ik].copy_(s_at)
                        states_out.conv[:, ik].copy_(c_at)
                    else:
                        ck_kda.append(s_at)
                        ck_conv.append(c_at)
                ik += 1
            else:
                a = mla(attn, h, im)
                im += 1
            x, h = self._residual_norms(i, layer, x, a)
        if states_out is not None:
            return h, states_out
        if not ck_kda:
            return h, None
        return h, CheckpointStates(kda=torch.stack(ck_kda, dim=1), conv=torch.stack(ck_conv, dim=1))

    def compile_cpu_decode(self, weight_dtype: torch.dtype | None = None) -> bool:
        """Run every later CPU decode step of one sequence as one ``torch.compile``d function (inductor's C++): the
        few hundred small ops of a step fused into a few loops, and each one-row matmul one loop that reads its
        weight at the memory's rate (``fused.row_matmul``). The first step compiles it (tens of seconds; less from
        inductor's on-disk cache); batches of several sequences, a GPU and autograd keep the eager path.

        ``weight_dtype``: the dtype of the matmul weights this path reads (default: bfloat16 for each weight
        whose values are all exact in it (``fused.lossless_dtype``), else the model's); torch.bfloat16
        halves the bytes a token reads, summed in float32, at bfloat16's rounding of each weight. Returns False,
        compiling nothing, where the model has layers without a CPU decode path (MoE FFNs, ``fast_cpu`` off)."""
        layers = self._layers()
        if self.device.type != "cpu" or not all(
            layer.self_attn.fast_cpu and isinstance(getattr(layer, "mlp", None), SwiGLU) and layer.mlp.fast_cpu
            for layer in layers
        ):
            return False
        self._compiled_weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._compiled_weights.append(DerivedWeights(
                attn.cpu_decode_sources, partial(attn.cpu_decode_weights, compiled=True, dtype=weight_dtype)))
            self._compiled_weights.append(DerivedWeights(
                partial(weights, mlp, ("gate_proj", "up_proj", "down_proj")), partial(_ffn_weights, mlp, weight_dtype)))
        # its loops on one thread: they stream weights from memory, which one core nearly saturates, and OpenMP's
        # threads in every small loop of a step cost more than they gain on a shared machine (docs/benchmarks.md)
        self._compiled_rows = torch.compile(self._decode_rows, fullgraph=True, options={"cpp.threads": 1})
        self._compiled_for = (self.dtype, self.device)
        self._compiled_warm = False
        return True

    def decode_eagerly(self) -> None:
        """Undo ``compile_cpu_decode``: every later decode step runs eagerly."""
        self._compiled_rows = None
        self._compiled_weights = []

    def _decode_compiled(self, inp: DecodeInputs, pools: StatePools, kv_rows: Tensor) -> Tensor:
        """``_decode`` of one sequence through ``_compiled_rows``: the pool rows it reads and updates (views) and
        the derived weights (checked against their parameters here, outside the graph)."""
        assert self._compiled_rows is not None
        one = int(inp.slots[0])
        kda_rows = [(s[one : one + 1], c[one : one + 1]) for s, c in zip(pools.kda, pools.conv)]
        lats = []
        mla = [la.self_attn for la in self._layers() if isinstance(la.self_attn, MLAttention)]
        for attn, kv in zip(mla, pools.kv):
            lat = attn.context_rows(inp.page_table, inp.seq_lens, kv)[0][0]
            # the context grows every step: one graph for every length (a guard on it fails the compile)
            torch._dynamo.mark_dynamic(lat, 0, min=2, max=1 << 24)
            lats.append(lat)  # [L, r + dr]: without the batch dimension, whose stride follows the page count
        weights = [w.get() for w in self._compiled_weights]
        # dynamo's guards check ~100 tensors a call (~0.2 ms, a tenth of a step): skipped, as every input keeps the
        # dtype, device, rank and layout of the compile (one sequence, contexts of 2 rows or more, weights of the
        # dtype asked for, rebuilt in it when parameters change); a model moved to another dtype decodes eagerly
        if self._compiled_for != (self.dtype, self.device):
            self.decode_eagerly()
            return self._decode(inp, pools, kv_rows)
        out = None
        if self._compiled_warm:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    out = self._compiled_rows(inp.input_ids, kda_rows, lats, weights)
            except RuntimeError as e:  # inputs unlike every compiled graph's (raised before the graph runs)
                if "Recompilation" not in str(e):
                    raise
                log.warning("compiled CPU decode: compiling again for new inputs (%s)", e)
        if out is None:  # the first call compiles, with the guards
            out = self._compiled_rows(inp.input_ids, kda_rows, lats, weights)
            self._compiled_warm = True
        logits, latents = out
        for kv, latent in zip(pools.kv, latents):
            kv.view(-1, kv.shape[-1]).index_copy_(0, kv_rows, latent.to(kv.dtype))
        return logits

    def _decode_rows(self, input_ids: Tensor, kda_rows: list[tuple[Tensor, Tensor]], lats: list[Tensor],
                     weights: list[tuple[Tensor, ...]]) -> tuple[Tensor, list[Tensor]]:
        """The decode step over explicit rows, what ``compile_cpu_decode`` compiles: input_ids [N]; per KDA layer
        its sequences' (state [N, H, K, V], conv tails [N, W - 1, Dc]) rows, updated in place; per MLA layer
        the cached latent rows [L, r + dr] of the one sequence (N = 1); per layer the attention's, then the FFN's derived weights.
        Returns (logits [N, vocab] float32, per MLA layer the new latent rows [N, r + dr] to write)."""
        x = self.model.embed_tokens(input_ids)  # [N, D]
        latents = []
        ik = im = 0
        layers = self._layers()
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if isinstance(attn, KDAAttention):
                a = attn.decode_rows(h, *kda_rows[ik], weights[2 * i])
                ik += 1
            else:
                a, latent = attn.decode_rows(h, lats[im][None], None, weights[2 * i])
                latents.append(latent)
                im += 1
            x, h = layer.post_attention_layernorm.residual(x, a)
            w13, w2 = weights[2 * i + 1]
            gate, up = row_matmul(h, w13).chunk(2, dim=-1)  # SwiGLU: gate | up in one matmul
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = norm.residual(x, row_matmul(F.silu(gate).mul_(up), w2))
        return row_matmul(h, self.lm_head.weight.t()).float(), latents

    def _decode(self, inp: DecodeInputs, pools: StatePools, kv_rows: Tensor | None,
                logits_out: Tensor | None = None) -> Tensor:
        if kv_rows is None:
            kv_rows = inp.kv_rows(pools.page_size)  # [N] on the device
        # one sequence with at least 2 cached rows per MLA layer (0 and 1 would each specialize another graph)
        if (self._compiled_rows is not None and inp.input_ids.shape[0] == 1 and not torch.is_grad_enabled()
                and int(inp.seq_lens[0]) >= 3):
            return self._decode_compiled(inp, pools, kv_rows)
        if self._fast_cpu_decode(inp.input_ids):
            return self._decode_cpu(inp.input_ids, inp.slots, inp.page_table, inp.seq_lens.tolist(), pools, kv_rows)
        x = self.model.embed_tokens(inp.input_ids)  # [N, D]
        ik = im = 0
        layers = self._layers()
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            if isinstance(layer.self_attn, KDAAttention):
                a = layer.self_attn.decode(h, inp.slots, inp.cu_seqlens, pools.kda[ik], pools.conv[ik])
                ik += 1
            else:
                a = layer.self_attn.decode(h, inp.page_table, inp.seq_lens, kv_rows, pools.kv[im])
                im += 1
            x, h = self._residual_norms(i, layer, x, a)
        logits = self.lm_head(h)
        return logits.float() if logits_out is None else logits_out.copy_(logits)

    def _fast_cpu_decode(self, input_ids: Tensor) -> bool:
        """Whether ``_decode_cpu`` runs this step: a CPU, no autograd, every layer on its CPU decode path with
        a dense FFN."""
        if input_ids.is_cuda or torch.is_grad_enabled():
            return False
        plan = self._cpu_plan
        layers = tuple(self.model.layers._modules.values())
        if plan is None or plan.layers != layers:
            plan = self._cpu_plan = _CpuDecodePlan.build(self, layers)
        return plan is not None and plan.enabled()

    def _decode_cpu(self, input_ids: Tensor, slots: Tensor, page_table: Tensor, lens: list[int], pools: StatePools,
                    kv_rows: Tensor | None, check_weights: bool = True) -> Tensor:
        """The eager decode step on a CPU, where each op costs microseconds of overhead beyond its arithmetic (more
        than its hot cost: every step streams more weights than the caches hold): every residual add inside the
        matmul before it (``fused.residual_matmul``: the attention's output projection, the FFN's down projection),
        every norm ``ffn.rms_rows``, the FFN's gate and up one matmul whose halves are views; the parameters checked
        in one pass (``_CpuDecodePlan``); what the KDA and MLA layers read of the pools (slots, context rows) found
        once for all layers. ``lens`` [N]: each sequence's context length, the new token included (the host's copy of
        ``seq_lens``); kv_rows [N] the new tokens' flat cache rows (None: from the page table). Logits match the
        per-layer step's to float rounding (bit for bit on tiny in float32 and bfloat16 at one sequence, but for
        MLA's scores, summed in another order). Returns logits [N, vocab] float32."""
        plan = self._cpu_plan
        assert plan is not None
        if (check_weights or not plan.attn_weights) and plan.watch.changed():
            plan.resolve(self)
        N, P = input_ids.shape[0], pools.page_size
        L = max(lens) - 1  # cached rows before the new tokens, of the longest sequence
        width = -(-max(lens) // P)  # pages of the longest sequence
        # the engine's table is that wide already (a slice of it would cost a step one more op)
        pages = (page_table if page_table.shape[1] == width else page_table[:, :width]).tolist()
        if kv_rows is None:
            kv_rows = torch.tensor([t[(n - 1) // P] * P + (n - 1) % P for t, n in zip(pages, lens)])
        ids = slots.tolist()
        # consecutive slots (one sequence, or a batch in pool order): the first; the KDA layers take views
        s0 = ids[0] if ids == list(range(ids[0], ids[0] + N)) else None
        # one sequence on consecutive pages (a fresh pool's order): its cached rows, a view of each MLA layer's pages
        row0 = pages[0][0] * P if N == 1 and pages[0] == list(range(pages[0][0], pages[0][0] + len(pages[0]))) else None
        seq_lens = torch.tensor(lens, dtype=torch.int32) if row0 is None else None  # else gathered: context_rows
        kda_rows, flats = plan.pool_rows(pools, s0, N)
        x = plan.embed.index_select(0, input_ids)  # [N, D]: F.embedding's kernel without its wrapper (one op fewer)
        ffns, attn_w = plan.ffns, plan.attn_weights
        h = plan.norm(0, x)
        ik = im = 0
        for i, attn in enumerate(plan.attns):
            if isinstance(attn, KDAAttention):
                if s0 is not None and N == 1:
                    x = attn.decode_one(h, *kda_rows[ik], attn_w[i], x)
                elif s0 is not None:
                    x = attn.decode_rows(h, *kda_rows[ik], attn_w[i], x)
                else:
                    x = attn.decode_cpu(h, slots, pools.kda[ik], pools.conv[ik], residual=x)
                ik += 1
            else:
                kv, flat = pools.kv[im], flats[im]  # flat: [pages * P, r + dr]
                if row0 is not None:
                    x, latent = attn.decode_one(h, flat[row0 : row0 + L], attn_w[i], x)  # [L, r + dr]: a view
                else:
                    assert seq_lens is not None
                    lat, mask = attn.context_rows(page_table, seq_lens, kv)
                    x, latent = attn.decode_rows(h, lat, mask, attn_w[i], x)
                flat.index_copy_(0, kv_rows, latent if latent.dtype == kv.dtype else latent.to(kv.dtype))
                im += 1
            h = plan.norm(2 * i + 1, x)
            x = swiglu_residual_rows(h, x, *ffns[i])
            h = plan.norm(2 * i + 2, x)
        logits = row_mm(h, plan.head)  # [N, vocab]
        return logits if logits.dtype == torch.float32 else logits.float()

    def _layers(self) -> list[DecoderLayer]:
        layers = list(self.model.layers)
        assert all(isinstance(layer, DecoderLayer) for layer in layers)
        return layers  # type: ignore[return-value]

    def _residual_norms(self, i: int, layer: DecoderLayer, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """Layer i's two residual adds from its attention output a, each fused with the norm that follows it
        (the FFN's, then the next layer's input norm or the final norm): returns (x, the next normed input)."""
        layers = self.model.layers
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
        assert isinstance(norm, RMSNorm)
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, MoE):  # on a GPU both adds and norms inside the MoE layer's launches
            return moe.residual_block(x, a, layer.post_attention_layernorm, norm)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SwiGLU):
            return mlp.residual_block(x, a, layer.post_attention_layernorm, norm)
        x, h = layer.post_attention_layernorm.residual(x, a)
        return norm.residual(x, layer.ffn(h))

    @torch.inference_mode()
    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [B, T] (fresh sequences) -> logits [B, T, vocab] float32."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        P = 64
        pages = -(-T // P)
        pools = self.allocate_pools(B, B * pages, P)
        table = torch.arange(B * pages, dtype=torch.int32, device=self.device).view(B, pages)
        batch = ForwardBatch(
            input_ids=input_ids.reshape(-1).to(self.device),
            num_new=[T] * B,
            start=[0] * B,
            slots=torch.arange(B, device=self.device),
            page_table=table,
            all_logits=True,
        )
        logits, _ = self.step(batch, pools)
        return logits.view(B, T, -1)


class _CpuDecodePlan:
    """What ``HybridModel._decode_cpu`` reads, resolved once rather than through the module tree every step: the
    layers' attention modules, norms and derived weights, the embedding and head. ``watch`` covers every parameter of
    these modules; a step resolves the weights again (``resolve``, each ``DerivedWeights`` rebuilding what changed)
    only when it reports a change, so a step sees weights loaded, moved or trained in place as before. Built for
    one tuple of layer modules (``layers``): the model builds another when its layers change."""

    def __init__(self, model: HybridModel, layers: tuple[DecoderLayer, ...]) -> None:
        self.layers = layers
        self.attns = [layer.self_attn for layer in layers]
        mlps = [layer.mlp for layer in layers]
        self.mlps: list[SwiGLU] = mlps  # type: ignore[assignment]
        self.norm_modules: list[RMSNorm] = [layers[0].input_layernorm]
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            self.norm_modules += [layer.post_attention_layernorm, nxt]  # type: ignore[list-item]
        mods = [model.model.embed_tokens, model.lm_head, *self.norm_modules]
        mods += [m for attn, mlp in zip(self.attns, mlps) for part in (attn, mlp) for m in part.modules()]
        self.watch = ParamWatch(mods)
        self.attn_weights: list[tuple[Tensor, ...]] = []
        self.ffns: list[tuple[Tensor, ...]] = []
        self.norms: list[tuple[Tensor, Tensor, Tensor] | None] = []
        self.embed = self.head = torch.empty(0)
        self._rows_of: weakref.ref[StatePools] | None = None
        """The pools object of ``_rows`` (weakly: the views are dropped when it is collected)."""
        self._rows_key: tuple[int | None, ...] = ()
        """(ids of the pools' three lists, s0, N) of ``_rows``."""
        self._rows: tuple[list[tuple[Tensor, Tensor]], list[Tensor]] = ([], [])

    @staticmethod
    def build(model: HybridModel, layers: tuple[nn.Module, ...]) -> _CpuDecodePlan | None:
        """The plan, or None where a layer has no CPU decode path (an MoE FFN)."""
        if not all(isinstance(la, DecoderLayer) and isinstance(getattr(la, "mlp", None), SwiGLU) for la in layers):
            return None
        return _CpuDecodePlan(model, layers)  # type: ignore[arg-type]

    def enabled(self) -> bool:
        """Every layer's attention and FFN on its CPU path (``fast_cpu``: off runs the reference)."""
        return all(a.fast_cpu for a in self.attns) and all(m.fast_cpu for m in self.mlps)

    def resolve(self, m: HybridModel) -> None:
        self.attn_weights = [a._cpu.get() for a in self.attns]
        self.ffns = [mlp._cpu.get() for mlp in self.mlps]
        self.embed = m.model.embed_tokens.weight
        self.head = m._cpu_head.get()[0]
        self.norms = []
        for norm in self.norm_modules:
            w = norm.weight
            # ``rms_rows`` where rows and weight are float32, else the module itself
            self.norms.append((w, *norm.rows_consts(w[None])) if w.dtype == torch.float32 == self.embed.dtype else None)

    def pool_rows(self, pools: StatePools, s0: int | None, n: int
                  ) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """Views of ``pools`` a decode step reads: per KDA layer (state, conv tails) of slots s0 .. s0 + n - 1
        ([H, K, V] and [W - 1, Dc] for n = 1, else with the slot dimension; none where s0 is None) and per MLA
        layer its flat cache [pages * P, r + dr].

        Built when the pools object, its lists or the slots change and reused by the steps between: each view costs
        a decode step a few microseconds, the caches cold after its weight stream (14 of them on ``tiny``). The
        views hold the pools' memory: they are dropped when the pools object is collected (a closed engine's pools
        are not kept alive by the model). Tensors swapped into the same lists in place are not seen."""
        key = (id(pools.kda), id(pools.conv), id(pools.kv), s0, n)  # the lists live as long as the pools object
        if self._rows_of is not None and self._rows_of() is pools and self._rows_key == key:
            return self._rows
        if s0 is None:
            kda: list[tuple[Tensor, Tensor]] = []
        elif n == 1:
            kda = [(s[s0], c[s0]) for s, c in zip(pools.kda, pools.conv)]
        else:
            kda = [(s[s0 : s0 + n], c[s0 : s0 + n]) for s, c in zip(pools.kda, pools.conv)]
        flats = [kv.view(-1, kv.shape[-1]) for kv in pools.kv]
        plan = weakref.ref(self)

        def drop(_: object) -> None:
            p = plan()
            if p is not None:
                p._rows_of, p._rows_key, p._rows = None, (), ([], [])

        self._rows_of, self._rows_key, self._rows = weakref.ref(pools, drop), key, (kda, flats)
        return self._rows

    def norm(self, i: int, x: Tensor) -> Tensor:
        """The step's i-th norm (the first layer's input norm, then each layer's post-attention and next norms)."""
        n = self.norms[i]
        return rms_rows(x, *n) if n is not None else self.norm_modules[i](x)


def _ffn_weights(mlp: SwiGLU, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """A dense FFN's weights for ``row_matmul`` under torch.compile: (w13 [D, 2F]: gate | up columns, w2 [F, D])."""
    w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    return reduction_weight(w13, dtype), reduction_weight(mlp.down_proj.weight, dtype)

