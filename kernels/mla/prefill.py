"""MLA prefill attention in Triton: causal flash attention of a chunk's queries over its paged latent cache.

The prefix is read in blocks of ``block_tokens`` cached rows: each block's latent c [Lb, r] is decompressed by
kv_b_proj into k_nope and v per head ([Lb, H, dn + dv], one matmul), then a flash kernel (online softmax, no score
matrix, no mask tensor) folds the block into running float32 partials (max, denominator, weighted sum of values).
k_pe [dr] is read straight from the latent row and shared by the heads. Memory beyond q and o is one block's
decompressed K/V plus the partials: O(T x H x dv + block_tokens x H x (dn + dv)), never O(T x context).

A program folds one (query tile, head): a chunk of a few hundred tokens has only ceil(T / 128) x 32 of them, each
folding every cached key of the block, on a GPU of 132 multiprocessors. Such a chunk shares each block's keys
among ``key_splits`` programs a (query tile, head), whose partials ``_merge_kernel`` folds into the running ones.

Why decompress rather than absorb kv_b_proj into the query as decode does: per (query, key) pair and head the
decompressed form multiplies dn + dr + dv = 320 numbers, the absorbed one r + dr + r = 1,088 (3.4x more tensor-core
work), while decompressing a block costs 2 r H (dn + dv) flops per cached row, paid once per chunk and shared by all
of the chunk's T queries (under 1/40 of the attention's work at T = 8,192 in every block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tma import TensorDescriptor, tma_device
from .naive import latent_rows

_LOG2E = 1.4426950408889634


@triton.jit
def _fold_tile(acc, m_i, l_i, qn, qp, kv, vd, lat, qpos, n0, NK, rh, stride_kvt, stride_lat,
               DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
               MASK: tl.constexpr, TMA: tl.constexpr, sm_scale):
    """Fold keys n0 .. n0 + BN of the block into one query tile's partials; ``MASK`` applies the causal and
    end-of-block masks (only tiles that cross the diagonal or the block's end need them). ``TMA``: kv, vd and
    lat are descriptors of the block's rows (k_nope [BN, DN] and v [BN, DV] of kv, k_pe [BN, DR] of lat), rows
    past NK zeros; else pointers (``vd`` unused)."""
    rn = n0 + tl.arange(0, BN)
    if TMA:
        kn = kv.load([n0, rh])
        kp = lat.load([n0, R])
        v = vd.load([n0, rh + DN])
    elif MASK:
        rows = rn.to(tl.int64)
        kvrow = kv + rows[:, None] * stride_kvt + rh
        mn = rn < NK
        kn = tl.load(kvrow + tl.arange(0, DN)[None, :], mask=mn[:, None], other=0.0)  # [BN, DN]
        kp = tl.load(lat + rows[:, None] * stride_lat + R + tl.arange(0, DR)[None, :], mask=mn[:, None], other=0.0)
        v = tl.load(kvrow + DN + tl.arange(0, DV)[None, :], mask=mn[:, None], other=0.0)  # [BN, DV]
    else:
        rows = rn.to(tl.int64)
        kvrow = kv + rows[:, None] * stride_kvt + rh
        kn = tl.load(kvrow + tl.arange(0, DN)[None, :])
        kp = tl.load(lat + rows[:, None] * stride_lat + R + tl.arange(0, DR)[None, :])
        v = tl.load(kvrow + DN + tl.arange(0, DV)[None, :])
    s = (tl.dot(qn, tl.trans(kn)) + tl.dot(qp, tl.trans(kp))) * sm_scale  # [BM, BN], base-2 logits
    if MASK:
        s = tl.where((rn[None, :] <= qpos[:, None]) & (rn[None, :] < NK), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _load_partials(acc_s, m_s, l_s, srow, mask, EMPTY: tl.constexpr, B: tl.constexpr, DV: tl.constexpr):
    """(acc [B, DV], max [B], denominator [B]) of the float32 partials at rows ``srow`` (mask ``mask``), or empty
    ones with ``EMPTY`` (the buffers then unused, maybe of another dtype: one return of float32 values, which
    Triton 3.6 needs of both branches)."""
    if EMPTY:
        acc = tl.zeros([B, DV], dtype=tl.float32)
        m = tl.full([B], -1e30, dtype=tl.float32)
        den = tl.zeros([B], dtype=tl.float32)
    else:
        acc = tl.load(acc_s + srow[:, None] * DV + tl.arange(0, DV)[None, :], mask=mask[:, None], other=0.0)
        m = tl.load(m_s + srow, mask=mask, other=-1e30)
        den = tl.load(l_s + srow, mask=mask, other=0.0)
    return acc.to(tl.float32), m.to(tl.float32), den.to(tl.float32)


@triton.jit
def _store_partials(acc_s, m_s, l_s, srow, mask, acc, m, den, DV: tl.constexpr):
    """``_load_partials``' counterpart."""
    tl.store(m_s + srow, m, mask=mask)
    tl.store(l_s + srow, den, mask=mask)
    tl.store(acc_s + srow[:, None] * DV + tl.arange(0, DV)[None, :], acc, mask=mask[:, None])


@triton.jit
def _prefill_kernel(
    q, kv, vd, lat, o, acc_s, m_s, l_s, q_off, T, NK, sm_scale, split_keys,
    stride_qt, stride_kvt, stride_lat, stride_ot,
    H: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, SPLIT: tl.constexpr,
    TMA: tl.constexpr,
):
    """One (query tile, head, split) program. Query row i sits at block position q_off + i and sees block keys
    0 .. q_off + i (q_off < 0 when the block starts after some of the chunk's queries). With ``SPLIT``, split s
    folds only the block's keys s * split_keys .. (s + 1) * split_keys (a multiple of BN; not a constexpr, which
    would compile a kernel for every length of a context's last block) from empty partials and stores
    them at slot s of the split partials (``acc_s``, ``m_s``, ``l_s`` [splits, T, H, ...]) for ``_merge_kernel``;
    ``FIRST`` and ``LAST`` are the merge's then."""
    mb = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    rm = mb * BM + tl.arange(0, BM)
    mq = rm < T
    qpos = q_off + rm
    qrow = q + rm.to(tl.int64)[:, None] * stride_qt + h * (DN + DR)
    qn = tl.load(qrow + tl.arange(0, DN)[None, :], mask=mq[:, None], other=0.0)
    qp = tl.load(qrow + DN + tl.arange(0, DR)[None, :], mask=mq[:, None], other=0.0)
    srow = rm.to(tl.int64) * H + h  # row of the float32 partials [T, H]
    if SPLIT:
        srow += split.to(tl.int64) * T * H
    acc, m_i, l_i = _load_partials(acc_s, m_s, l_s, srow, mq, FIRST or SPLIT, BM, DV)
    rh = h * (DN + DV)
    # keys below the tile's first query position and below NK need no mask; the rest up to its last one do
    first_q = q_off + mb * BM
    lo = tl.maximum(tl.minimum(first_q, NK), 0) // BN * BN
    hi = tl.minimum(first_q + BM, NK)
    k0 = 0
    if SPLIT:  # this split's keys (split_keys a multiple of BN, so the tiles stay aligned)
        k0 = split * split_keys
        k1 = k0 + split_keys
        hi = tl.minimum(hi, k1)
        lo = tl.maximum(tl.minimum(lo, k1), k0)
    for n0 in range(k0, lo, BN):
        acc, m_i, l_i = _fold_tile(acc, m_i, l_i, qn, qp, kv, vd, lat, qpos, n0, NK, rh, stride_kvt, stride_lat,
                                   DN, DR, DV, R, BN, False, TMA, sm_scale)
    for n0 in range(lo, hi, BN):
        acc, m_i, l_i = _fold_tile(acc, m_i, l_i, qn, qp, kv, vd, lat, qpos, n0, NK, rh, stride_kvt, stride_lat,
                                   DN, DR, DV, R, BN, True, TMA, sm_scale)
    if LAST and not SPLIT:
        out = acc / l_i[:, None]
        optr = o + rm.to(tl.int64)[:, None] * stride_ot + h * DV + tl.arange(0, DV)[None, :]
        tl.store(optr, out.to(o.dtype.element_ty), mask=mq[:, None])
    else:
        _store_partials(acc_s, m_s, l_s, srow, mq, acc, m_i, l_i, DV)


@triton.jit
def _merge_kernel(
    o, acc_s, m_s, l_s, acc_p, m_p, l_p, rows, splits, stride_or,
    DV: tl.constexpr, BR: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):
    """One block's split partials (``acc_p``, ``m_p``, ``l_p`` [splits, rows, ...]) folded into the running
    partials (``acc_s``, ``m_s``, ``l_s`` [rows, ...], read unless ``FIRST``); stored back there, or with ``LAST``
    the output o [rows, DV] (row stride ``stride_or``). BR rows (query, head) a program."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    mr = rr < rows
    rr = rr.to(tl.int64)
    cols = tl.arange(0, DV)[None, :]
    acc, m, den = _load_partials(acc_s, m_s, l_s, rr, mr, FIRST, BR, DV)
    for s in range(splits):
        at = s * rows + rr
        m_j = tl.load(m_p + at, mask=mr, other=-1e30)
        m_new = tl.maximum(m, m_j)
        a, b = tl.exp2(m - m_new), tl.exp2(m_j - m_new)
        den = den * a + tl.load(l_p + at, mask=mr, other=0.0) * b
        acc = acc * a[:, None] + tl.load(acc_p + at[:, None] * DV + cols, mask=mr[:, None], other=0.0) * b[:, None]
        m = m_new
    if LAST:
        tl.store(o + rr[:, None] * stride_or + cols, (acc / den[:, None]).to(o.dtype.element_ty), mask=mr[:, None])
    else:
        _store_partials(acc_s, m_s, l_s, rr, mr, acc, m, den, DV)


def _tiles(q: Tensor) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) on a GPU (the fastest of a sweep of tiles, warps and stages at the
    Kimi-Linear shape on an H200: 493-522 TFLOP/s, against 381-479 for the others), small tiles under the
    interpreter."""
    if q.is_cuda:
        return 128, 64, 8, 3
    return 16, 16, 4, 1


SPLIT_TARGET_PROGRAMS = 2
"""Programs a block's launch aims at, per multiprocessor: a chunk with fewer query tiles x heads than that splits
each block's keys (``key_splits``)."""

SPLIT_MIN_TILES = 4
"""Key tiles (BN rows) a split folds at least."""


def key_splits(T: int, H: int, block: int, sms: int, BM: int = 128, BN: int = 64) -> int:
    """How many programs share each block's keys: 1 (none) where ceil(T / BM) x H programs fill half of the
    ``sms`` multiprocessors, else enough for ``SPLIT_TARGET_PROGRAMS`` x ``sms`` programs, each with at least
    ``SPLIT_MIN_TILES`` key tiles. A chunk of a few hundred tokens after a long cache otherwise runs 32-64
    programs on 132 multiprocessors, each folding every cached key. H100, Kimi-Linear's MLA shape, one call's
    device time back to back (``bench/mla_prefill.py --short --contexts 32768,131072,1048576 --chunks
    16,64,128,256,512,1024``, 2026-12-07 06:50 UTC): after 128K cached tokens 16-128 tokens 3.1-3.2 ms split 9
    ways against 4.6 unsplit, 256 tokens 3.8 (5 ways) against 4.6; after 1M 25.6-26.9 against 36.4-36.8, 256
    tokens 31.8 against 37.4; 512 and 1,024 tokens split 3 and 2 ways (128 and 256 programs) were 2-8% slower
    than unsplit, so they are not."""
    programs = -(-T // BM) * H
    if 2 * programs > sms:
        return 1
    want = -(-SPLIT_TARGET_PROGRAMS * sms // programs)
    return max(1, min(want, block // (BN * SPLIT_MIN_TILES)))


def mla_prefill_triton(
    q: Tensor, kv_pages: Tensor, pages: Tensor, start: int, w_kv_b: Tensor, dv: int, scale: float,
    block_tokens: int = 16384, splits: int | None = None,
) -> Tensor:
    """See ``kda_sessions.kernels.mla.mla_prefill_paged``. ``block_tokens`` is rounded up to whole pages;
    ``splits``: programs sharing each block's keys (``key_splits`` by default; 1 on the CPU)."""
    T, H, dk = q.shape
    P, width = kv_pages.shape[1], kv_pages.shape[2]
    r = w_kv_b.shape[1]
    dr = width - r
    dn = dk - dr
    L = start + T
    assert w_kv_b.shape[0] == H * (dn + dv), (tuple(w_kv_b.shape), H, dn, dv)
    q = q.contiguous()
    o = torch.empty(T, H, dv, dtype=q.dtype, device=q.device)
    BM, BN, warps, stages = _tiles(q)
    block = -(-block_tokens // P) * P
    nblocks = -(-L // block)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 1
        splits = key_splits(T, H, min(block, L), sms, BM, BN)
    tma = TMA and tma_device(q.device) and all(d * q.element_size() % 16 == 0 for d in (dn, dv, dr, r))
    acc = m = lsum = o  # placeholders, unused when one block holds the whole context
    if nblocks > 1 or splits > 1:
        acc = torch.empty(T, H, dv, dtype=torch.float32, device=q.device)
        m = torch.empty(T, H, dtype=torch.float32, device=q.device)
        lsum = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if splits > 1:
        acc_p = torch.empty(splits, T, H, dv, dtype=torch.float32, device=q.device)
        m_p = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
        l_p = torch.empty(splits, T, H, dtype=torch.float32, device=q.device)
    for b in range(nblocks):
        b0, b1 = b * block, min(L, (b + 1) * block)
        lat = latent_rows(kv_pages, pages, b0, b1)  # [Lb, r + dr]
        if lat.dtype != q.dtype:
            lat = lat.to(q.dtype)
        kv = lat[:, :r] @ w_kv_b.t()  # [Lb, H * (dn + dv)]: k_nope and v of every head
        first, last = b == 0, b == nblocks - 1
        keys = _key_operands(kv, lat, BN, dn, dv, dr, tma)
        if splits == 1:
            _prefill_kernel[(triton.cdiv(T, BM), H, 1)](
                q, *keys, o, acc, m, lsum, start - b0, T, b1 - b0, scale * _LOG2E, 0,
                q.stride(0), kv.stride(0), lat.stride(0), o.stride(0),
                H=H, DN=dn, DR=dr, DV=dv, R=r, BM=BM, BN=BN, FIRST=first, LAST=last, SPLIT=False, TMA=tma,
                num_warps=warps, num_stages=stages,
            )
            continue
        per = triton.cdiv(triton.cdiv(b1 - b0, splits), BN) * BN
        used = triton.cdiv(b1 - b0, per)  # a short last block needs fewer
        _prefill_kernel[(triton.cdiv(T, BM), H, used)](
            q, *keys, o, acc_p, m_p, l_p, start - b0, T, b1 - b0, scale * _LOG2E, per,
            q.stride(0), kv.stride(0), lat.stride(0), o.stride(0),
            H=H, DN=dn, DR=dr, DV=dv, R=r, BM=BM, BN=BN, FIRST=True, LAST=False, SPLIT=True, TMA=tma,
            num_warps=warps, num_stages=stages,
        )
        rows = T * H
        _merge_kernel[(triton.cdiv(rows, MERGE_ROWS),)](
            o, acc, m, lsum, acc_p, m_p, l_p, rows, used, dv,
            DV=dv, BR=MERGE_ROWS, FIRST=first, LAST=last, num_warps=4,
        )
    return o


MERGE_ROWS = 16
"""(query, head) rows a program of ``_merge_kernel``."""

TMA = False
"""The flash kernel reads each key tile (k_nope, v, k_pe) through TMA descriptors of the block's decompressed rows
and latent rows (sm_90 on), rather than by pointer loads. Off until measured on a GPU: ``bench/mla_prefill.py``
times every tile of its sweep both ways."""


def _key_operands(kv: Tensor, lat: Tensor, BN: int, dn: int, dv: int, dr: int, tma: bool) -> tuple:
    """(kv, vd, lat) as ``_prefill_kernel`` takes them: the tensors (vd a placeholder), or with ``tma`` descriptors
    of exactly the block's rows, so a tile past its end reads zeros."""
    if not tma:
        return kv, kv, lat
    lat = lat if lat.stride(1) == 1 and lat.data_ptr() % 16 == 0 and lat.stride(0) * lat.element_size() % 16 == 0 \
        else lat.contiguous()
    return (TensorDescriptor(kv, list(kv.shape), list(kv.stride()), [BN, dn]),
            TensorDescriptor(kv, list(kv.shape), list(kv.stride()), [BN, dv]),
            TensorDescriptor(lat, list(lat.shape), list(lat.stride()), [BN, dr]))
