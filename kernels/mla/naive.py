"""Plain-torch twins of MLA attention over the compressed latent cache (NoPE, KDA.md).

The cache holds, per token, the normed latent c [r] and the shared k_pe [dr], stored together as one row of
r + dr numbers. Pages: kv_pages [num_pages, P, r + dr]; page_table [N, max_pages] int32 maps a sequence's
i-th page to a pool page; seq_lens [N] counts the cached tokens (the new token included, for decode).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_latent(kv_pages: Tensor, pages: Tensor, length: int) -> Tensor:
    """The first ``length`` rows [length, r + dr] of a sequence whose page ids are ``pages`` [max_pages]."""
    P = kv_pages.shape[1]
    n = -(-length // P)
    return kv_pages[pages[:n].long()].reshape(n * P, -1)[:length]


def latent_rows(kv_pages: Tensor, pages: Tensor, begin: int, end: int) -> Tensor:
    """Rows begin .. end - 1 [end - begin, r + dr] of a sequence whose page ids are ``pages`` [max_pages]."""
    P = kv_pages.shape[1]
    p0, p1 = begin // P, -(-end // P)
    return kv_pages[pages[p0:p1].long()].reshape((p1 - p0) * P, -1)[begin - p0 * P : end - p0 * P]


def naive_mla_prefill(
    q: Tensor, latent: Tensor, w_kv_b: Tensor, dn: int, dv: int, scale: float, start: int
) -> Tensor:
    """Causal attention of T new queries over L = start + T cached tokens, decompressing K and V.

    q [T, H, dn + dr]; latent [L, r + dr]; w_kv_b [H * (dn + dv), r] (kv_b_proj weight). The query at
    position start + t sees keys 0..start + t. Returns o [T, H, dv] in q's dtype."""
    T, H, _ = q.shape
    L = latent.shape[0]
    r = w_kv_b.shape[1]
    if start + T != L:
        raise ValueError(f"latent must hold start + T = {start + T} rows, got {L}")
    c, k_pe = latent[:, :r], latent[:, r:]
    kv = (c @ w_kv_b.t()).view(L, H, dn + dv)  # decompress every cached token
    k = torch.cat([kv[..., :dn], k_pe[:, None, :].expand(L, H, k_pe.shape[-1])], dim=-1)  # [L, H, dn + dr]
    v = kv[..., dn:]
    scores = torch.einsum("thd,lhd->htl", q.float(), k.float()) * scale
    pos = torch.arange(L, device=q.device)
    mask = pos[None, :] <= (start + torch.arange(T, device=q.device))[:, None]  # [T, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v.float()).to(q.dtype)


def naive_mla_prefill_paged(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float, tile: int = 1024
) -> Tensor:
    """``naive_mla_prefill`` over the paged cache, one tile of ``tile`` cached tokens at a time with an online
    softmax, so memory stays O(T x tile) whatever the context: the CPU path of prefill.

    q [T, H, dn + dr] (the queries of positions start .. start + T - 1, whose latent rows are already in the cache);
    kv_pages [num_pages, P, r + dr]; pages [max_pages] the sequence's page ids; w_kv_b [H * (dn + dv), r].
    Returns o [T, H, dv] in q's dtype."""
    T, H, dk = q.shape
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dn = dk - dr
    L = start + T
    w = w_kv_b.float()
    qf = q.float().transpose(0, 1)  # [H, T, dk]
    qpos = start + torch.arange(T, device=q.device)
    acc = torch.zeros(H, T, dv, device=q.device)
    m = torch.full((H, T, 1), float("-inf"), device=q.device)
    den = torch.zeros(H, T, 1, device=q.device)
    for b0 in range(0, L, tile):
        b1 = min(L, b0 + tile)
        i0 = max(0, b0 - start)  # queries before the tile's first key see none of it
        lat = latent_rows(kv_pages, pages, b0, b1).float()  # [n, r + dr]
        n = b1 - b0
        kv = (lat[:, :r] @ w.t()).view(n, H, dn + dv)  # decompress the tile
        k = torch.cat([kv[..., :dn], lat[:, None, r:].expand(n, H, dr)], dim=-1).transpose(0, 1)  # [H, n, dk]
        v = kv[..., dn:].transpose(0, 1)  # [H, n, dv]
        s = (qf[:, i0:] @ k.transpose(1, 2)) * scale  # [H, T - i0, n]
        keep = torch.arange(b0, b1, device=q.device)[None, :] <= qpos[i0:, None]  # [T - i0, n]
        s = s.masked_fill(~keep, float("-inf"))
        m_new = torch.maximum(m[:, i0:], s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that have seen no key yet
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m[:, i0:] - m_safe)
        den[:, i0:] = den[:, i0:] * alpha + p.sum(-1, keepdim=True)
        acc[:, i0:] = acc[:, i0:] * alpha + p @ v
        m[:, i0:] = m_new
    return (acc / den).transpose(0, 1).to(q.dtype)


def naive_mla_decode_paged(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """One query per sequence over its paged latent cache, with kv_b_proj absorbed into the query.

    q_lat [N, H, r] (q_nope @ W_uk per head), q_pe [N, H, dr], kv_pages [num_pages, P, r + dr],
    page_table [N, max_pages] int32, seq_lens [N]. Returns the attention-weighted latent [N, H, r]
    (multiply by W_uv per head for the values), in q_lat's dtype."""
    r = q_lat.shape[-1]
    out = torch.empty_like(q_lat)
    for n, length in enumerate(seq_lens.tolist()):
        lat = gather_latent(kv_pages, page_table[n], int(length)).float()  # [L, r + dr]
        scores = (q_lat[n].float() @ lat[:, :r].t() + q_pe[n].float() @ lat[:, r:].t()) * scale  # [H, L]
        out[n] = (scores.softmax(-1) @ lat[:, :r]).to(q_lat.dtype)
    return out


def naive_mla_decode_prep(
    y: Tensor, w_kv_b: Tensor, norm_w: Tensor, eps: float, kv_pages: Tensor, kv_rows: Tensor, H: int, dn: int
) -> tuple[Tensor, Tensor]:
    """What a decode step does between the input projection and attention, as separate ops.

    y [N, H * (dn + dr) + r + dr]: per head q_nope [dn] | q_pe [dr], then the latent c [r] and k_pe [dr];
    w_kv_b [H * (dn + dv), r] (kv_b_proj's weight); norm_w [r] (kv_a_layernorm's). Writes each sequence's new
    cache row [rms_norm(c), k_pe] at flat row ``kv_rows[n]`` of ``kv_pages`` [num_pages, P, r + dr]. Returns
    (q_lat [N, H, r] = q_nope @ W_uk per head, q_pe [N, H, dr]), in y's dtype, sums in float32."""
    N = y.shape[0]
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    q = y[:, : H * (dn + dr)].reshape(N, H, dn + dr)
    c, k_pe = y[:, H * (dn + dr) : H * (dn + dr) + r], y[:, H * (dn + dr) + r :]
    cf = c.float()
    c = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()).to(y.dtype)
    kv_pages.view(-1, r + dr).index_copy_(0, kv_rows.long(), torch.cat([c, k_pe], -1).to(kv_pages.dtype))
    w_uk = w_kv_b.view(H, -1, r)[:, :dn].float()  # [H, dn, r]
    q_lat = torch.einsum("nhd,hdr->nhr", q[..., :dn].float(), w_uk).to(y.dtype)
    return q_lat, q[..., dn:].contiguous()
