"""MLA decode over a paged latent cache in Triton, kv_b_proj absorbed (flash-decoding), candidate v4.

The shipped kernel (``kernels/mla/paged_decode.py``) with one change, ``RS``: the latent's r columns of the
output are split over RS programs per (split, sequence, head block), launched next to each other so they share
each cache tile through L2 (DRAM traffic unchanged). Every program still computes the full scores (both halves
of q . c plus q_pe . k_pe), but accumulates only its r / RS columns: the [BH, r] float32 accumulator that made
the shipped kernel spill on sm_90 (255 registers, 80 B spill with 4 warps) shrinks to [BH, r / RS].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634


# the page-table width, the split length and the split count vary with the context: not specialised, so one
# compiled kernel serves every context (eager decode would otherwise compile again every few hundred tokens)
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel(
    q_lat, q_pe, kv, page_table, seq_lens, acc_out, m_out, l_out, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr, RS: tl.constexpr,
):
    # the RS programs of one (split, sequence, head block) are neighbours in launch order: one DRAM read per tile
    s = tl.program_id(0) // RS
    rb = tl.program_id(0) % RS
    n = tl.program_id(1)
    hb = tl.program_id(2)
    L = tl.load(seq_lens + n)
    start = s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, L)
    rh = hb * BH + tl.arange(0, BH)
    BRS: tl.constexpr = BR // RS
    ro = rb * BRS + tl.arange(0, BRS)  # the r columns this program accumulates ...
    rx = (rb * BRS + BRS + tl.arange(0, BR - BRS)) % BR  # ... and the rest (scores only; empty when RS is 1)
    rd = tl.arange(0, BDR)
    mh = rh < H
    qrow = q_lat + (n * H + rh[:, None]) * R
    qo = tl.load(qrow + ro[None, :], mask=mh[:, None] & (ro[None, :] < R), other=0.0)
    qx = tl.load(qrow + rx[None, :], mask=mh[:, None] & (rx[None, :] < R), other=0.0)
    qp = tl.load(q_pe + (n * H + rh[:, None]) * DR + rd[None, :], mask=mh[:, None] & (rd[None, :] < DR), other=0.0)
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BRS], dtype=tl.float32)
    pt = page_table + n.to(tl.int64) * max_pages
    for t0 in range(start, end, BN):
        tok = t0 + tl.arange(0, BN)
        mt = tok < end
        page = tl.load(pt + tl.minimum(tok // P, max_pages - 1), mask=mt, other=0).to(tl.int64)
        # [BN] offset of each token's cache row; the hint lets the loads be 16-byte vectors
        row = tl.multiple_of((page * P + tok % P) * (R + DR), ALIGN)
        co = tl.load(kv + row[:, None] + ro[None, :], mask=mt[:, None] & (ro[None, :] < R), other=0.0)
        cx = tl.load(kv + row[:, None] + rx[None, :], mask=mt[:, None] & (rx[None, :] < R), other=0.0)
        pe = tl.load(kv + row[:, None] + R + rd[None, :], mask=mt[:, None] & (rd[None, :] < DR), other=0.0)
        sc = tl.dot(qo, tl.trans(co)) + tl.dot(qx, tl.trans(cx)) + tl.dot(qp, tl.trans(pe))  # [BH, BN]
        sc = tl.where(mt[None, :], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp2(sc - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(co.dtype), co)
        m_i = m_new
    base = (n * NSPLIT + s) * H + rh
    if rb == 0:  # every program of the group holds the same m and l
        tl.store(m_out + base, m_i, mask=mh)
        tl.store(l_out + base, l_i, mask=mh)
    tl.store(acc_out + base[:, None].to(tl.int64) * R + ro[None, :], acc, mask=mh[:, None] & (ro[None, :] < R))


@triton.jit(do_not_specialize=["NSPLIT"])
def _combine_kernel(
    acc_in, m_in, l_in, out, NSPLIT, H: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
):
    h = tl.program_id(0)
    n = tl.program_id(1)
    rs = tl.arange(0, BS)
    rr = tl.program_id(2) * BR + tl.arange(0, BR)
    m_all = tl.full([BS], -1e30, dtype=tl.float32)
    for s0 in range(0, NSPLIT, BS):
        m_all = tl.maximum(m_all, tl.load(m_in + (n * NSPLIT + s0 + rs) * H + h, mask=s0 + rs < NSPLIT, other=-1e30))
    m_max = tl.max(m_all, axis=0)
    num = tl.zeros([BR], dtype=tl.float32)
    den = tl.zeros([BS], dtype=tl.float32)
    for s0 in range(0, NSPLIT, BS):
        ms = s0 + rs < NSPLIT
        idx = (n * NSPLIT + s0 + rs) * H + h
        wgt = tl.exp2(tl.load(m_in + idx, mask=ms, other=-1e30) - m_max)
        den += wgt * tl.load(l_in + idx, mask=ms, other=0.0)
        a = tl.load(acc_in + idx[:, None].to(tl.int64) * R + rr[None, :], mask=ms[:, None] & (rr[None, :] < R),
                    other=0.0)
        num += tl.sum(wgt[:, None] * a, axis=0)
    o = num / tl.sum(den, axis=0)
    tl.store(out + (n * H + h) * R + rr, o.to(out.dtype.element_ty), mask=rr < R)


def _num_splits(N: int, capacity: int, sm_count: int) -> int:
    """(sequence, split) programs for two waves of the GPU (eight from 8 sequences up), each split at least 256
    tokens of capacity. Measured on the H200 (graph replays, `bench/kernels.py --only mlasplits`, run E in
    docs/benchmarks.md): 1 x 32K best at 128 splits (39.9-41.8 us, against 51 us at 64 with 512-token splits),
    1 x 128K and 1 x 1M at about two waves (95.7 / 498 us; more splits were slower), 32 x 32K at 36 splits
    (551 us, against 651 at 9)."""
    waves = 8 if N >= 8 else 2
    return max(1, min(triton.cdiv(waves * sm_count, max(N, 1)), triton.cdiv(capacity, 256)))


def _launch(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None, BN: int = 64, BH: int | None = None, num_warps: int = 4, num_stages: int = 3,
    RS: int = 2,
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr] (contiguous) -> [N, H, r]."""
    if RS != 2:
        raise ValueError(f"RS must be 2 (RS 1 is the shipped kernel), got {RS}")
    N, H, R = q_lat.shape
    DR = q_pe.shape[-1]
    P = kv_pages.shape[1]
    max_pages = page_table.shape[1]
    out = torch.empty_like(q_lat)
    if N == 0:
        return out
    if num_splits is None:
        sm = torch.cuda.get_device_properties(q_lat.device).multi_processor_count if q_lat.is_cuda else 4
        num_splits = _num_splits(N, max_pages * P, sm)
    tps = triton.cdiv(triton.cdiv(max_pages * P, num_splits), BN) * BN
    num_splits = triton.cdiv(max_pages * P, tps)
    acc = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=torch.float32)
    m = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    BH = BH or max(16, triton.next_power_of_2(H))
    BR = triton.next_power_of_2(R)
    align = 1
    while align < 8 and (R + DR) % (2 * align) == 0:
        align *= 2
    _split_kernel[(num_splits * RS, N, triton.cdiv(H, BH))](
        q_lat, q_pe, kv_pages, page_table, seq_lens, acc, m, lsum, scale * _LOG2E, max_pages, tps, num_splits,
        H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=max(16, triton.next_power_of_2(DR)), BN=BN,
        ALIGN=align, RS=RS, num_warps=num_warps, num_stages=num_stages,
    )
    BRC = min(BR, 64)  # the merge runs over r blocks too: H * N programs alone are too few for one sequence
    _combine_kernel[(H, N, triton.cdiv(R, BRC))](acc, m, lsum, out, num_splits, H=H, R=R, BR=BRC, BS=16,
                                                 num_warps=2)
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
