"""Chunked KDA forward in Triton (inference only: nothing is kept for a backward pass).

Three launches over a table of chunks (at most ``BT`` = 64 tokens each, starting at every sequence's first token;
a chunk also ends at every requested checkpoint position, so the state there is a chunk-boundary state):

1. ``_intra_kernel``  per (chunk, head): the gate (optional), q/k L2 norm (optional) and G, the in-chunk cumulative
   log-decay, computed in registers and never stored; L (strict, with beta) and A_qk (causal, with scale) built
   from 16-token sub-chunks on tensor cores; (I + L)^-1 by 16 x 16 blocks; w = (I + L)^-1 (beta * k * exp(G)),
   u = (I + L)^-1 (beta * v), kg = k * exp(G_last - G), qg = scale * q * exp(G) and exp(G_last) per chunk.
2. ``_state_kernel``  per (sequence, head, V block), sequential over chunks: the state at each chunk start,
   v' = u - w S, S <- diag(exp(G_last)) S + kg^T v'; float32 states at checkpoints and at the end.
3. ``_output_kernel`` per (chunk, head, V block): o = qg S + A_qk v'.

Decay factors exp(G_r - G_s) (s <= r) are never formed from exp(G) alone, which underflows. A block of rows in
sub-chunk i against columns of an earlier sub-chunk j factors through c_(i-1), the cumulative decay at the end of
sub-chunk i - 1: exp(G_r - c_(i-1)) and exp(c_(i-1) - G_s) are both <= 1. A diagonal block (r, s in the same
sub-chunk) factors through the midpoint m of the sub-chunk's decay range, so both factors stay within
exp(span / 2); where some channel's span exceeds ``SPAN_MAX`` that block takes an exact element-wise path.
With the bounded gate (lb -5) the span of 16 tokens is at most 80, so it never does.

``intra_parts`` (default 2): the intra kernel runs as two launches, one building A_qk (qg, rq) and one building
L, its inverse, w and u (kg, dl, rk): as one kernel it holds twenty [16, 16] float32 blocks and spills about 1 KB
per thread on sm_90 (bench/candidates/aot_sm90.py); each half holds ten. q, k and g are read twice (from L2,
mostly). On the H200 this is 13% faster than the single intra kernel (docs/benchmarks.md, Kernels, run C).

Layout: every activation is packed ``[T_total, H, *]`` (B * T rows without cu_seqlens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..gate.naive import gate_params

BT = 64  # chunk length
BC = 16  # sub-chunk length
SPAN_MAX = 160.0  # largest in-sub-chunk decay span (natural log) of the tensor-core diagonal path: e^80 factors


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
def _beta(beta, bos, row0, n_rows, h, H: tl.constexpr, BC: tl.constexpr):
    rows = row0 + tl.arange(0, BC)
    return tl.load(beta + (bos + rows) * H + h, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def _decay(x, A_log, dt_bias, row0, n_rows, h, cols, c_prev, lower_bound, K: tl.constexpr, BC: tl.constexpr,
           GATE: tl.constexpr):
    """Gate logits or log-decays x [BC, BK] of one sub-chunk -> G [BC, BK] (cumulative log-decay from the chunk
    start) and c [BK], G at its last row. GATE: 0 x is the log-decay, 1 standard gate, 2 bounded gate."""
    if GATE != 0:
        x = x + tl.load(dt_bias + h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        if GATE == 1:  # -exp(A_log) * softplus(x), softplus(x) = x above 20
            x = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        else:
            x = lower_bound * tl.sigmoid(a * x)
    rows = row0 + tl.arange(0, BC)
    x = tl.where(rows[:, None] < n_rows, x, 0.0)
    return tl.cumsum(x, axis=0) + c_prev[None, :], c_prev + tl.sum(x, axis=0)


@triton.jit
def _diag(qi, ki, G, c_prev, c, A, L, SPAN_MAX: tl.constexpr, BC: tl.constexpr, DO_A: tl.constexpr,
          DO_L: tl.constexpr):
    """Adds this K block's share of the diagonal blocks A (q . k) and L (k . k), both with exp(G_r - G_s), for
    every (r, s) of the sub-chunk (the caller masks s > r, where the fast path may leave inf or NaN)."""
    span = tl.max(c_prev - c, axis=0)
    if span <= SPAN_MAX:
        m = 0.5 * (c_prev + c)  # |G - m| <= span / 2 on every row
        kr = tl.trans(ki * tl.exp(m[None, :] - G))
        e = tl.exp(G - m[None, :])
        if DO_A:
            A = tl.dot(qi * e, kr, A)
        if DO_L:
            L = tl.dot(ki * e, kr, L)
    else:  # exact, one column s at a time
        rr = tl.arange(0, BC)
        for s in range(BC):
            sel = rr[:, None] == s
            k_s = tl.sum(tl.where(sel, ki, 0.0), axis=0)
            G_s = tl.sum(tl.where(sel, G, 0.0), axis=0)
            e = tl.exp(tl.minimum(G - G_s[None, :], 0.0)) * k_s[None, :]
            col = rr[None, :] == s
            if DO_A:
                A = tl.where(col, A + tl.sum(qi * e, axis=1)[:, None], A)
            if DO_L:
                L = tl.where(col, L + tl.sum(ki * e, axis=1)[:, None], L)
    return A, L


@triton.jit
def _cs(X, col_scale, dt: tl.constexpr):
    return (X * col_scale[None, :]).to(dt)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


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
def _intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, qg, kg, w, u, Aqk, dl, rq, rk, Xb, chunk_start, chunk_len, scale,
    lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, NORM: tl.constexpr, GATE: tl.constexpr, SPAN_MAX: tl.constexpr,
    INV_IEEE: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr,
):
    # PART 0: everything; 1: the A_qk side only (qg, rq, Aqk); 2: the L side only (kg, w, u, dl, rk, Xb). Two
    # launches (1 then 2) hold half the [BC, BC] accumulators each: the single kernel spills on sm_90.
    DO_A: tl.constexpr = PART != 2
    DO_L: tl.constexpr = PART != 1
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(chunk_start + c).to(tl.int64)
    n_rows = tl.load(chunk_len + c)
    rr = tl.arange(0, BC)
    b0 = _beta(beta, bos, 0, n_rows, h, H, BC)
    b1 = _beta(beta, bos, BC, n_rows, h, H, BC)
    b2 = _beta(beta, bos, 2 * BC, n_rows, h, H, BC)
    b3 = _beta(beta, bos, 3 * BC, n_rows, h, H, BC)

    z = tl.zeros([BC, BC], dtype=tl.float32)
    A00, A11, A22, A33, A10, A20, A21, A30, A31, A32 = z, z, z, z, z, z, z, z, z, z
    L00, L11, L22, L33, L10, L20, L21, L30, L31, L32 = z, z, z, z, z, z, z, z, z, z
    zr = tl.zeros([BC], dtype=tl.float32)
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = zr, zr, zr, zr, zr, zr, zr, zr
    # --- pass 1 over K blocks: the 10 lower [BC, BC] blocks of A_qk and L, and sum(x^2) of q and k rows (the L2
    # norm is applied to the blocks afterwards and to qg, kg by their readers); qg, kg, exp(G_last); k exp(G)
    # goes to w as scratch for pass 2. Every load comes first: the diagonal blocks' branches end the iteration.
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        q0 = _rows(q, bos, 0, n_rows, h, cols, H, K, BC)
        k0 = _rows(k, bos, 0, n_rows, h, cols, H, K, BC)
        x0 = _rows(g, bos, 0, n_rows, h, cols, H, K, BC)
        q1 = _rows(q, bos, BC, n_rows, h, cols, H, K, BC)
        k1 = _rows(k, bos, BC, n_rows, h, cols, H, K, BC)
        x1 = _rows(g, bos, BC, n_rows, h, cols, H, K, BC)
        q2 = _rows(q, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        k2 = _rows(k, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        x2 = _rows(g, bos, 2 * BC, n_rows, h, cols, H, K, BC)
        q3 = _rows(q, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        k3 = _rows(k, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        x3 = _rows(g, bos, 3 * BC, n_rows, h, cols, H, K, BC)
        if NORM:
            sq0 += tl.sum(q0 * q0, axis=1)
            sq1 += tl.sum(q1 * q1, axis=1)
            sq2 += tl.sum(q2 * q2, axis=1)
            sq3 += tl.sum(q3 * q3, axis=1)
            sk0 += tl.sum(k0 * k0, axis=1)
            sk1 += tl.sum(k1 * k1, axis=1)
            sk2 += tl.sum(k2 * k2, axis=1)
            sk3 += tl.sum(k3 * k3, axis=1)
        c_ = tl.zeros([BK], dtype=tl.float32)
        G0, c0 = _decay(x0, A_log, dt_bias, 0, n_rows, h, cols, c_, lower_bound, K, BC, GATE)
        G1, c1 = _decay(x1, A_log, dt_bias, BC, n_rows, h, cols, c0, lower_bound, K, BC, GATE)
        G2, c2 = _decay(x2, A_log, dt_bias, 2 * BC, n_rows, h, cols, c1, lower_bound, K, BC, GATE)
        G3, c3 = _decay(x3, A_log, dt_bias, 3 * BC, n_rows, h, cols, c2, lower_bound, K, BC, GATE)

        e = tl.exp(G0)
        qa0 = q0 * e
        ka0 = k0 * e
        kl0 = k0 * tl.exp(c0[None, :] - G0)
        if DO_A:
            _store_rows(qg, qa0 * scale, bos, 0, n_rows, h, cols, H, K, BC)
        if DO_L:
            _store_rows(w, ka0, bos, 0, n_rows, h, cols, H, K, BC)

        e = tl.exp(G1 - c0[None, :])
        qa1 = q1 * e
        ka1 = k1 * e
        kl1 = k1 * tl.exp(c1[None, :] - G1)
        r = tl.trans(kl0)
        if DO_A:
            A10 = tl.dot(qa1, r, A10)
        if DO_L:
            L10 = tl.dot(ka1, r, L10)
        f = tl.exp(c0)[None, :]
        if DO_A:
            _store_rows(qg, qa1 * (f * scale), bos, BC, n_rows, h, cols, H, K, BC)
        if DO_L:
            _store_rows(w, ka1 * f, bos, BC, n_rows, h, cols, H, K, BC)

        e = tl.exp(G2 - c1[None, :])
        qa2 = q2 * e
        ka2 = k2 * e
        kl2 = k2 * tl.exp(c2[None, :] - G2)
        r = tl.trans(kl0 * tl.exp(c1 - c0)[None, :])
        if DO_A:
            A20 = tl.dot(qa2, r, A20)
        if DO_L:
            L20 = tl.dot(ka2, r, L20)
        r = tl.trans(kl1)
        if DO_A:
            A21 = tl.dot(qa2, r, A21)
        if DO_L:
            L21 = tl.dot(ka2, r, L21)
        f = tl.exp(c1)[None, :]
        if DO_A:
            _store_rows(qg, qa2 * (f * scale), bos, 2 * BC, n_rows, h, cols, H, K, BC)
        if DO_L:
            _store_rows(w, ka2 * f, bos, 2 * BC, n_rows, h, cols, H, K, BC)

        e = tl.exp(G3 - c2[None, :])
        qa3 = q3 * e
        ka3 = k3 * e
        kl3 = k3 * tl.exp(c3[None, :] - G3)
        r = tl.trans(kl0 * tl.exp(c2 - c0)[None, :])
        if DO_A:
            A30 = tl.dot(qa3, r, A30)
        if DO_L:
            L30 = tl.dot(ka3, r, L30)
        r = tl.trans(kl1 * tl.exp(c2 - c1)[None, :])
        if DO_A:
            A31 = tl.dot(qa3, r, A31)
        if DO_L:
            L31 = tl.dot(ka3, r, L31)
        r = tl.trans(kl2)
        if DO_A:
            A32 = tl.dot(qa3, r, A32)
        if DO_L:
            L32 = tl.dot(ka3, r, L32)
        f = tl.exp(c2)[None, :]
        if DO_A:
            _store_rows(qg, qa3 * (f * scale), bos, 3 * BC, n_rows, h, cols, H, K, BC)
        if DO_L:
            _store_rows(w, ka3 * f, bos, 3 * BC, n_rows, h, cols, H, K, BC)

        # kg = k exp(G_last - G); G_last = c3 (padded rows add no decay)
        if DO_L:
            _store_rows(kg, kl0 * tl.exp(c3 - c0)[None, :], bos, 0, n_rows, h, cols, H, K, BC)
            _store_rows(kg, kl1 * tl.exp(c3 - c1)[None, :], bos, BC, n_rows, h, cols, H, K, BC)
            _store_rows(kg, kl2 * tl.exp(c3 - c2)[None, :], bos, 2 * BC, n_rows, h, cols, H, K, BC)
            _store_rows(kg, kl3, bos, 3 * BC, n_rows, h, cols, H, K, BC)
            tl.store(dl + (c.to(tl.int64) * H + h) * K + cols, tl.exp(c3), mask=cols < K)

        A00, L00 = _diag(q0, k0, G0, c_, c0, A00, L00, SPAN_MAX, BC, DO_A, DO_L)
        A11, L11 = _diag(q1, k1, G1, c0, c1, A11, L11, SPAN_MAX, BC, DO_A, DO_L)
        A22, L22 = _diag(q2, k2, G2, c1, c2, A22, L22, SPAN_MAX, BC, DO_A, DO_L)
        A33, L33 = _diag(q3, k3, G3, c2, c3, A33, L33, SPAN_MAX, BC, DO_A, DO_L)

    # --- L2 norms: A_ij scaled by rq_i rk_j, L_ij by rk_i rk_j; rq, rk out for the state and output kernels
    if NORM:
        rq0 = tl.rsqrt(sq0 + 1e-6)
        rq1 = tl.rsqrt(sq1 + 1e-6)
        rq2 = tl.rsqrt(sq2 + 1e-6)
        rq3 = tl.rsqrt(sq3 + 1e-6)
        rk0 = tl.rsqrt(sk0 + 1e-6)
        rk1 = tl.rsqrt(sk1 + 1e-6)
        rk2 = tl.rsqrt(sk2 + 1e-6)
        rk3 = tl.rsqrt(sk3 + 1e-6)
        if DO_A:
            tl.store(rq + (bos + rr) * H + h, rq0, mask=rr < n_rows)
            tl.store(rq + (bos + BC + rr) * H + h, rq1, mask=BC + rr < n_rows)
            tl.store(rq + (bos + 2 * BC + rr) * H + h, rq2, mask=2 * BC + rr < n_rows)
            tl.store(rq + (bos + 3 * BC + rr) * H + h, rq3, mask=3 * BC + rr < n_rows)
        if DO_L:
            tl.store(rk + (bos + rr) * H + h, rk0, mask=rr < n_rows)
            tl.store(rk + (bos + BC + rr) * H + h, rk1, mask=BC + rr < n_rows)
            tl.store(rk + (bos + 2 * BC + rr) * H + h, rk2, mask=2 * BC + rr < n_rows)
            tl.store(rk + (bos + 3 * BC + rr) * H + h, rk3, mask=3 * BC + rr < n_rows)
        A00 = A00 * rq0[:, None] * rk0[None, :]
        A11 = A11 * rq1[:, None] * rk1[None, :]
        A22 = A22 * rq2[:, None] * rk2[None, :]
        A33 = A33 * rq3[:, None] * rk3[None, :]
        A10 = A10 * rq1[:, None] * rk0[None, :]
        A20 = A20 * rq2[:, None] * rk0[None, :]
        A21 = A21 * rq2[:, None] * rk1[None, :]
        A30 = A30 * rq3[:, None] * rk0[None, :]
        A31 = A31 * rq3[:, None] * rk1[None, :]
        A32 = A32 * rq3[:, None] * rk2[None, :]
        L00 = L00 * rk0[:, None] * rk0[None, :]
        L11 = L11 * rk1[:, None] * rk1[None, :]
        L22 = L22 * rk2[:, None] * rk2[None, :]
        L33 = L33 * rk3[:, None] * rk3[None, :]
        L10 = L10 * rk1[:, None] * rk0[None, :]
        L20 = L20 * rk2[:, None] * rk0[None, :]
        L21 = L21 * rk2[:, None] * rk1[None, :]
        L30 = L30 * rk3[:, None] * rk0[None, :]
        L31 = L31 * rk3[:, None] * rk1[None, :]
        L32 = L32 * rk3[:, None] * rk2[None, :]
        # the w scratch holds k exp(G): its column j of X takes beta_j rk_j
        wk0, wk1, wk2, wk3 = b0 * rk0, b1 * rk1, b2 * rk2, b3 * rk3
    else:
        wk0, wk1, wk2, wk3 = b0, b1, b2, b3

    strict = rr[:, None] > rr[None, :]
    if DO_A:
        # --- masks, beta, scale; A_qk out (the output kernel masks the blocks above the diagonal)
        causal = rr[:, None] >= rr[None, :]
        _store_blk(Aqk, tl.where(causal, A00, 0.0) * scale, bos, 0, 0, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A10 * scale, bos, 1, 0, n_rows, h, H, BT, BC)
        _store_blk(Aqk, tl.where(causal, A11, 0.0) * scale, bos, 1, 1, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A20 * scale, bos, 2, 0, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A21 * scale, bos, 2, 1, n_rows, h, H, BT, BC)
        _store_blk(Aqk, tl.where(causal, A22, 0.0) * scale, bos, 2, 2, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A30 * scale, bos, 3, 0, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A31 * scale, bos, 3, 1, n_rows, h, H, BT, BC)
        _store_blk(Aqk, A32 * scale, bos, 3, 2, n_rows, h, H, BT, BC)
        _store_blk(Aqk, tl.where(causal, A33, 0.0) * scale, bos, 3, 3, n_rows, h, H, BT, BC)

    if DO_L:
        # --- X = (I + L)^-1, L lower block-triangular of 4 x 4 blocks
        X00 = _inv_unit_lower(tl.where(strict, L00, 0.0) * b0[:, None], BC, INV_IEEE)
        X11 = _inv_unit_lower(tl.where(strict, L11, 0.0) * b1[:, None], BC, INV_IEEE)
        X22 = _inv_unit_lower(tl.where(strict, L22, 0.0) * b2[:, None], BC, INV_IEEE)
        X33 = _inv_unit_lower(tl.where(strict, L33, 0.0) * b3[:, None], BC, INV_IEEE)
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

        if SPLIT:  # X diag(beta) out; _wu_kernel forms w and u
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
        else:
            # --- pass 2: w = X diag(beta rk) (k exp(G)) in place of its scratch, u = X diag(beta) v; operands in the
            # input dtype
            dt = w.dtype.element_ty
            Y00, Y11, Y22, Y33 = _cs(X00, wk0, dt), _cs(X11, wk1, dt), _cs(X22, wk2, dt), _cs(X33, wk3, dt)
            Y10, Y20, Y21 = _cs(X10, wk0, dt), _cs(X20, wk0, dt), _cs(X21, wk1, dt)
            Y30, Y31, Y32 = _cs(X30, wk0, dt), _cs(X31, wk1, dt), _cs(X32, wk2, dt)
            tl.debug_barrier()  # pass 1's scratch rows come from other threads
            for kb in range(0, K, BK):
                cols = kb + tl.arange(0, BK)
                s0 = _rows(w, bos, 0, n_rows, h, cols, H, K, BC).to(dt)
                s1 = _rows(w, bos, BC, n_rows, h, cols, H, K, BC).to(dt)
                s2 = _rows(w, bos, 2 * BC, n_rows, h, cols, H, K, BC).to(dt)
                s3 = _rows(w, bos, 3 * BC, n_rows, h, cols, H, K, BC).to(dt)
                o0 = tl.dot(Y00, s0)
                o1 = tl.dot(Y11, s1, tl.dot(Y10, s0))
                o2 = tl.dot(Y22, s2, tl.dot(Y21, s1, tl.dot(Y20, s0)))
                o3 = tl.dot(Y33, s3, tl.dot(Y32, s2, tl.dot(Y31, s1, tl.dot(Y30, s0))))
                tl.debug_barrier()  # every thread has read this block's scratch before any overwrites it
                _store_rows(w, o0, bos, 0, n_rows, h, cols, H, K, BC)
                _store_rows(w, o1, bos, BC, n_rows, h, cols, H, K, BC)
                _store_rows(w, o2, bos, 2 * BC, n_rows, h, cols, H, K, BC)
                _store_rows(w, o3, bos, 3 * BC, n_rows, h, cols, H, K, BC)
            Y00, Y11, Y22, Y33 = _cs(X00, b0, dt), _cs(X11, b1, dt), _cs(X22, b2, dt), _cs(X33, b3, dt)
            Y10, Y20, Y21 = _cs(X10, b0, dt), _cs(X20, b0, dt), _cs(X21, b1, dt)
            Y30, Y31, Y32 = _cs(X30, b0, dt), _cs(X31, b1, dt), _cs(X32, b2, dt)
            for v0 in range(0, V, BV):
                cols = v0 + tl.arange(0, BV)
                s0 = _rows(v, bos, 0, n_rows, h, cols, H, V, BC).to(dt)
                s1 = _rows(v, bos, BC, n_rows, h, cols, H, V, BC).to(dt)
                s2 = _rows(v, bos, 2 * BC, n_rows, h, cols, H, V, BC).to(dt)
                s3 = _rows(v, bos, 3 * BC, n_rows, h, cols, H, V, BC).to(dt)
                _store_rows(u, tl.dot(Y00, s0), bos, 0, n_rows, h, cols, H, V, BC)
                _store_rows(u, tl.dot(Y11, s1, tl.dot(Y10, s0)), bos, BC, n_rows, h, cols, H, V, BC)
                _store_rows(u, tl.dot(Y22, s2, tl.dot(Y21, s1, tl.dot(Y20, s0))), bos, 2 * BC, n_rows, h, cols, H, V, BC)
                _store_rows(u, tl.dot(Y33, s3, tl.dot(Y32, s2, tl.dot(Y31, s1, tl.dot(Y30, s0)))), bos, 3 * BC, n_rows, h,
                            cols, H, V, BC)


@triton.jit
def _wu_kernel(
    Xb, rkn, w, u, v, chunk_start, chunk_len,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORM: tl.constexpr,
):
    """w = X diag(beta) diag(rk) (k exp(G)) in place of the scratch in w, u = X diag(beta) v, per (chunk, head)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(chunk_start + c).to(tl.int64)
    n_rows = tl.load(chunk_len + c)
    rows = tl.arange(0, BT)
    rmask = rows < n_rows
    X = tl.load(Xb + ((bos + rows)[:, None] * H + h) * BT + rows[None, :],
                mask=rmask[:, None] & (rows[None, :] < n_rows), other=0.0)
    X = tl.where(rows[:, None] >= rows[None, :], X, 0.0).to(w.dtype.element_ty)
    if NORM:
        r = tl.load(rkn + (bos + rows) * H + h, mask=rmask, other=0.0)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        s = _rows(w, bos, 0, n_rows, h, cols, H, K, BT)
        if NORM:
            s = s * r[:, None]
        _store_rows(w, tl.dot(X, s.to(X.dtype)), bos, 0, n_rows, h, cols, H, K, BT)
    for vb in range(0, V, BV):
        cols = vb + tl.arange(0, BV)
        s = _rows(v, bos, 0, n_rows, h, cols, H, V, BT).to(X.dtype)
        _store_rows(u, tl.dot(X, s), bos, 0, n_rows, h, cols, H, V, BT)


@triton.jit
def _state_kernel(
    w, u, kg, dl, rkn, vnew, hbuf, h0, ht, hck, chunk_start, chunk_len, chunk_ck, seq_chunks,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_CK: tl.constexpr, NORM: tl.constexpr,
):
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
    for c in range(c0, c1):
        bos = tl.load(chunk_start + c).to(tl.int64)
        n_rows = tl.load(chunk_len + c)
        rmask = rows < n_rows
        tl.store(hptr, S.to(hbuf.dtype.element_ty), mask=mkv)
        hptr += H * K * V
        wc = tl.load(w + ((bos + rows)[:, None] * H + h) * K + rk[None, :],
                     mask=rmask[:, None] & (rk[None, :] < K), other=0.0)
        kc = tl.load(kg + ((bos + rows)[:, None] * H + h) * K + rk[None, :],
                     mask=rmask[:, None] & (rk[None, :] < K), other=0.0)
        if NORM:  # kg holds the unnormalised k
            kc = (kc * tl.load(rkn + (bos + rows) * H + h, mask=rmask, other=0.0)[:, None]).to(wc.dtype)
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
    qg, rqn, Aqk, vnew, hbuf, o, chunk_start, chunk_len,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    NORM: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    bos = tl.load(chunk_start + c).to(tl.int64)
    n_rows = tl.load(chunk_len + c)
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
    if NORM:  # qg holds the unnormalised q
        qc = qc.to(tl.float32) * tl.load(rqn + (bos + rows) * H + h, mask=rmask, other=0.0)[:, None]
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


def _launch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor | None,
    output_final_state: bool, bounds: list[int], use_qk_l2norm: bool,
    checkpoint_positions: Sequence[Sequence[int]] | None, tune: dict[str, int] | None = None,
    gate: tuple[Tensor, Tensor, float | None] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Packed q, k, g [T, H, K], v [T, H, V], beta [T, H] (contiguous) -> o [T, H, V], final, checkpoints.
    ``gate``: (A_log [H] float32, dt_bias [H * K] float32, lower_bound) when g holds raw gate logits."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = len(bounds) - 1
    dev = q.device
    starts, lens, cks, seq_chunks = _chunk_table(bounds, checkpoint_positions)
    NC = len(starts)
    M = sum(len(p) for p in checkpoint_positions) if checkpoint_positions is not None else 0
    meta = torch.tensor(starts + lens + cks + seq_chunks, dtype=torch.int32).to(dev, non_blocking=True)
    chunk_start, chunk_len = meta[:NC], meta[NC : 2 * NC]
    chunk_ck, seq_chunks_t = meta[2 * NC : 3 * NC], meta[3 * NC :]
    cfg: dict[str, int | float] = {
        "intra_bk": 32, "intra_bv": 32, "intra_warps": 4, "intra_stages": 2, "inv_ieee": 1, "span_max": SPAN_MAX,
        "split": 0, "wu_bk": 64, "wu_bv": 64, "wu_warps": 4, "intra_parts": 2,
        "state_bv": 64, "state_warps": 4, "state_stages": 2, "out_bv": 64, "out_warps": 4,
    }
    cfg.update(tune or {})
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

    qg = torch.empty(T, H, K, device=dev, dtype=dt)
    kg = torch.empty(T, H, K, device=dev, dtype=dt)
    w = torch.empty(T, H, K, device=dev, dtype=dt)
    u = torch.empty(T, H, V, device=dev, dtype=dt)
    Aqk = torch.empty(T, H, BT, device=dev, dtype=dt)
    dl = torch.empty(NC, H, K, device=dev, dtype=torch.float32)
    rq, rk = (torch.empty(T, H, device=dev, dtype=torch.float32) for _ in range(2)) if use_qk_l2norm else (None, None)
    Xb = torch.empty(T, H, BT, device=dev, dtype=dt) if cfg["split"] else None
    A_log, dt_bias, lb = gate if gate is not None else (None, None, None)
    gate_kind = 0 if gate is None else (1 if lb is None else 2)
    # intra_parts 2: the A_qk side and the L side as two launches of the same kernel (half the live blocks each)
    for part in (1, 2) if int(cfg["intra_parts"]) == 2 else (0,):
        _intra_kernel[(NC, H)](
            q, k, v, g, beta, A_log, dt_bias, qg, kg, w, u, Aqk, dl, rq, rk, Xb, chunk_start, chunk_len, scale,
            float(lb) if lb is not None else 0.0,
            H=H, K=K, V=V, BK=min(int(cfg["intra_bk"]), BK), BV=min(int(cfg["intra_bv"]), BVf), BT=BT, BC=BC,
            NORM=use_qk_l2norm, GATE=gate_kind, SPAN_MAX=float(cfg["span_max"]), INV_IEEE=bool(cfg["inv_ieee"]),
            SPLIT=Xb is not None, PART=part, num_warps=int(cfg["intra_warps"]),
            num_stages=int(cfg["intra_stages"]),
        )
    if Xb is not None:
        _wu_kernel[(NC, H)](
            Xb, rk, w, u, v, chunk_start, chunk_len, H=H, K=K, V=V, BT=BT, BK=min(int(cfg["wu_bk"]), BK),
            BV=min(int(cfg["wu_bv"]), BVf), NORM=use_qk_l2norm, num_warps=int(cfg["wu_warps"]),
        )

    BV = min(int(cfg["state_bv"]), BVf)
    vnew = torch.empty(T, H, V, device=dev, dtype=dt)
    hbuf = torch.empty(NC, H, K, V, device=dev, dtype=dt)
    _state_kernel[(triton.cdiv(V, BV), N * H)](
        w, u, kg, dl, rk, vnew, hbuf, h0, final, ckpt, chunk_start, chunk_len, chunk_ck, seq_chunks_t,
        H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, HAS_H0=h0 is not None, STORE_FINAL=final is not None,
        HAS_CK=M > 0, NORM=use_qk_l2norm, num_warps=int(cfg["state_warps"]), num_stages=int(cfg["state_stages"]),
    )
    BV = min(int(cfg["out_bv"]), BVf)
    _output_kernel[(NC, H, triton.cdiv(V, BV))](
        qg, rq, Aqk, vnew, hbuf, o, chunk_start, chunk_len,
        H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, NORM=use_qk_l2norm, num_warps=int(cfg["out_warps"]),
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
    tune: dict[str, int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Chunked KDA forward (fla's ``chunk_kda`` arguments) plus float32 states at requested positions.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay (<= 0, any float dtype); beta [B, T, H];
    initial_state [N, H, K, V] float32; cu_seqlens int [N + 1] (then B = 1). ``checkpoint_positions``: per
    sequence, ascending positions p in [1, T_n]. With ``use_gate_in_kernel`` g holds the raw gate logits and
    the kernel computes the log-decay (see :func:`gate_params`). ``tune`` overrides launch parameters. Returns ``(o [B, T, H, V] in v's dtype, final_state
    [N, H, K, V] float32 | None, checkpoint_states [M, H, K, V] float32 | None)``. CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``.
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
        bounds = [int(x) for x in cu_seqlens.tolist()]
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
        use_qk_l2norm_in_kernel, checkpoint_positions, tune, gate,
    )
    return o.view(B, T, H, V), final, ckpt

