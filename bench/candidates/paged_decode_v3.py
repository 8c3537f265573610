"""MLA decode over a paged latent cache in Triton, kv_b_proj absorbed (flash-decoding), candidate v3.

Changes against ``kernels/mla/paged_decode.py`` (each one a launch parameter, so one device run can compare them):

- ``tma`` (default): tokens on the rows, and whole page-aligned tiles copied by TMA from tensor descriptors over the
  cache viewed as [num_pages * P, r + dr] (the latent as two [BN, r / 2] boxes, k_pe as one [BN, dr]): no
  per-thread addresses (the pointer kernels sit at 255 registers with spills on sm_90), both products on warpgroup
  MMAs with operands in shared memory; the split's partial last tile through masked loads, so rows past a
  sequence's end are never read. Falls back to the pointer kernel where the shapes do not fit (``_tma_ok``).
- ``trans``: tokens on the rows of both products (scores^T = c q^T [BN, BH], acc^T += c^T p^T [R, BH]), the shapes
  Hopper's warpgroup MMA takes with both operands in shared memory, so q no longer occupies registers.
- ``page_tile``: when BN divides the page size every tile lies in one page: one page-table load per tile and
  contiguous rows, instead of BN gathered page ids.
- ``part_bf16``: each split stores its output already normalised (acc / l) in bf16 plus one log-sum-exp per head,
  half the partial traffic of float32 (it is 8.6 MB for one sequence over 132 splits, next to 38 MB of cache at 32K).
- the merge reads (o_s, lse_s) in one pass; the number of splits is a free launch parameter (``num_splits``, or
  ``waves`` of the SM count), the SM count is cached and the partials come from one allocation.

Every program takes one sequence's split of the context and all H heads, so each cached row [r + dr] is read once
and serves every head. The number of splits comes from the page table's capacity, not from ``seq_lens``, so there
is no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_EMPTY = -1.0e30  # log-sum-exp of a split with no tokens


# integer arguments that vary from call to call are not specialised (divisibility by 16): one compiled kernel per
# launch configuration, whatever the page table's capacity or the split count
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel(
    q_lat, q_pe, kv, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr,
    ALIGN: tl.constexpr, TRANS: tl.constexpr, PAGE_TILE: tl.constexpr,
):
    # head blocks vary fastest, so programs that share a split's cache rows run together (one DRAM read)
    hb = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.program_id(2)
    L = tl.load(seq_lens + n)
    start = s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, L)
    rh = hb * BH + tl.arange(0, BH)
    rr = tl.arange(0, BR)
    rd = tl.arange(0, BDR)
    rn = tl.arange(0, BN)
    mh = rh < H
    ql = tl.load(q_lat + (n * H + rh[:, None]) * R + rr[None, :], mask=mh[:, None] & (rr[None, :] < R), other=0.0)
    qp = tl.load(q_pe + (n * H + rh[:, None]) * DR + rd[None, :], mask=mh[:, None] & (rd[None, :] < DR), other=0.0)
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    pt = page_table + n.to(tl.int64) * max_pages
    base = (n * NSPLIT + s) * H + rh
    if TRANS:
        qlt = tl.trans(ql)  # [BR, BH]
        qpt = tl.trans(qp)  # [BDR, BH]
        acc = tl.zeros([BR, BH], dtype=tl.float32)  # acc^T
    else:
        acc = tl.zeros([BH, BR], dtype=tl.float32)
    for t0 in range(start, end, BN):
        tok = t0 + rn
        mt = tok < end
        if PAGE_TILE:  # BN divides P and t0 is a multiple of BN: the tile is rows t0 % P .. + BN of one page
            # masked and clamped to the row like the gathered form, so that no copy of this load (the pipeliner
            # issues it stages ahead) can address past the table or yield a page id that is not one
            page = tl.load(pt + tl.minimum(t0 // P, max_pages - 1), mask=t0 < end, other=0).to(tl.int64)
            row = (page * P + t0 % P + rn) * (R + DR)
        else:
            page = tl.load(pt + tl.minimum(tok // P, max_pages - 1), mask=mt, other=0).to(tl.int64)
            row = (page * P + tok % P) * (R + DR)
        row = tl.multiple_of(row, ALIGN)  # [BN] offsets of the tokens' cache rows: 16-byte vector loads
        c = tl.load(kv + row[:, None] + rr[None, :], mask=mt[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(kv + row[:, None] + R + rd[None, :], mask=mt[:, None] & (rd[None, :] < DR), other=0.0)
        if TRANS:
            sc = tl.dot(c, qlt) + tl.dot(pe, qpt)  # [BN, BH]
            sc = tl.where(mt[:, None], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            p = tl.exp2(sc - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype))
        else:
            sc = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(pe))  # [BH, BN]
            sc = tl.where(mt[None, :], sc * sm_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    # normalised partial output and its base-2 log-sum-exp; a split past the sequence's end stores 0 and _EMPTY
    nonempty = l_i > 0.0
    inv = 1.0 / tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), -1.0e30)
    if TRANS:
        o = acc * inv[None, :]
        tl.store(o_part + base[None, :].to(tl.int64) * R + rr[:, None], o.to(o_part.dtype.element_ty),
                 mask=mh[None, :] & (rr[:, None] < R))
    else:
        o = acc * inv[:, None]
        tl.store(o_part + base[:, None].to(tl.int64) * R + rr[None, :], o.to(o_part.dtype.element_ty),
                 mask=mh[:, None] & (rr[None, :] < R))
    tl.store(lse_part + base, lse, mask=mh)


@triton.jit
def _tile_t(c0, c1, pe, qt0, qt1, qpt, mt, m_i, l_i, acc0, acc1, sm_scale):
    """One tile, tokens on the rows: c0, c1 the two halves of the latent [BN, R / 2], pe [BN, DR], mt [BN] valid
    rows (the others must be finite: they get weight 0)."""
    sc = tl.dot(c0, qt0) + tl.dot(c1, qt1) + tl.dot(pe, qpt)  # [BN, BH]
    sc = tl.where(mt[:, None], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
    m_new = tl.maximum(m_i, tl.max(sc, axis=0))
    p = tl.exp2(sc - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    pb = p.to(c0.dtype)
    acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(c0), pb)
    acc1 = acc1 * alpha[None, :] + tl.dot(tl.trans(c1), pb)
    return m_new, l_i, acc0, acc1


@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel_tma(
    q_lat, q_pe, kv, c_desc, pe_desc, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages,
    tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Tokens on the rows, whole tiles through TMA (one page-table load and two [BN, R / 2] + one [BN, DR] box
    copies per tile, no per-thread addresses); the split's last partial tile, if any, through masked loads (the
    rows past the sequence's end may hold anything, NaN included, so they are never loaded)."""
    hb = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.program_id(2)
    L = tl.load(seq_lens + n)
    start = s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, L)
    full_end = start + tl.maximum(end - start, 0) // BN * BN
    RH: tl.constexpr = R // 2
    rh = hb * BH + tl.arange(0, BH)
    r0 = tl.arange(0, RH)
    rd = tl.arange(0, DR)
    rn = tl.arange(0, BN)
    mh = rh < H
    qrow = q_lat + (n * H + rh[:, None]) * R
    qt0 = tl.trans(tl.load(qrow + r0[None, :], mask=mh[:, None], other=0.0))  # [RH, BH]
    qt1 = tl.trans(tl.load(qrow + RH + r0[None, :], mask=mh[:, None], other=0.0))
    qpt = tl.trans(tl.load(q_pe + (n * H + rh[:, None]) * DR + rd[None, :], mask=mh[:, None], other=0.0))
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc0 = tl.zeros([RH, BH], dtype=tl.float32)
    acc1 = tl.zeros([RH, BH], dtype=tl.float32)
    pt = page_table + n.to(tl.int64) * max_pages
    all_rows = rn < BN
    for t0 in range(start, full_end, BN):
        # the tile's first row in the [num_pages * P, R + DR] view; the page-table read masked and clamped to the
        # row as in the pointer kernels (the pipeliner issues it stages ahead of the tile)
        page = tl.load(pt + tl.minimum(t0 // P, max_pages - 1), mask=t0 < full_end, other=0)
        row = page * P + t0 % P
        c0 = c_desc.load([row, 0])
        c1 = c_desc.load([row, RH])
        pe = pe_desc.load([row, R])
        m_i, l_i, acc0, acc1 = _tile_t(c0, c1, pe, qt0, qt1, qpt, all_rows, m_i, l_i, acc0, acc1, sm_scale)
    if full_end < end:
        tok = full_end + rn
        mt = tok < end
        page = tl.load(pt + tl.minimum(tok // P, max_pages - 1), mask=mt, other=0).to(tl.int64)
        row = tl.multiple_of((page * P + tok % P) * (R + DR), ALIGN)
        c0 = tl.load(kv + row[:, None] + r0[None, :], mask=mt[:, None], other=0.0)
        c1 = tl.load(kv + row[:, None] + RH + r0[None, :], mask=mt[:, None], other=0.0)
        pe = tl.load(kv + row[:, None] + R + rd[None, :], mask=mt[:, None], other=0.0)
        m_i, l_i, acc0, acc1 = _tile_t(c0, c1, pe, qt0, qt1, qpt, mt, m_i, l_i, acc0, acc1, sm_scale)
    nonempty = l_i > 0.0
    inv = 1.0 / tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), -1.0e30)
    base = (n * NSPLIT + s) * H + rh
    optr = o_part + base[None, :].to(tl.int64) * R + r0[:, None]
    tl.store(optr, (acc0 * inv[None, :]).to(o_part.dtype.element_ty), mask=mh[None, :])
    tl.store(optr + RH, (acc1 * inv[None, :]).to(o_part.dtype.element_ty), mask=mh[None, :])
    tl.store(lse_part + base, lse, mask=mh)


@triton.jit(do_not_specialize=["NSPLIT"])
def _combine_kernel(
    o_part, lse_part, out, NSPLIT, H: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
):
    """One pass over the splits with a running max: out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)."""
    h = tl.program_id(0)
    n = tl.program_id(1)
    rs = tl.arange(0, BS)
    rr = tl.program_id(2) * BR + tl.arange(0, BR)
    m_run = tl.full([1], -3.0e38, dtype=tl.float32)
    num = tl.zeros([BR], dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    for s0 in range(0, NSPLIT, BS):
        ms = s0 + rs < NSPLIT
        idx = (n * NSPLIT + s0 + rs) * H + h
        lse = tl.load(lse_part + idx, mask=ms, other=-3.0e38)
        m_new = tl.maximum(m_run, tl.max(lse, axis=0))
        wgt = tl.exp2(lse - m_new)
        o = tl.load(o_part + idx[:, None].to(tl.int64) * R + rr[None, :], mask=ms[:, None] & (rr[None, :] < R),
                    other=0.0).to(tl.float32)
        alpha = tl.exp2(m_run - m_new)
        num = num * alpha + tl.sum(wgt[:, None] * o, axis=0)
        den = den * alpha + tl.sum(wgt, axis=0)
        m_run = m_new
    tl.store(out + (n * H + h) * R + rr, (num / den).to(out.dtype.element_ty), mask=rr < R)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(N: int, capacity: int, sm_count: int, waves: float = 2.0, min_tokens: int = 256) -> int:
    """About ``waves`` x SM count (sequence, split) programs, each at least ``min_tokens`` of capacity."""
    return max(1, min(triton.cdiv(int(waves * sm_count), max(N, 1)), triton.cdiv(capacity, min_tokens)))


def _tma_ok(R: int, DR: int, P: int, BN: int) -> bool:
    """The TMA kernel's shape rules: page-aligned tiles, power-of-two halves of r and dr."""
    def pow2(x: int) -> bool:
        return x >= 8 and x & (x - 1) == 0

    return P % BN == 0 and R % 2 == 0 and pow2(R // 2) and pow2(DR)


def _launch(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None, BN: int = 64, BH: int | None = None, num_warps: int = 8, num_stages: int = 2,
    trans: bool = True, page_tile: bool = True, part_bf16: bool = False, waves: float = 2.0,
    merge_br: int = 64, merge_warps: int = 2, tma: bool = True,
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr] (contiguous) -> [N, H, r]."""
    N, H, R = q_lat.shape
    DR = q_pe.shape[-1]
    P = kv_pages.shape[1]
    max_pages = page_table.shape[1]
    out = torch.empty_like(q_lat)
    if N == 0:
        return out
    if num_splits is None:
        sm = _sm_count(q_lat.device.index or 0) if q_lat.is_cuda else 4
        num_splits = _num_splits(N, max_pages * P, sm, waves)
    tps = triton.cdiv(triton.cdiv(max_pages * P, num_splits), BN) * BN  # split starts stay multiples of BN
    num_splits = triton.cdiv(max_pages * P, tps)
    part_dt = torch.bfloat16 if part_bf16 else torch.float32
    o_part = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=part_dt)
    lse = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
    BH = BH or max(16, triton.next_power_of_2(H))
    BR = triton.next_power_of_2(R)
    align = 1
    while align < 8 and (R + DR) % (2 * align) == 0:
        align *= 2
    grid = (triton.cdiv(H, BH), num_splits, N)
    if tma and _tma_ok(R, DR, P, BN):
        from triton.tools.tensor_descriptor import TensorDescriptor

        kv2 = kv_pages.view(-1, R + DR)  # [num_pages * P, r + dr]: a tile is BN consecutive rows of one page
        _split_kernel_tma[grid](
            q_lat, q_pe, kv_pages, TensorDescriptor.from_tensor(kv2, [BN, R // 2]),
            TensorDescriptor.from_tensor(kv2, [BN, DR]), page_table, seq_lens, o_part, lse, scale * _LOG2E,
            max_pages, tps, num_splits, H=H, R=R, DR=DR, P=P, BH=BH, BN=BN, ALIGN=align,
            num_warps=num_warps, num_stages=num_stages,
        )
    else:
        _split_kernel[grid](
            q_lat, q_pe, kv_pages, page_table, seq_lens, o_part, lse, scale * _LOG2E, max_pages, tps, num_splits,
            H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=max(16, triton.next_power_of_2(DR)), BN=BN,
            ALIGN=align, TRANS=trans, PAGE_TILE=page_tile and P % BN == 0,
            num_warps=num_warps, num_stages=num_stages,
        )
    BRC = min(BR, merge_br)  # the merge runs over r blocks too: H * N programs alone are too few for one sequence
    _combine_kernel[(H, N, triton.cdiv(R, BRC))](o_part, lse, out, num_splits, H=H, R=R, BR=BRC, BS=16,
                                                 num_warps=merge_warps)
    return out


def mla_decode_paged_triton(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None,
) -> Tensor:
    """One query per sequence over its paged latent cache (kv_b_proj absorbed).

    q_lat [N, H, r] (q_nope @ W_uk per head), q_pe [N, H, dr], kv_pages [num_pages, P, r + dr] in q's dtype,
    page_table [N, max_pages] int32, seq_lens [N] int (>= 1, the new token included). Returns the
    attention-weighted latent [N, H, r] in q_lat's dtype. ``num_splits`` overrides the split heuristic.
    """
    N, H, R = q_lat.shape
    if q_pe.shape[:2] != (N, H):
        raise ValueError(f"q_pe must be [N, H, dr] with N, H={N, H}, got {tuple(q_pe.shape)}")
    DR = q_pe.shape[-1]
    if kv_pages.dim() != 3 or kv_pages.shape[-1] != R + DR:
        raise ValueError(f"kv_pages must be [num_pages, P, r + dr={R + DR}], got {tuple(kv_pages.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != N or seq_lens.shape != (N,):
        raise ValueError(f"page_table must be [N={N}, max_pages] and seq_lens [N], got {tuple(page_table.shape)}, "
                         f"{tuple(seq_lens.shape)}")
    return _launch(
        q_lat.contiguous(), q_pe.to(q_lat.dtype).contiguous(), kv_pages.contiguous(), page_table.contiguous(),
        seq_lens.contiguous(), float(scale), num_splits,
    )
