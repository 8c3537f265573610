"""MLA paged decode, candidate v6: the shipped "tokens" split kernel with Triton's automatic warp specialisation
of its tile loop (``tl.range(..., warp_specialize=WS)``), to find whether producer/consumer warps hide the
serial load -> product -> softmax -> product chain of one warpgroup (bench/candidates/README.md). Launch knob
``WS`` (default True); everything else is the shipped kernel's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .paged_decode import _LOG2E, _combine_kernel_lse, _num_splits_tokens, _split_setup


# the split kernel of the "tokens" form: as _split_kernel, with the products transposed and normalised partials
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel_tokens(
    q_lat, q_pe, kv, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr,
    PAGE_TILE: tl.constexpr, WS: tl.constexpr,
):
    # head blocks vary fastest, so the programs that share a split's cache rows run together (one DRAM read)
    hb = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.program_id(2)
    start, end, rh, rr, rd, mh, ql, qp = _split_setup(q_lat, q_pe, seq_lens, s, n, hb, tokens_per_split,
                                                      H, R, DR, BH, BR, BDR)
    qlt = tl.trans(ql)  # [BR, BH]
    qpt = tl.trans(qp)  # [BDR, BH]
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BR, BH], dtype=tl.float32)  # acc^T
    pt = page_table + n.to(tl.int64) * max_pages
    for t0 in tl.range(start, end, BN, warp_specialize=WS):
        tok = t0 + tl.arange(0, BN)
        mt = tok < end
        # page ids masked and clamped to the sequence's row: no copy of these loads that the pipeliner issues
        # ahead can address past the table
        if PAGE_TILE:  # BN divides P and every tile starts at a multiple of BN: the tile lies in one page
            page = tl.load(pt + tl.minimum(t0 // P, max_pages - 1), mask=t0 < end, other=0).to(tl.int64)
            row = (page * P + t0 % P + tl.arange(0, BN)) * (R + DR)
        else:
            page = tl.load(pt + tl.minimum(tok // P, max_pages - 1), mask=mt, other=0).to(tl.int64)
            row = (page * P + tok % P) * (R + DR)
        row = tl.multiple_of(row, ALIGN)  # [BN] cache-row offsets: 16-byte vectors
        c = tl.load(kv + row[:, None] + rr[None, :], mask=mt[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(kv + row[:, None] + R + rd[None, :], mask=mt[:, None] & (rd[None, :] < DR), other=0.0)
        sc = tl.dot(c, qlt) + tl.dot(pe, qpt)  # [BN, BH]
        sc = tl.where(mt[:, None], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        p = tl.exp2(sc - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype))
        m_i = m_new
    # a split past the sequence's end (l = 0) stores a zero output and log-sum-exp -1e30: weight 0 in the merge
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log2(l_safe), -1.0e30)
    base = (n * NSPLIT + s) * H + rh
    o = acc * (1.0 / l_safe)[None, :]
    tl.store(o_part + base[None, :].to(tl.int64) * R + rr[:, None], o.to(o_part.dtype.element_ty),
             mask=mh[None, :] & (rr[:, None] < R))
    tl.store(lse_part + base, lse, mask=mh)



def _launch(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None, BN: int | None = None, BH: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, form: str | None = None, WS: bool = True,
) -> Tensor:
    """The shipped ``_launch`` for form "tokens", with ``WS`` (warp-specialised tile loop)."""
    if form not in (None, "tokens"):
        raise ValueError(f"form must be 'tokens' or None, got {form!r}")
    N, H, R = q_lat.shape
    DR = q_pe.shape[-1]
    P = kv_pages.shape[1]
    max_pages = page_table.shape[1]
    out = torch.empty_like(q_lat)
    if N == 0:
        return out
    if num_splits is None:
        sm = torch.cuda.get_device_properties(q_lat.device).multi_processor_count if q_lat.is_cuda else 4
        num_splits = _num_splits_tokens(N, max_pages * P, sm)
    BN = BN or 64
    tps = triton.cdiv(triton.cdiv(max_pages * P, num_splits), BN) * BN
    num_splits = triton.cdiv(max_pages * P, tps)
    BH = BH or max(16, triton.next_power_of_2(H))
    BR = triton.next_power_of_2(R)
    BDR = max(16, triton.next_power_of_2(DR))
    align = 1
    while align < 8 and (R + DR) % (2 * align) == 0:
        align *= 2
    BRC = min(BR, 64)
    half = q_lat.dtype in (torch.bfloat16, torch.float16)
    o_part = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=q_lat.dtype if half else torch.float32)
    lse = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
    _split_kernel_tokens[(triton.cdiv(H, BH), num_splits, N)](
        q_lat, q_pe, kv_pages, page_table, seq_lens, o_part, lse, scale * _LOG2E, max_pages, tps, num_splits,
        H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=BDR, BN=BN, ALIGN=align, PAGE_TILE=P % BN == 0, WS=bool(WS),
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    _combine_kernel_lse[(H, N, triton.cdiv(R, BRC))](o_part, lse, out, num_splits, H=H, R=R, BR=BRC, BS=16,
                                                     num_warps=2)
    return out
