"""The NoPE MLA layer. Its cache holds only the normed latent c [r] and k_pe [dr] per token, in pages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from ..kernels.linear import head_linear, linear
from ..kernels.mla import (
    mla_decode_paged,
    mla_decode_prep,
    mla_prefill_absorbed,
    mla_prefill_absorbed_padded,
    mla_prefill_paged,
)
from .batch import DecodeInputs, ForwardBatch, PaddedPrefill
from .ffn import RMSNorm
from .fused import (
    DerivedWeights,
    reduction_weight,
    residual_matmul,
    row_matmul,
    row_matmul_weight,
    row_mm,
    weights,
)

ABSORBED_MAX_TOKENS = 128
ABSORBED_MIN_CONTEXT = 65536
"""On a GPU, a sequence's prefill chunk of at most ``ABSORBED_MAX_TOKENS`` tokens after at least
``ABSORBED_MIN_CONTEXT`` cached ones attends with kv_b_proj absorbed, as decode does (``mla_prefill_absorbed``), not
through the decompressed flash kernel, which decompresses every cached row whatever the chunk's length
(kernels/mla/absorbed.py). H100, Kimi-Linear's MLA shape, one call's device time back to back (``bench/mla_prefill.py
--short --contexts 32768,131072,1048576 --chunks 16,64,128,256,512,1024``, 2026-12-07 06:50 UTC): after 128K cached
tokens 1.1 / 1.6 / 3.0 / 5.8 ms absorbed for 16 / 64 / 128 / 256 tokens against 3.2 / 3.1 / 3.2 / 3.8 decompressed
(its blocks' keys split, ``prefill.key_splits``); after 1M 2.9 / 10.1 / 19.9 / 40.3 against 25.6 / 26.2 / 26.9 /
31.8; after 32K decompressed wins at every length (0.84 ms for 16 tokens against 1.8, the absorbed call bound by
its host call, ~1.2-2 ms)."""


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.r = H, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.scale = (self.dn + self.dr) ** -0.5
        dq = H * (self.dn + self.dr)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, dq, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.r + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.r, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)
        self._cpu = DerivedWeights(self.cpu_decode_sources, self.cpu_decode_weights)
        self._gpu = DerivedWeights(lambda: weights(self, ("q_proj", "kv_a_proj_with_mqa")), self._gpu_weights)
        """GPU decode's input weight (``_gpu_weights``), built once rather than concatenated in every step."""
        self.fused_decode = True
        """Decode on a GPU through ``_decode_gpu`` (False: the separate projections, norm, page write and
        einsums, its twin in the model)."""
        self.fast_cpu = True
        """Decode on a CPU through ``_decode_cpu`` (False: through the paged-decode twin, the reference)."""

    def _query(self, x: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (q [T, H, dn + dr], latent [T, r + dr]: the normed c and k_pe, what the cache keeps)."""
        T = x.shape[0]
        r = self.r
        q = self._query(x).view(T, self.H, self.dn + self.dr)
        kv_a = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(kv_a[:, :r]), kv_a[:, r:]], dim=-1)  # [T, r + dr]
        return q, latent

    def forward(self, x: Tensor, batch: ForwardBatch, kv_pages: Tensor) -> Tensor:
        """x [T, D] packed; appends each new token's latent row to ``kv_pages`` [num_pages, P, r + dr] at its
        position, then attends. Returns [T, D]."""
        if batch.is_decode:
            inp = DecodeInputs.from_batch(batch)
            rows = batch.kv_rows if batch.kv_rows is not None else inp.kv_rows(kv_pages.shape[1])
            return self.decode(x, inp.page_table, inp.seq_lens, rows, kv_pages)
        T = x.shape[0]
        q, latent = self._project(x)
        self._write(latent, batch, kv_pages)
        o = self._prefill(q, batch, kv_pages)
        return self.o_proj(o.reshape(T, self.H * self.dv))

    def prefill_padded(self, x: Tensor, inp: PaddedPrefill, kv_pages: Tensor) -> Tensor:
        """``forward`` of a padded prefill (``PaddedPrefill``), graph-safe: x [N * Tb, D]; writes every token's
        latent row (the padding's to the scratch page), then attends absorbed (``mla_prefill_absorbed_padded``).
        Returns [N * Tb, D] (padding rows: garbage)."""
        N, Tb = inp.num_seqs, inp.chunk
        q, latent = self._project(x)
        latent = latent.to(kv_pages.dtype)  # as the pages keep it
        kv_pages.view(-1, kv_pages.shape[-1]).index_copy_(0, inp.kv_rows, latent)
        o = mla_prefill_absorbed_padded(
            q.view(N, Tb, self.H, self.dn + self.dr), latent.view(N, Tb, -1), kv_pages, inp.page_table, inp.starts,
            self.kv_b_proj.weight, self.dv, self.scale, inp.mla_splits,
        )
        return self.o_proj(o.reshape(N * Tb, self.H * self.dv))

    def decode(self, x: Tensor, page_table: Tensor, seq_lens: Tensor, kv_rows: Tensor, kv_pages: Tensor) -> Tensor:
        """One new token per sequence, graph-safe (no host sync, fixed shapes): x [N, D], page_table [N, max_pages]
        int32, seq_lens [N] int32 (the new token included), kv_rows [N] int64 flat cache row of each new token.
        Writes the new latent rows into ``kv_pages`` and returns [N, D]."""
        if self.fast_cpu and not x.is_cuda and not torch.is_grad_enabled():  # fused weights are detached
            return self.decode_cpu(x, page_table, seq_lens, kv_rows, kv_pages)
        if x.is_cuda and self.fused_decode and hasattr(self, "q_proj"):
            return self._decode_gpu(x, page_table, seq_lens, kv_rows, kv_pages)
        N = x.shape[0]
        q, latent = self._project(x)
        kv_pages.view(-1, kv_pages.shape[-1]).index_copy_(0, kv_rows, latent.to(kv_pages.dtype))
        o = self._decode(q, page_table, seq_lens, kv_pages)
        return self.o_proj(o.reshape(N, self.H * self.dv))

    def _decode_gpu(self, x: Tensor, page_table: Tensor, seq_lens: Tensor, kv_rows: Tensor, kv_pages: Tensor
                    ) -> Tensor:
        """``decode`` on a GPU in six launches: q | kv_a in one matvec, ``mla_decode_prep`` (the latent's norm and
        page write, the query absorbed), the split and merge of ``mla_decode_paged``, the values (W_uv per head)
        and o_proj."""
        N = x.shape[0]
        H, dn, dv = self.H, self.dn, self.dv
        y = linear(x, self._gpu.get()[0])  # [N, H * (dn + dr) + r + dr]
        q_lat, q_pe = mla_decode_prep(y, self.kv_b_proj.weight, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                                      kv_pages, kv_rows, H, dn)
        o_lat = mla_decode_paged(q_lat, q_pe, kv_pages, page_table, seq_lens, self.scale)  # [N, H, r]
        w_uv = self.kv_b_proj.weight.view(H, dn + dv, self.r)[:, dn:]
        o = head_linear(o_lat, w_uv)  # [N, H, dv]: W_uv read in place
        return linear(o.reshape(N, H * dv), self.o_proj.weight)

    def _gpu_weights(self) -> tuple[Tensor]:
        """(w_in [H * (dn + dr) + r + dr, D]: q_proj's rows, then kv_a_proj_with_mqa's), as ``F.linear`` takes it."""
        return (torch.cat([self.q_proj.weight, self.kv_a_proj_with_mqa.weight]),)

    def cpu_decode_sources(self) -> list[Tensor]:
        """The parameters ``cpu_decode_weights`` reads."""
        q = ("q_proj",) if "q_proj" in self._modules else ("q_a_proj", "q_b_proj")
        return weights(self, (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))

    def cpu_decode_weights(self, compiled: bool = False, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
        """Weight absorption folded into the projections, computed in float32 and stored in the model's dtype, each
        an [in, out] operand of ``x @ w`` in the layout a CPU's one-row matmul reads fastest (``row_matmul_weight``).
        (w_in [D, H * (r + dr) + r + dr]: per head the absorbed latent query, scaled, then the scaled q_pe
        columns, then kv_a; or, with a q LoRA, w_in [D, q_lora + r + dr] and w_q [q_lora, H * (r + dr)];
        w_out [H * r, D]: kv_b's value part absorbed into o_proj). With ``compiled``, laid out as ``row_matmul`` sums
        them under torch.compile (``reduction_weight``, in ``dtype``, default the model's)."""
        H, dn, dr, dv, r = self.H, self.dn, self.dr, self.dv, self.r
        dt = self.o_proj.weight.dtype
        w_kv = self.kv_b_proj.weight.float().view(H, dn + dv, r)
        w_q = (self.q_proj.weight if hasattr(self, "q_proj") else self.q_b_proj.weight).float()
        w_q = w_q.view(H, dn + dr, -1)  # [H, dn + dr, D or q_lora]
        # q_lat[h] = q_nope[h] @ w_uk[h]: [r, D or q_lora] per head, then the q_pe rows, both times the scale
        q_abs = torch.cat([w_kv[:, :dn].transpose(1, 2) @ w_q[:, :dn], w_q[:, dn:]], dim=1) * self.scale
        q_abs = q_abs.reshape(H * (r + dr), -1)
        # o = o_proj(o_lat[h] @ w_uv[h]^T): w_out[:, h r:(h+1) r] = o_proj[:, h dv:(h+1) dv] @ w_uv[h]
        w_o = self.o_proj.weight.float().view(-1, H, dv).transpose(0, 1)  # [H, D, dv]
        w_out = (w_o @ w_kv[:, dn:]).transpose(0, 1).reshape(-1, H * r)  # [D, H * r]
        mm = (lambda w: reduction_weight(w, dtype)) if compiled else row_matmul_weight
        if hasattr(self, "q_proj"):
            w_in = torch.cat([q_abs, self.kv_a_proj_with_mqa.weight.float()]).to(dt)
            return mm(w_in), mm(w_out.to(dt))
        w_in = torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight])
        return mm(w_in), mm(w_out.to(dt)), mm(q_abs.to(dt))

    def decode_cpu(self, x: Tensor, page_table: Tensor, seq_lens: Tensor, kv_rows: Tensor, kv_pages: Tensor,
                   residual: Tensor | None = None) -> Tensor:
        """``decode`` on a CPU: ``decode_rows`` over the cached rows of ``context_rows``, then the new latent rows
        written to the pages. With ``residual`` [N, D] it returns residual + the layer's output, the add inside
        the output projection's matmul."""
        lat, mask = self.context_rows(page_table, seq_lens, kv_pages)
        out, latent = self.decode_rows(x, lat, mask, self._cpu.get(), residual)
        kv_pages.view(-1, kv_pages.shape[-1]).index_copy_(
            0, kv_rows, latent if latent.dtype == kv_pages.dtype else latent.to(kv_pages.dtype))
        return out

    def context_rows(self, page_table: Tensor, seq_lens: Tensor, kv_pages: Tensor) -> tuple[Tensor, Tensor | None]:
        """The cached latent rows before each sequence's new token, up to the longest, as a CPU may sync:
        (lat [N, L, r + dr], L = max(seq_lens) - 1, a view of the pages for one sequence on consecutive pages;
        for N > 1 the mask [N, 1, L + 1] of the padded rows, True, the new token's column last)."""
        N, P = page_table.shape[0], kv_pages.shape[1]
        L = int(seq_lens.max()) - 1
        pages = page_table[:, : -(-L // P)].reshape(-1)
        ids = pages.tolist() if N == 1 else []
        if ids and ids == list(range(ids[0], ids[0] + len(ids))):
            lat = kv_pages[ids[0] : ids[0] + len(ids)]  # consecutive pages (a fresh pool's order): no copy
        else:  # gathered into a buffer like the pool's own views for a compiled step: an inference tensor or not
            # as the pool is, at a storage offset as they are (fused.huge_page_zeros)
            with torch.inference_mode(kv_pages.is_inference()):
                buf = kv_pages.new_empty(pages.numel() * kv_pages[0].numel() + 64)[64:]
            lat = torch.index_select(kv_pages, 0, pages, out=buf.view(-1, *kv_pages.shape[1:]))
        lat = lat.view(N, -1, kv_pages.shape[-1])[:, :L]
        if N == 1:
            return lat, None
        pos = torch.arange(L + 1)
        pad = (pos[None, :] >= seq_lens[:, None] - 1) & (pos[None, :] < L)  # [N, L + 1]
        return lat, pad[:, None, :]

    def decode_rows(self, x: Tensor, lat: Tensor, mask: Tensor | None, w: tuple[Tensor, ...],
                    residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One new token of N sequences on a CPU in few ops: kv_b_proj absorbed into the query and output
        projections (one matmul in, one out), attention on the latent rows of all N sequences at once: their
        cached rows ``lat`` [N, L, r + dr] (padded to the longest, ``mask`` [N, 1, L + 1] True where padded, or
        None) and the new token's own. Traceable by ``torch.compile``. x [N, D]; w, ``cpu_decode_weights``. Returns
        (out [N, D], plus ``residual`` [N, D] where given (``fused.residual_matmul``, eager only); the new latent rows
        [N, r + dr] for the caller to write to the pages). The same math as the paged-decode twin in another order
        of sums: outputs match to float rounding."""
        N = x.shape[0]
        compiling = torch.compiler.is_compiling()
        if N == 1 and not compiling:
            return self.decode_one(x, lat[0], w, residual)
        H, dr, r = self.H, self.dr, self.r
        L = lat.shape[1]
        y = row_matmul(x, w[0])
        # views taken by one split: each op of a step costs a few microseconds
        q, c, k_pe = torch.split_with_sizes(y, [y.shape[1] - r - dr, r, dr], 1)
        if len(w) == 3:
            q = row_matmul(self._norm(self.q_a_layernorm, q, compiling), w[2])
        latent = torch.cat([self._norm(self.kv_a_layernorm, c, compiling), k_pe], dim=-1)  # [N, r + dr]
        # as the pages will hold it: [N, 1, r + dr] (casts skipped where they change nothing: each op of a step
        # costs a few microseconds)
        new = latent if latent.dtype == lat.dtype else latent.to(lat.dtype)
        new = (new if new.dtype == x.dtype else new.to(x.dtype))[:, None, :]
        lat = lat if lat.dtype == x.dtype else lat.to(x.dtype)
        q = q.view(N, H, r + dr)
        # [N, H, L + 1]: the cached rows, then the new one; the scale is in the weights
        scores = torch.cat([q @ lat.transpose(1, 2), (q * new).sum(-1, keepdim=True)], dim=-1)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        scores = scores if scores.dtype == torch.float32 else scores.float()
        if torch.compiler.is_compiling():
            # inductor's C++ sums more than 4,096 float32 values on a slower, cascaded path, and picks it by the
            # context length the graph was compiled at (guarding it): summed in float64, one graph takes every length
            e = (scores - scores.amax(-1, keepdim=True)).exp()
            probs = e / e.double().sum(-1, keepdim=True).float()
        else:
            probs = scores.softmax(-1)
        # weights below 1e-30 move no float32 sum, and as subnormals (exp below -87) they slow the matmul 4-50x
        probs = F.threshold(probs, 1e-30, 0.0)
        probs = probs if probs.dtype == x.dtype else probs.to(x.dtype)
        # over the whole rows, k_pe columns included: a matmul over the strided c columns alone runs far slower
        p_old, p_new = torch.split_with_sizes(probs, [L, 1], 2)
        o_lat = torch.baddbmm(p_new * new, p_old, lat)[:, :, :r].reshape(N, H * r)
        if residual is not None:
            return residual_matmul(residual, o_lat, w[1]), latent
        return row_matmul(o_lat, w[1]), latent

    def decode_one(self, x: Tensor, lat: Tensor, w: tuple[Tensor, ...], residual: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
        """``decode_rows`` of one sequence, eagerly (what it runs for N = 1), in 2-d ops: x [1, D], its cached rows
        lat [L, r + dr] (a view of the pages), the row-major operand of both matmuls (BLAS reads them ~2x faster
        than as the transposed one of q @ lat^T, and ~1.3x faster than batched). Returns (out [1, D], plus
        ``residual`` where given; the new latent row [1, r + dr])."""
        H, dr, r = self.H, self.dr, self.r
        y = row_mm(x, w[0])
        # views taken by one split: each op of a step costs a few microseconds (as do casts that change nothing)
        q, c, k_pe = torch.split_with_sizes(y, [y.shape[1] - r - dr, r, dr], 1)
        if len(w) == 3:
            q = row_mm(self._norm(self.q_a_layernorm, q, False), w[2])
        latent = torch.cat([self._norm(self.kv_a_layernorm, c, False), k_pe], dim=-1)  # [1, r + dr]
        new = latent if latent.dtype == lat.dtype else latent.to(lat.dtype)  # as the pages will hold it
        new = new if new.dtype == x.dtype else new.to(x.dtype)
        lat = lat if lat.dtype == x.dtype else lat.to(x.dtype)
        q = q.view(H, r + dr)
        # [H, L + 1]: the cached rows, then the new one; the scale is in the weights
        scores = torch.cat([torch.mm(lat, q.t()).t(), (q * new).sum(-1, keepdim=True)], dim=-1)
        probs = (scores if scores.dtype == torch.float32 else scores.float()).softmax(-1)
        probs = F.threshold(probs, 1e-30, 0.0)  # see decode_rows
        probs = probs if probs.dtype == x.dtype else probs.to(x.dtype)
        p_old, p_new = torch.split_with_sizes(probs, [lat.shape[0], 1], 1)
        o_lat = torch.addmm(p_new * new, p_old, lat)[:, :r].reshape(1, H * r)
        if residual is not None:
            return residual_matmul(residual, o_lat, w[1]), latent
        return row_mm(o_lat, w[1]), latent

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor, compiling: bool) -> Tensor:
        """``norm(x)``; eagerly ``RMSNorm.rows``, its values in fewer ops."""
        assert isinstance(norm, RMSNorm)
        return norm(x) if compiling else norm.rows(x)

    def _write(self, latent: Tensor, batch: ForwardBatch, kv_pages: Tensor) -> None:
        idx = batch.kv_rows
        if idx is None:  # no host-side rows given: derive them from the page table (one device-to-host copy)
            rows = ForwardBatch.rows_for(batch.page_table.tolist(), batch.start, batch.num_new, kv_pages.shape[1])
            idx = torch.tensor(rows, dtype=torch.long, device=latent.device)
        kv_pages.view(-1, kv_pages.shape[-1]).index_copy_(0, idx, latent.to(kv_pages.dtype))

    def _prefill(self, q: Tensor, batch: ForwardBatch, kv_pages: Tensor) -> Tensor:
        """q [T_total, H, dn + dr] packed -> o [T_total, H, dv]: each sequence's new queries over its cached
        prefix and themselves (their latent rows are already written), in tiles: memory O(chunk x tile)."""
        w = self.kv_b_proj.weight  # [H * (dn + dv), r]
        outs = []
        offset = 0
        for n, (s, t) in enumerate(zip(batch.start, batch.num_new)):
            absorbed = q.is_cuda and t <= ABSORBED_MAX_TOKENS and s >= ABSORBED_MIN_CONTEXT
            attend = mla_prefill_absorbed if absorbed else mla_prefill_paged
            outs.append(attend(q[offset : offset + t], kv_pages, batch.page_table[n], s, w, self.dv,
                               self.scale))  # [t, H, dv]
            offset += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, q: Tensor, page_table: Tensor, seq_lens: Tensor, kv_pages: Tensor) -> Tensor:
        """Weight absorption: attend on the latent directly, then map to values. q [N, H, dn + dr] -> [N, H, dv]."""
        H, dn, dv, r = self.H, self.dn, self.dv, self.r
        w = self.kv_b_proj.weight.view(H, dn + dv, r)
        q_lat = torch.einsum("nhd,hdr->nhr", q[..., :dn], w[:, :dn])  # [N, H, r]
        o_lat = mla_decode_paged(
            q_lat, q[..., dn:].contiguous(), kv_pages, page_table, seq_lens, self.scale
        )  # [N, H, r]
        return torch.einsum("nhr,hvr->nhv", o_lat.to(q.dtype), w[:, dn:])
