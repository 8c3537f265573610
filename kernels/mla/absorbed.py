"""MLA prefill of a short chunk with kv_b_proj absorbed, as decode runs it: attention on the latent rows.

The decompressed flash kernel (prefill.py) turns every cached row into per-head keys and values once per chunk:
2 r H (dn + dv) flops a cached row whatever the chunk's length, 4.4 TFLOP for 4 MLA layers after 128K cached
tokens, and ~2 GB of decompressed keys and values written and read back a layer. A chunk of T queries absorbed costs
2 T H (2 r + dr) flops a cached row instead, and reads each row once: fewer flops below T ~ 170 (at r 512, dr 64,
dn = dv 128), and no decompressed rows at all. An agent's tool output appended to a long conversation is such a
chunk.

The T queries of positions start .. start + T - 1 attend over two parts, merged by their log-sum-exps:
  cached  rows [0, start): the paged decode kernel (paged_decode.py, "tokens" form) with the T queries as the T x H
          heads of one sequence, so every cached row is read once for all of them (a split's head blocks run side
          by side: the row is read from L2 after the first);
  new     rows [start, start + T) (written to the pages before the attention), causal: [T, H, T] scores in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .paged_decode import _LOG2E, _launch

HEAD_BLOCK = 32
"""Query rows (token, head) a split program takes: the decode kernel's own block at H 32."""


def mla_prefill_absorbed(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float
) -> Tensor:
    """``mla_prefill_paged``'s arguments and result (q [T, H, dn + dr]; kv_pages [num_pages, P, r + dr]; pages
    [max_pages] int; w_kv_b [H * (dn + dv), r]) -> o [T, H, dv] in q's dtype, absorbed (see the module docstring).
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. No host sync."""
    T, H, dk = q.shape
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dn = dk - dr
    P = kv_pages.shape[1]
    w = w_kv_b.view(H, dn + dv, r)
    q_lat = torch.einsum("thd,hdr->thr", q[..., :dn], w[:, :dn])  # [T, H, r]
    q_pe = q[..., dn:]
    # the new rows (already in the pages), causal among themselves, in float32
    pos = torch.arange(start, start + T, device=q.device)
    new = kv_pages[pages[pos // P].long(), pos % P].float()  # [T, r + dr]
    s = (torch.einsum("thr,jr->thj", q_lat.float(), new[:, :r]) + torch.einsum("thd,jd->thj", q_pe.float(),
                                                                                 new[:, r:])) * scale
    causal = torch.arange(T, device=q.device)[None, :] > torch.arange(T, device=q.device)[:, None]  # [T, j]
    s.masked_fill_(causal[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, H], natural log
    o = torch.einsum("thj,jr->thr", (s - lse[..., None]).exp_(), new[:, :r])  # [T, H, r]
    if start > 0:
        # splits for about two waves of (head block, split) programs: more would only add partials to merge (their
        # traffic grows with T x H), fewer leave multiprocessors idle
        sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        blocks = -(-(T * H) // HEAD_BLOCK)
        splits = max(1, min(-(-start // 256), 2 * sm // blocks))
        lse_c = torch.empty(1, T * H, device=q.device, dtype=torch.float32)
        o_c = _launch(q_lat.reshape(1, T * H, r).contiguous(), q_pe.reshape(1, T * H, dr).to(q_lat.dtype).contiguous(),
                      kv_pages.contiguous(), pages[None, :].to(torch.int32).contiguous(),
                      torch.full((1,), start, device=q.device, dtype=torch.int32), float(scale), num_splits=splits,
                      BH=HEAD_BLOCK, form="tokens", lse_out=lse_c)
        lse_c = lse_c.view(T, H) / _LOG2E  # base 2 -> natural
        both = torch.logaddexp(lse, lse_c)
        o = o * (lse - both).exp_()[..., None] + o_c.view(T, H, r).float() * (lse_c - both).exp_()[..., None]
    return torch.einsum("thr,hvr->thv", o.to(q.dtype), w[:, dn:])
