"""Chunked KDA forward in Triton (inference only: nothing is kept for a backward pass), the intra step as short,
wide stages (fla 0.6.0's decomposition, our code) rather than one long program per chunk.

Why short stages: one long intra program per chunk walks a long serial chain (gate, scan, norm sums, span
reductions and a branch per diagonal block, twenty [16, 16] blocks); short wide stages keep the SMs busy. The
cost: the stages hand over G (float32), qn, kn, qg, kg, w, u, v', A_qk, X and the diagonal blocks through memory,
about 2.6 KB of scratch per (token, head) at K = V = 128 (2.75 GB at T 32K, H 32), plus one bf16 state per chunk.
The diagonal blocks are computed token-parallel and exact (each pair's decay formed on its own), so any decay span
is safe. Throughput against fla: docs/benchmarks.md, "Kernels".

Six launches over a table of chunks (at most ``BT`` = 64 tokens each, starting at every sequence's first token;
a chunk also ends at every requested checkpoint position, so the state there is a chunk-boundary state):

1. ``_prep_kernel``    per (chunk, head): the gate (optional), q/k L2 norm (optional), G = the in-chunk cumulative
   log-decay in log2 units (float32, stored), kn, qn (normalised k, q), qg = scale * qn * 2^G,
   kg = kn * 2^(G_last - G) and 2^G_last per chunk. Element-wise and one scan: bandwidth-bound. With blocks
   narrower than K and the norm on, a first pass over q and k sums the squares.
2. ``_diag_token_kernel`` per (chunk, row r, ``tok_bh`` heads): row r of the diagonal [16, 16] blocks of A_qk
   (causal, scaled, into Aqk) and of L (strict, times beta, float32 into Ld), exact: only the keys s <= r of
   r's sub-chunk, each with 2^(G_r - G_s), so no span limit and no branch (fla's token-parallel form). With
   the bounded gate fused and ``diag_mid`` 1, ``_diag_mid_kernel`` per (chunk, head, sub-chunk) instead: both
   factors through the midpoint of the sub-chunk's decay range, then two [16, K] x [K, 16] dots; that gate
   bounds the range by 15 |lb| / ln 2, so the launcher takes it, with no check in the kernel, when that is
   within ``SPAN_MAX`` (off by default: slower at 8K and 32K tokens).
3. ``_offdiag_kernel`` per (chunk, head): the six off-diagonal blocks of A_qk and of L on tensor cores (twelve
   accumulators, nothing else in the K loop), then (I + L)^-1 by 16 x 16 blocks; X diag(beta) out.
4. ``_wu_kernel``      per (chunk, head): w = X diag(beta) (kn 2^G), u = X diag(beta) v as [64, 64] MMAs.
5. ``_state_kernel``   per (sequence, head, V block), sequential over chunks: the state at each chunk start,
   v' = u - w S, S <- diag(2^G_last) S + kg^T v'; float32 states at checkpoints and at the end.
6. ``_output_kernel``  per (chunk, head, V block): o = qg S + A_qk v' (qg already normalised and scaled).

Layout: every activation is packed ``[T_total, H, *]`` (B * T rows without cu_seqlens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..gate.naive import gate_params

BT = 64  # chunk length
BC = 16  # sub-chunk length
RCP_LN2 = tl.constexpr(1.4426950408889634)  # G is kept in log2 units: 2^G = e^(natural G)


@triton.jit
def _chunk(chunk_start, chunk_len, c):
    """Chunk c of the chunk table: (its first packed row as int64, its number of rows)."""
    return tl.load(chunk_start + c).to(tl.int64), tl.load(chunk_len + c)


@triton.jit
def _rows(base, bos, row0, n_rows, h, cols, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr):
    """Rows row0 .. row0 + R of a packed [T, H, W] tensor at head h, columns ``cols``, as float32 (zeros past
    n_rows)."""
    rows = row0 + tl.arange(0, R)
    m = (rows[:, None] < n_rows) & (cols[None, :] < W)
    return tl.load(base + ((bos + rows)[:, None] * H + h) * W + cols[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(base, x, bos, row0, n_rows, h, cols, H: tl.constexpr, W: tl.constexpr, R: tl.constexpr):
    rows = row0 + tl.arange(0, R)
    m = (rows[:, None] < n_rows) & (cols[None, :] < W)
    tl.store(base + ((bos + rows)[:, None] * H + h) * W + cols[None, :], x.to(base.dtype.element_ty), mask=m)


@triton.jit
def _row(base, bos, row, n_rows, h, cols, H: tl.constexpr, W: tl.constexpr):
    """One row [W-block] of a packed [T, H, W] tensor as float32 (zeros past n_rows)."""
    width = tl.where(row < n_rows, W, 0)  # a scalar & vector mask trips the interpreter
    return tl.load(base + ((bos + row) * H + h) * W + cols, mask=cols < width, other=0.0).to(tl.float32)


@triton.jit
def _beta(beta, bos, row0, n_rows, h, H: tl.constexpr, BC: tl.constexpr):
    rows = row0 + tl.arange(0, BC)
    return tl.load(beta + (bos + rows) * H + h, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def _log_decay(x, A_log, dt_bias, h, cols, lower_bound, K: tl.constexpr, GATE: tl.constexpr):
    """Gate logits or log-decays x [R, BK] -> log-decays. GATE: 0 x is the log-decay, 1 standard, 2 bounded."""
    if GATE != 0:
        x = x + tl.load(dt_bias + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        if GATE == 1:  # -exp(A_log) * softplus(x), softplus(x) = x above 20
            x = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        else:
            x = lower_bound * tl.sigmoid(a * x)
    return x


@triton.jit
def _prep_kernel(
    q, k, g, A_log, dt_bias, qn, kn, G2, qg, kg, dl, chunk_start, chunk_len, scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    rows = tl.arange(0, BT)
    rq = tl.full([BT], 1.0, dtype=tl.float32)
    rk = tl.full([BT], 1.0, dtype=tl.float32)
    ONE_PASS: tl.constexpr = BK >= K  # the block covers K: the norms come from the one pass's own loads
    if NORM and not ONE_PASS:  # a first pass for the row norms (from L1/L2 on the second)
        sq = tl.zeros([BT], dtype=tl.float32)
        sk = tl.zeros([BT], dtype=tl.float32)
        for kb in range(0, K, BK):
            cols = kb + tl.arange(0, BK)
            x = _rows(q, bos, 0, n_rows, h, cols, H, K, BT)
            sq += tl.sum(x * x, axis=1)
            x = _rows(k, bos, 0, n_rows, h, cols, H, K, BT)
            sk += tl.sum(x * x, axis=1)
        rq = tl.rsqrt(sq + 1e-6)
        rk = tl.rsqrt(sk + 1e-6)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        x = _log_decay(_rows(g, bos, 0, n_rows, h, cols, H, K, BT), A_log, dt_bias, h, cols, lower_bound, K, GATE)
        x = tl.where(rows[:, None] < n_rows, x, 0.0) * RCP_LN2  # padded rows add no decay
        G = tl.cumsum(x, axis=0)
        g_last = tl.sum(x, axis=0)
        qv = _rows(q, bos, 0, n_rows, h, cols, H, K, BT)
        kv = _rows(k, bos, 0, n_rows, h, cols, H, K, BT)
        if NORM and ONE_PASS:
            rq = tl.rsqrt(tl.sum(qv * qv, axis=1) + 1e-6)
            rk = tl.rsqrt(tl.sum(kv * kv, axis=1) + 1e-6)
        qv = qv * rq[:, None]
        kv = kv * rk[:, None]
        _store_rows(G2, G, bos, 0, n_rows, h, cols, H, K, BT)
        _store_rows(qn, qv, bos, 0, n_rows, h, cols, H, K, BT)
        _store_rows(kn, kv, bos, 0, n_rows, h, cols, H, K, BT)
        _store_rows(qg, qv * tl.exp2(G) * scale, bos, 0, n_rows, h, cols, H, K, BT)
        _store_rows(kg, kv * tl.exp2(g_last[None, :] - G), bos, 0, n_rows, h, cols, H, K, BT)
        tl.store(dl + (c.to(tl.int64) * H + h) * K + cols, tl.exp2(g_last), mask=cols < K)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _diag_token_kernel(
    qn, kn, G2, beta, Aqk, Ld, chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    ROW_FAST: tl.constexpr,
):
    """Row r of the diagonal blocks of A_qk (s <= r, times scale) and L (s < r, times beta_r; zeros from r on)
    for BH heads, exactly: only the keys s <= r of r's sub-chunk are visited. ROW_FAST: grid (chunks * BT, head
    blocks) with the rows of one chunk on neighbouring programs (they re-read each other's key rows from L2);
    else (chunks, BT, head blocks)."""
    if ROW_FAST:
        c = tl.program_id(0) // BT
        r = tl.program_id(0) % BT
        hh = tl.program_id(1) * BH + tl.arange(0, BH)
    else:
        c = tl.program_id(0)
        r = tl.program_id(1)
        hh = tl.program_id(2) * BH + tl.arange(0, BH)
    n_rows = tl.load(chunk_len + c)
    if r < n_rows:
        bos = tl.load(chunk_start + c).to(tl.int64)
        cols = tl.arange(0, BK)
        m = (hh[:, None] < H) & (cols[None, :] < K)
        off = hh[:, None] * K + cols[None, :]  # [BH, BK] within one token's [H, K] row
        row_r = (bos + r) * H * K
        q_r = tl.load(qn + row_r + off, mask=m, other=0.0).to(tl.float32)
        k_r = tl.load(kn + row_r + off, mask=m, other=0.0).to(tl.float32)
        G_r = tl.load(G2 + row_r + off, mask=m, other=0.0)
        b_r = tl.load(beta + (bos + r) * H + hh, mask=hh < H, other=0.0).to(tl.float32)
        row0 = (r // BC) * BC
        jj = tl.arange(0, BC)
        A = tl.zeros([BH, BC], dtype=tl.float32)
        L = tl.zeros([BH, BC], dtype=tl.float32)
        for s in range(row0, r + 1):  # s <= r < n_rows: every key row is valid
            row_s = (bos + s) * H * K
            k_s = tl.load(kn + row_s + off, mask=m, other=0.0).to(tl.float32)
            G_s = tl.load(G2 + row_s + off, mask=m, other=0.0)
            e = tl.exp2(tl.minimum(G_r - G_s, 0.0)) * k_s
            col = jj[None, :] == s - row0
            A = tl.where(col, tl.sum(q_r * e, axis=1)[:, None], A)
            L = tl.where(col, tl.sum(k_r * e, axis=1)[:, None], L)
        L = tl.where(jj[None, :] < r - row0, L, 0.0) * b_r[:, None]  # strict: the pair (r, r) is not in L
        mh = hh[:, None] < H
        tl.store(Aqk + ((bos + r) * H + hh[:, None]) * BT + row0 + jj[None, :],
                 (A * scale).to(Aqk.dtype.element_ty), mask=mh & (jj[None, :] <= r - row0))
        tl.store(Ld + ((bos + r) * H + hh[:, None]) * BC + jj[None, :], L, mask=mh)


@triton.jit
def _mid_blocks(qi, ki, Gi, g_hi, g_lo, row0, n_rows, BC: tl.constexpr, IEEE: tl.constexpr):
    """A diagonal block's q.k and k.k with 2^(G_r - G_s), factored through the midpoint of [g_lo, g_hi]: both
    factors within 2^(span / 2). Entries above the diagonal may overflow; the caller masks them."""
    mid = 0.5 * (g_hi + g_lo)
    valid = (row0 + tl.arange(0, BC))[:, None] < n_rows  # padded rows hold G = 0: 2^(0 - mid) would overflow
    e = tl.exp2(tl.where(valid, Gi - mid[None, :], -float("inf")))
    kt = tl.trans(ki * tl.exp2(mid[None, :] - Gi))  # <= 1 on padded rows (k = 0 there anyway)
    return _mm(qi * e, kt, IEEE), _mm(ki * e, kt, IEEE)


@triton.jit
def _diag_mid_kernel(
    qn, kn, G2, beta, Aqk, Ld, chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Diagonal block i of A_qk (r >= s, times scale) and of L (r > s, times beta_r) on tensor cores, factored
    through the midpoint of the sub-chunk's decay range; the caller guarantees a range within SPAN_MAX."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    row0 = i * BC
    if row0 < n_rows:
        cols = tl.arange(0, BK)
        rr = tl.arange(0, BC)
        qi = _rows(qn, bos, row0, n_rows, h, cols, H, K, BC)
        ki = _rows(kn, bos, row0, n_rows, h, cols, H, K, BC)
        Gi = _rows(G2, bos, row0, n_rows, h, cols, H, K, BC)
        g_hi = _row(G2, bos, row0, n_rows, h, cols, H, K)  # G is non-increasing down the rows
        g_lo = _row(G2, bos, tl.minimum(row0 + BC, n_rows) - 1, n_rows, h, cols, H, K)
        A, L = _mid_blocks(qi, ki, Gi, g_hi, g_lo, row0, n_rows, BC, IEEE)
        b = _beta(beta, bos, row0, n_rows, h, H, BC)
        A = tl.where(rr[:, None] >= rr[None, :], A, 0.0) * scale  # above the diagonal: may have overflowed
        L = tl.where(rr[:, None] > rr[None, :], L, 0.0) * b[:, None]
        _store_rows(Aqk, A, bos, row0, n_rows, h, row0 + rr, H, BT, BC)
        _store_rows(Ld, L, bos, row0, n_rows, h, rr, H, BC, BC)


@triton.jit
def _inv_unit_lower(N, BC: tl.constexpr, IEEE: tl.constexpr):
    """(I + N)^-1 of a strictly lower [BC, BC] block N (N^16 = 0): (I - N)(I + N^2)(I + N^4)(I + N^8)."""
    rr = tl.arange(0, BC)
    eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    N2 = _mm(N, N, IEEE)
    X = _mm(eye - N, eye + N2, IEEE)
    N4 = _mm(N2, N2, IEEE)
    X = _mm(X, eye + N4, IEEE)
    N8 = _mm(N4, N4, IEEE)
    return _mm(X, eye + N8, IEEE)


@triton.jit
def _store_blk(buf, X, bos, i: tl.constexpr, j: tl.constexpr, n_rows, h, H: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr):
    rows = i * BC + tl.arange(0, BC)
    cols = j * BC + tl.arange(0, BC)
    ptr = buf + ((bos + rows)[:, None] * H + h) * BT + cols[None, :]
    tl.store(ptr, X.to(buf.dtype.element_ty), mask=(rows[:, None] < n_rows))


@triton.jit
def _q_factor(G, g_ref, row0, n_rows, BC: tl.constexpr):
    """2^(G_r - g_ref) for the rows of a sub-chunk (<= 1; 0 on padded rows, whose G is not a cumulative sum)."""
    rows = row0 + tl.arange(0, BC)
    return tl.where(rows[:, None] < n_rows, tl.exp2(tl.minimum(G - g_ref[None, :], 0.0)), 0.0)


@triton.jit
def _k_factor(kj, Gj, g_ref):
    """(k_s 2^(g_ref - G_s))^T for the rows s of an earlier sub-chunk (<= 1: g_ref is at or after s)."""
    return tl.trans(kj * tl.exp2(tl.minimum(g_ref[None, :] - Gj, 0.0)))


@triton.jit
def _pair(qf, kf, kj, Gj, g_ref, A, L):
    """One off-diagonal block pair: rows (factored q and k of sub-chunk i) against the keys of sub-chunk j,
    accumulated into A_qk's and L's [BC, BC] blocks."""
    t = _k_factor(kj, Gj, g_ref)
    return tl.dot(qf, t, A), tl.dot(kf, t, L)


@triton.jit
def _offdiag_kernel(
    qn, kn, G2, beta, Aqk, Ld, Xb, chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, INV_IEEE: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    A10, A20, A21, A30, A31, A32 = z, z, z, z, z, z
    L10, L20, L21, L30, L31, L32 = z, z, z, z, z, z
    # Block (i, j), j < i, factors through G at the last row of sub-chunk i - 1: both factors are <= 1.
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        k0 = _rows(kn, bos, 0, n_rows, h, cols, H, K, BC)
        G0 = _rows(G2, bos, 0, n_rows, h, cols, H, K, BC)
        q1 = _rows(qn, bos, BC, n_rows, h, cols, H, K, BC)
        k1 = _rows(kn, bos, BC, n_rows, h, cols, H, K, BC)
        G1 = _rows(G2, bos, BC, n_rows, h, cols, H, K, BC)
        q2 = _rows(qn, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        k2 = _rows(kn, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        G2_ = _rows(G2, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        q3 = _rows(qn, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        k3 = _rows(kn, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        G3 = _rows(G2, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        r1 = _row(G2, bos, BC - 1, n_rows, h, cols, H, K)
        r2 = _row(G2, bos, 2 * BC - 1, n_rows, h, cols, H, K)
        r3 = _row(G2, bos, 3 * BC - 1, n_rows, h, cols, H, K)

        e = _q_factor(G1, r1, BC, n_rows, BC)
        qf, kf = q1 * e, k1 * e
        A10, L10 = _pair(qf, kf, k0, G0, r1, A10, L10)

        e = _q_factor(G2_, r2, 2 * BC, n_rows, BC)
        qf, kf = q2 * e, k2 * e
        A20, L20 = _pair(qf, kf, k0, G0, r2, A20, L20)
        A21, L21 = _pair(qf, kf, k1, G1, r2, A21, L21)

        e = _q_factor(G3, r3, 3 * BC, n_rows, BC)
        qf, kf = q3 * e, k3 * e
        A30, L30 = _pair(qf, kf, k0, G0, r3, A30, L30)
        A31, L31 = _pair(qf, kf, k1, G1, r3, A31, L31)
        A32, L32 = _pair(qf, kf, k2, G2_, r3, A32, L32)

    # A_qk's off-diagonal blocks out (the diagonal ones come from the diagonal step)
    _store_blk(Aqk, A10 * scale, bos, 1, 0, n_rows, h, H, BT, BC)
    _store_blk(Aqk, A20 * scale, bos, 2, 0, n_rows, h, H, BT, BC)
    _store_blk(Aqk, A21 * scale, bos, 2, 1, n_rows, h, H, BT, BC)
    _store_blk(Aqk, A30 * scale, bos, 3, 0, n_rows, h, H, BT, BC)
    _store_blk(Aqk, A31 * scale, bos, 3, 1, n_rows, h, H, BT, BC)
    _store_blk(Aqk, A32 * scale, bos, 3, 2, n_rows, h, H, BT, BC)

    # --- X = (I + L)^-1, L lower block-triangular of 4 x 4 blocks (rows times beta)
    rr = tl.arange(0, BC)
    b0 = _beta(beta, bos, 0, n_rows, h, H, BC)
    b1 = _beta(beta, bos, BC, n_rows, h, H, BC)
    b2 = _beta(beta, bos, 2 * BC, n_rows, h, H, BC)
    b3 = _beta(beta, bos, 3 * BC, n_rows, h, H, BC)
    X00 = _inv_unit_lower(_rows(Ld, bos, 0, n_rows, h, rr, H, BC, BC), BC, INV_IEEE)
    X11 = _inv_unit_lower(_rows(Ld, bos, BC, n_rows, h, rr, H, BC, BC), BC, INV_IEEE)
    X22 = _inv_unit_lower(_rows(Ld, bos, 2 * BC, n_rows, h, rr, H, BC, BC), BC, INV_IEEE)
    X33 = _inv_unit_lower(_rows(Ld, bos, 3 * BC, n_rows, h, rr, H, BC, BC), BC, INV_IEEE)
    L10 = L10 * b1[:, None]
    L20 = L20 * b2[:, None]
    L21 = L21 * b2[:, None]
    L30 = L30 * b3[:, None]
    L31 = L31 * b3[:, None]
    L32 = L32 * b3[:, None]
    X10 = -_mm(_mm(X11, L10, INV_IEEE), X00, INV_IEEE)
    X21 = -_mm(_mm(X22, L21, INV_IEEE), X11, INV_IEEE)
    X32 = -_mm(_mm(X33, L32, INV_IEEE), X22, INV_IEEE)
    X20 = -_mm(X22, _mm(L20, X00, INV_IEEE) + _mm(L21, X10, INV_IEEE), INV_IEEE)
    X31 = -_mm(X33, _mm(L31, X11, INV_IEEE) + _mm(L32, X21, INV_IEEE), INV_IEEE)
    X30 = -_mm(X33, _mm(L30, X00, INV_IEEE) + _mm(L31, X10, INV_IEEE) + _mm(L32, X20, INV_IEEE), INV_IEEE)

    # X diag(beta) out for _wu_kernel (blocks above the diagonal are never written: it masks them)
    _store_blk(Xb, X00 * b0[None, :], bos, 0, 0, n_rows, h, H, BT, BC)
    _store_blk(Xb, X10 * b0[None, :], bos, 1, 0, n_rows, h, H, BT, BC)
    _store_blk(Xb, X11 * b1[None, :], bos, 1, 1, n_rows, h, H, BT, BC)
    _store_blk(Xb, X20 * b0[None, :], bos, 2, 0, n_rows, h, H, BT, BC)
    _store_blk(Xb, X21 * b1[None, :], bos, 2, 1, n_rows, h, H, BT, BC)
    _store_blk(Xb, X22 * b2[None, :], bos, 2, 2, n_rows, h, H, BT, BC)
    _store_blk(Xb, X30 * b0[None, :], bos, 3, 0, n_rows, h, H, BT, BC)
    _store_blk(Xb, X31 * b1[None, :], bos, 3, 1, n_rows, h, H, BT, BC)
    _store_blk(Xb, X32 * b2[None, :], bos, 3, 2, n_rows, h, H, BT, BC)
    _store_blk(Xb, X33 * b3[None, :], bos, 3, 3, n_rows, h, H, BT, BC)


@triton.jit
def _wu_kernel(
    Xb, kn, G2, v, w, u, chunk_start, chunk_len,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """w = X diag(beta) (kn 2^G), u = X diag(beta) v, per (chunk, head)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    rows = tl.arange(0, BT)
    X = tl.load(Xb + ((bos + rows)[:, None] * H + h) * BT + rows[None, :],
                mask=(rows[:, None] < n_rows) & (rows[None, :] < n_rows), other=0.0)
    X = tl.where(rows[:, None] >= rows[None, :], X, 0.0).to(w.dtype.element_ty)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        s = _rows(kn, bos, 0, n_rows, h, cols, H, K, BT) * tl.exp2(_rows(G2, bos, 0, n_rows, h, cols, H, K, BT))
        _store_rows(w, tl.dot(X, s.to(X.dtype)), bos, 0, n_rows, h, cols, H, K, BT)
    for vb in range(0, V, BV):
        cols = vb + tl.arange(0, BV)
        s = _rows(v, bos, 0, n_rows, h, cols, H, V, BT).to(X.dtype)
        _store_rows(u, tl.dot(X, s), bos, 0, n_rows, h, cols, H, V, BT)


@triton.jit
def _state_kernel(
    w, u, kg, dl, vnew, hbuf, h0, ht, hck, chunk_start, chunk_len, chunk_ck, seq_chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_CK: tl.constexpr, REG: tl.constexpr,
):
    """The chunk-to-chunk recurrence, one program per (V block, sequence x head). REG: every chunk of a sequence
    but its last holds BT rows (no checkpoint cuts), so a chunk's first row is computed from its index rather than
    loaded from the chunk table: the tile addresses of the next iteration are known before this one's loads
    land, and the loop's loads can be pipelined."""
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    mkv = (rk[:, None] < K) & (cv[None, :] < V)
    off_s = (rk[:, None] * V + cv[None, :]).to(tl.int64)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S = tl.load(h0 + nh.to(tl.int64) * K * V + off_s, mask=mkv, other=0.0)
    c0 = tl.load(seq_chunks + n)
    c1 = tl.load(seq_chunks + n + 1)
    rows = tl.arange(0, BT)
    hptr = hbuf + (c0.to(tl.int64) * H + h) * K * V + off_s
    if REG:  # the sequence's first row and its end, from its first and last chunks (none when it is empty)
        seq_bos = tl.load(chunk_start + c0, mask=c1 > c0, other=0).to(tl.int64)
        seq_eos = seq_bos + (c1 - c0 - 1) * BT + tl.load(chunk_len + c1 - 1, mask=c1 > c0, other=0)
    for c in range(c0, c1):
        if REG:
            bos = seq_bos + (c - c0) * BT
            n_rows = tl.minimum(seq_eos - bos, BT)
        else:
            bos, n_rows = _chunk(chunk_start, chunk_len, c)
        rmask = rows < n_rows
        tl.store(hptr, S.to(hbuf.dtype.element_ty), mask=mkv)
        hptr += H * K * V
        mk = rmask[:, None] & (rk[None, :] < K)
        wc = tl.load(w + ((bos + rows)[:, None] * H + h) * K + rk[None, :], mask=mk, other=0.0)
        kc = tl.load(kg + ((bos + rows)[:, None] * H + h) * K + rk[None, :], mask=mk, other=0.0)
        off_v = ((bos + rows)[:, None] * H + h) * V + cv[None, :]
        mv = rmask[:, None] & (cv[None, :] < V)
        uc = tl.load(u + off_v, mask=mv, other=0.0).to(tl.float32)
        decay = tl.load(dl + (c * H + h) * K + rk, mask=rk < K, other=0.0)
        vn = uc - tl.dot(wc, S.to(wc.dtype))
        vn_lo = vn.to(vnew.dtype.element_ty)
        tl.store(vnew + off_v, vn_lo, mask=mv)
        S = S * decay[:, None] + tl.dot(tl.trans(kc), vn_lo.to(kc.dtype))
        if HAS_CK:
            ck = tl.load(chunk_ck + c)
            if ck >= 0:
                tl.store(hck + (ck.to(tl.int64) * H + h) * K * V + off_s, S, mask=mkv)
    if STORE_FINAL:
        tl.store(ht + nh.to(tl.int64) * K * V + off_s, S, mask=mkv)


@triton.jit
def _output_kernel(
    qg, Aqk, vnew, hbuf, o, chunk_start, chunk_len,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    rows = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    rmask = rows < n_rows
    qc = tl.load(qg + ((bos + rows)[:, None] * H + h) * K + rk[None, :], mask=rmask[:, None] & (rk[None, :] < K),
                 other=0.0)
    S = tl.load(hbuf + (c.to(tl.int64) * H + h) * K * V + rk[:, None] * V + cv[None, :],
                mask=(rk[:, None] < K) & (cv[None, :] < V), other=0.0)
    A = tl.load(Aqk + ((bos + rows)[:, None] * H + h) * BT + rows[None, :],
                mask=rmask[:, None] & (rows[None, :] < n_rows), other=0.0)
    A = tl.where(rows[:, None] >= rows[None, :], A, 0.0)
    off_v = ((bos + rows)[:, None] * H + h) * V + cv[None, :]
    mv = rmask[:, None] & (cv[None, :] < V)
    vn = tl.load(vnew + off_v, mask=mv, other=0.0)
    acc = tl.dot(qc.to(S.dtype), S)
    acc += tl.dot(A.to(vn.dtype), vn)
    tl.store(o + off_v, acc.to(o.dtype.element_ty), mask=mv)


def _chunk_table(
    bounds: list[int], checkpoint_positions: Sequence[Sequence[int]] | None
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Chunks of at most BT tokens per sequence, also cut at every checkpoint position. Returns
    (chunk_start, chunk_len, chunk_ck (checkpoint index ending there, or -1), seq_chunks [N + 1])."""
    starts: list[int] = []
    lens: list[int] = []
    cks: list[int] = []
    seq_chunks = [0]
    m = 0
    for n in range(len(bounds) - 1):
        bos, length = bounds[n], bounds[n + 1] - bounds[n]
        wanted = list(checkpoint_positions[n]) if checkpoint_positions is not None else []
        if wanted:
            cuts = sorted(set(range(0, length, BT)) | {p for p in wanted if p < length})
        else:
            cuts = list(range(0, length, BT))
        ends = [*cuts[1:], length]
        at = {p: m + i for i, p in enumerate(wanted)}
        m += len(wanted)
        for s, e in zip(cuts, ends):
            starts.append(bos + s)
            lens.append(e - s)
            cks.append(at.get(e, -1))
        seq_chunks.append(len(starts))
    return starts, lens, cks, seq_chunks


@functools.lru_cache(maxsize=8)
def _chunk_meta(bounds: tuple[int, ...], positions: tuple[tuple[int, ...], ...] | None,
                device: torch.device) -> tuple[int, Tensor]:
    """``_chunk_table`` on the device, [4 NC + N + 1] int32 (read only), and NC: built once for the layers of a
    step (they share the chunk's bounds and positions) rather than once a layer, as the host's time bounds a short
    prefill step (docs/benchmarks.md, "Agents' turns")."""
    starts, lens, cks, seq_chunks = _chunk_table(list(bounds), positions)
    return len(starts), torch.tensor(starts + lens + cks + seq_chunks, dtype=torch.int32).to(device, non_blocking=True)


def chunk_table(bounds: Sequence[int], device: torch.device) -> Tensor:
    """The device chunk table that calls over sequences of these bounds (no checkpoints) read, from the same cache:
    a CUDA graph that captured such a call keeps it alive by holding it (the cache may drop its entry)."""
    return _chunk_meta(tuple(int(b) for b in bounds), None, torch.device(device))[1]


@dataclass(frozen=True)
class ChunkTuning:
    """Launch parameters of :func:`chunk_kda_triton`'s six kernels; the defaults are the fastest measured on the
    H200 at H 32, K = V = 128 (bench/kernels.py ``--only tune`` times variants). Pass one as ``tuning=``;
    ``dataclasses.replace(ChunkTuning(), state_bv=16)`` changes one field.

    ``prep_bk``: K channels per prep program (128: one pass, the norms come from the same loads; narrower blocks
    add a first pass for the squares). ``tok_bh`` / ``tok_warps``: heads per program and warps of the exact
    diagonal kernel; ``tok_order`` 1 puts a chunk's rows on neighbouring programs (their key rows stay in L2).
    ``diag_mid`` 1 sends the fused bounded gate to the midpoint diagonal kernel where its span bound allows
    (slower at 8K and 32K tokens, so off); ``diag_ieee`` 1 runs its dots in IEEE float32 rather than tf32;
    ``diag_warps``: its warps. ``offdiag_*``: the off-diagonal kernel (1 warp with tf32 dots in the block inverse
    is fastest at the same error; ``inv_ieee`` 1 uses IEEE dots there). ``wu_*``: the w/u kernel's blocks, warps
    and stages. ``state_bv``: V block of the state kernel (32: 128 programs at H 32 for the H200's 132 SMs);
    ``state_reg`` 1 computes chunk starts where no checkpoint cuts a chunk, which lets 3 stages pipeline the
    loads. ``out_*``: the output kernel."""

    prep_bk: int = 128
    prep_warps: int = 4
    tok_bh: int = 8
    tok_warps: int = 4
    tok_order: int = 1
    diag_mid: int = 0
    diag_ieee: int = 0
    diag_warps: int = 4
    offdiag_bk: int = 32
    offdiag_warps: int = 1
    offdiag_stages: int = 2
    inv_ieee: int = 0
    wu_bk: int = 64
    wu_bv: int = 64
    wu_warps: int = 4
    wu_stages: int = 2
    state_bv: int = 32
    state_warps: int = 4
    state_stages: int = 3
    state_reg: int = 1
    out_bv: int = 64
    out_warps: int = 4


SPAN_MAX = 200.0  # widest sub-chunk decay span (log2 units) of the midpoint path: each factor within 2^100
LN2 = 0.6931471805599453


@functools.lru_cache(maxsize=16)
def _fields(tuning: ChunkTuning) -> dict[str, int]:
    """``asdict(tuning)``, once per tuning (read only): asdict costs tens of microseconds of the host's time, and a
    short prefill step's launches are what bounds it (docs/benchmarks.md, "Agents' turns")."""
    return asdict(tuning)


def _diag_step(cfg: dict[str, int], args: tuple[Any, ...], NC: int, H: int, K: int, BK: int, gate: Any) -> None:
    """The midpoint kernel for the fused bounded gate where its span bound allows, else the exact one."""
    lb = gate[2] if gate is not None else None
    # the fused bounded gate caps every step's log-decay at lb: a sub-chunk's span is at most 15 |lb| / ln 2
    if cfg["diag_mid"] and lb is not None and 15 * abs(float(lb)) / LN2 <= SPAN_MAX:
        _diag_mid_kernel[(NC, H, BT // BC)](
            *args, H=H, K=K, BT=BT, BC=BC, BK=BK, IEEE=bool(cfg["diag_ieee"]), num_warps=cfg["diag_warps"],
        )
    else:
        BH = min(cfg["tok_bh"], triton.next_power_of_2(H))
        grid = (NC * BT, triton.cdiv(H, BH)) if cfg["tok_order"] else (NC, BT, triton.cdiv(H, BH))
        _diag_token_kernel[grid](
            *args, H=H, K=K, BT=BT, BC=BC, BK=BK, BH=BH, ROW_FAST=bool(cfg["tok_order"]), num_warps=cfg["tok_warps"],
        )


def _launch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor | None,
    output_final_state: bool, bounds: list[int], use_qk_l2norm: bool,
    checkpoint_positions: Sequence[Sequence[int]] | None, tuning: ChunkTuning,
    gate: tuple[Tensor, Tensor, float | None] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Packed q, k, g [T, H, K], v [T, H, V], beta [T, H] (contiguous) -> o [T, H, V], final, checkpoints.
    ``gate``: (A_log [H] float32, dt_bias [H * K] float32, lower_bound) when g holds raw gate logits."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = len(bounds) - 1
    dev = q.device
    positions = tuple(tuple(int(p) for p in ps) for ps in checkpoint_positions) if checkpoint_positions is not None else None
    NC, meta = _chunk_meta(tuple(bounds), positions, dev)
    M = sum(len(p) for p in positions) if positions is not None else 0
    chunk_start, chunk_len = meta[:NC], meta[NC : 2 * NC]
    chunk_ck, seq_chunks_t = meta[2 * NC : 3 * NC], meta[3 * NC :]
    cfg = _fields(tuning)
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    BK = max(16, triton.next_power_of_2(K))
    BVf = max(16, triton.next_power_of_2(V))

    final = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    ckpt = q.new_empty(M, H, K, V, dtype=torch.float32) if checkpoint_positions is not None else None
    o = torch.empty_like(v)
    if NC == 0:
        if final is not None:
            final.copy_(h0 if h0 is not None else torch.zeros_like(final))
        return o, final, ckpt

    qn, kn, qg, kg, w = (torch.empty(T, H, K, device=dev, dtype=dt) for _ in range(5))
    G2 = torch.empty(T, H, K, device=dev, dtype=torch.float32)
    u = torch.empty(T, H, V, device=dev, dtype=dt)
    Aqk = torch.empty(T, H, BT, device=dev, dtype=dt)
    Xb = torch.empty(T, H, BT, device=dev, dtype=dt)
    Ld = torch.empty(T, H, BC, device=dev, dtype=torch.float32)
    dl = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    A_log, dt_bias, lb = gate if gate is not None else (None, None, None)
    gate_kind = 0 if gate is None else (1 if lb is None else 2)

    _prep_kernel[(NC, H)](
        q, k, g, A_log, dt_bias, qn, kn, G2, qg, kg, dl, chunk_start, chunk_len, scale,
        float(lb) if lb is not None else 0.0,
        H=H, K=K, BT=BT, BK=min(cfg["prep_bk"], BK), NORM=use_qk_l2norm, GATE=gate_kind,
        num_warps=cfg["prep_warps"],
    )
    _diag_step(cfg, (qn, kn, G2, beta, Aqk, Ld, chunk_start, chunk_len, scale), NC, H, K, BK, gate)
    _offdiag_kernel[(NC, H)](
        qn, kn, G2, beta, Aqk, Ld, Xb, chunk_start, chunk_len, scale,
        H=H, K=K, BT=BT, BC=BC, BK=min(cfg["offdiag_bk"], BK), INV_IEEE=bool(cfg["inv_ieee"]),
        num_warps=cfg["offdiag_warps"], num_stages=cfg["offdiag_stages"],
    )
    _wu_kernel[(NC, H)](
        Xb, kn, G2, v, w, u, chunk_start, chunk_len, H=H, K=K, V=V, BT=BT, BK=min(cfg["wu_bk"], BK),
        BV=min(cfg["wu_bv"], BVf), num_warps=cfg["wu_warps"], num_stages=cfg["wu_stages"],
    )

    BV = min(cfg["state_bv"], BVf)
    vnew = torch.empty(T, H, V, device=dev, dtype=dt)
    hbuf = torch.empty(NC, H, K, V, device=dev, dtype=dt)
    _state_kernel[(triton.cdiv(V, BV), N * H)](
        w, u, kg, dl, vnew, hbuf, h0, final, ckpt, chunk_start, chunk_len, chunk_ck, seq_chunks_t,
        H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, HAS_H0=h0 is not None, STORE_FINAL=final is not None,
        HAS_CK=M > 0, REG=bool(cfg["state_reg"]) and M == 0, num_warps=cfg["state_warps"],
        num_stages=cfg["state_stages"],
    )
    BV = min(cfg["out_bv"], BVf)
    _output_kernel[(NC, H, triton.cdiv(V, BV))](
        qg, Aqk, vnew, hbuf, o, chunk_start, chunk_len, H=H, K=K, V=V, BK=BK, BV=BV, BT=BT,
        num_warps=cfg["out_warps"],
    )
    return o, final, ckpt


def chunk_kda_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    tuning: ChunkTuning | None = None,
    cu_seqlens_cpu: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Chunked KDA forward (fla's ``chunk_kda`` arguments) plus float32 states at requested positions.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay (<= 0, any float dtype); beta [B, T, H];
    initial_state [N, H, K, V] float32; cu_seqlens int [N + 1] (then B = 1). ``checkpoint_positions``: per
    sequence, ascending positions p in [1, T_n]. With ``use_gate_in_kernel`` g holds the raw gate logits and
    the kernel computes the log-decay (see :func:`gate_params`). ``tuning``: launch parameters
    (:class:`ChunkTuning`, its defaults when None); ``cu_seqlens_cpu``: cu_seqlens's values on the host, read
    instead of reading them back from the device (a wait for every kernel queued before). Returns ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 | None,
    checkpoint_states [M, H, K, V] float32 | None)``. CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must match q [B, T, H, K]={tuple(q.shape)}, got k {tuple(k.shape)}, g {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H={B, T, H}, got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]={B, T, H}, got {tuple(beta.shape)}")
    if not all(16 <= d <= 256 and d & (d - 1) == 0 for d in (K, V)):
        raise ValueError(f"K and V must be powers of two in [16, 256], got K={K}, V={V}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1, got B={B}")
        bounds = [int(x) for x in (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist())]
        if len(bounds) != cu_seqlens.numel():
            raise ValueError(f"cu_seqlens_cpu must hold cu_seqlens's {cu_seqlens.numel()} offsets, got {len(bounds)}")
    else:
        bounds = [b * T for b in range(B + 1)]
    N = len(bounds) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V]={(N, H, K, V)}, got {tuple(initial_state.shape)}")
    if checkpoint_positions is not None:
        if len(checkpoint_positions) != N:
            raise ValueError(f"checkpoint_positions needs one list per sequence ({N}), got {len(checkpoint_positions)}")
        for n, ps in enumerate(checkpoint_positions):
            length = bounds[n + 1] - bounds[n]
            if list(ps) != sorted(set(ps)) or any(p < 1 or p > length for p in ps):
                raise ValueError(f"checkpoint_positions[{n}] must be ascending in [1, {length}], got {list(ps)}")
    if scale is None:
        scale = K**-0.5
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    gate = gate_params(H, K, A_log, dt_bias, lower_bound) if use_gate_in_kernel else None
    # [B, T, H, *] -> packed [B * T, H, *]
    o, final, ckpt = _launch(
        q.reshape(B * T, H, K).contiguous(), k.reshape(B * T, H, K).contiguous(),
        v.reshape(B * T, H, V).contiguous(), g.reshape(B * T, H, K).contiguous(),
        beta.reshape(B * T, H).contiguous(), float(scale), h0, output_final_state, bounds,
        use_qk_l2norm_in_kernel, checkpoint_positions, tuning or ChunkTuning(), gate,
    )
    return o.view(B, T, H, V), final, ckpt
