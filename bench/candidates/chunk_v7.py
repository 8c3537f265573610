"""Candidate chunk_kda v7: the shipped forward (kernels/kda/chunk.py) with its prep and diagonal steps fused into
one kernel per (chunk, head).

Everything else comes from the shipped module (``from . import chunk``: this file is loaded as a module of
``kda_sessions.kernels.kda``, by bench/kernels.py ``--old`` and by tests/kernels/test_chunk_v7.py), through its
private ``_prep`` hook. The shipped pipeline writes qn, kn and G (float32) in ``_prep_kernel`` and reads them back
in the token-parallel ``_diag_token_kernel``, about 1 KB per (token, head) at K 128 plus L2 re-reads of the key
rows. ``_prep_diag_kernel`` computes the diagonal [16, 16] blocks of A_qk and L from the q, k, g tiles it loads
for the prep anyway, in two passes over K:

1. per sub-chunk i (statically 0..3), over K in blocks of ``fused_bkp`` channels: raw q, k, g [16, BKP] tiles,
   the log-decay (any gate), its cumulative sum Gl local to the sub-chunk (a difference G_r - G_s within a
   sub-chunk needs no chunk prefix), G2 = prefix + Gl out (the prefix is G2 at the previous sub-chunk's last
   row, read back after a barrier), the row sums of squares for the norms, and the raw blocks
   A_raw[r, s] = sum_c q_rc k_sc 2^min(Gl_rc - Gl_sc, 0) (L_raw with k_r), exact for any span. The L2 norms
   factor out (A = diag(rq) A_raw diag(rk)), so one K loop suffices: the norms scale the [16, 16] results,
   which go out as the shipped diagonal step writes them (A_qk: s <= r times scale; Ld: s < r times beta_r,
   zeros from r on). Only the A and L accumulators of one sub-chunk are live at a time.
2. over K in blocks of ``prep_bk`` channels: q, k (L1/L2-resident) and G2 (just written) again for qn, kn,
   qg = scale qn 2^G, kg = kn 2^(G_last - G) (G_last = G2 at the chunk's last row) and dl = 2^G_last.

Forms of the raw blocks (``fused_split``, ``fused_mid``):

- 0 / 0: one [16, 16, BKP] broadcast per tile, every (r, s) pair through exp2 (those with s > r are masked).
- 1 / 0: the sub-chunk as two 8-row halves a, b: the blocks (a, a) and (b, b) as [8, 8, BKP] broadcasts, the
  block (b, a) factored through the last row of a, k_s 2^(G_7 - G_s) and q_r 2^(G_r - G_7), both <= 1 (so as
  exact as the product: where a factor underflows, so does the product). 144 exp2 per (sub-chunk, channel)
  instead of 256, and [8, 8, BKP] temporaries instead of [16, 16, BKP] (a quarter of the registers).
- 0 / 1: per tile, where the widest channel span of Gl (log2 units) is within ``chunk.SPAN_MAX``, both factors
  through the channel's midpoint and two [16, BKP] x [BKP, 16] dots (tf32, or IEEE with ``diag_ieee`` 1; the
  shipped midpoint kernel's form); else the exact broadcast. A scalar branch per (sub-chunk, K block).

Launch parameters beyond the shipped :data:`chunk.DEFAULTS` (``tune`` keys): ``fused_bkp`` (32), ``fused_warps``
(4), ``fused_split`` (0), ``fused_mid`` (0, not with ``fused_split``); ``prep_bk`` and ``diag_ieee`` keep their
meaning for the second pass and the midpoint dots. The shipped prep and diagonal keys (``prep_warps``, ``tok_*``,
``diag_mid``, ``diag_warps``) are accepted and unused.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from . import chunk as shipped
from .chunk import BC, BT, RCP_LN2, _beta, _chunk, _log_decay, _mm, _row, _rows, _store_rows

DEFAULTS: dict[str, int] = {**shipped.DEFAULTS, "fused_bkp": 32, "fused_warps": 4, "fused_split": 0, "fused_mid": 0}


@triton.jit
def _exact(qi, ki, Gl):
    """sum_c q_rc k_sc 2^min(Gl_rc - Gl_sc, 0) and the same with k_r, for every pair (r, s) of rows of [R, BKP]
    tiles; [R, R] (entries s > r are not decayed products: the caller masks them)."""
    e = tl.exp2(tl.minimum(Gl[:, None, :] - Gl[None, :, :], 0.0)) * ki[None, :, :]
    return tl.sum(qi[:, None, :] * e, axis=2), tl.sum(ki[:, None, :] * e, axis=2)


@triton.jit
def _mid(qi, ki, Gl, IEEE: tl.constexpr):
    """As :func:`_exact` on tensor cores, both factors through the midpoint of each channel's range of Gl: within
    2^(span / 2) each; entries s > r may overflow (the caller masks them)."""
    g_hi = tl.max(Gl, axis=0)
    g_lo = tl.min(Gl, axis=0)
    mid = 0.5 * (g_hi + g_lo)
    e = tl.exp2(Gl - mid[None, :])
    kt = tl.trans(ki * tl.exp2(mid[None, :] - Gl))
    return _mm(qi * e, kt, IEEE), _mm(ki * e, kt, IEEE)


@triton.jit
def _decay(g, A_log, dt_bias, bos, row0, n_rows, h, cols, lower_bound,
           H: tl.constexpr, K: tl.constexpr, GATE: tl.constexpr, R: tl.constexpr):
    """Log-decays in log2 units of rows row0 .. row0 + R, zero on padded rows (they add no decay)."""
    x = _log_decay(_rows(g, bos, row0, n_rows, h, cols, H, K, R), A_log, dt_bias, h, cols, lower_bound, K, GATE)
    return tl.where((row0 + tl.arange(0, R))[:, None] < n_rows, x, 0.0) * RCP_LN2


@triton.jit
def _prefix(G2, bos, n_rows, h, cols, I: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """G2 at the last row of sub-chunk I - 1 (this program wrote it before a barrier), zeros for I = 0."""
    if I > 0:
        p = _row(G2, bos, I * BC - 1, n_rows, h, cols, H, K)
    else:
        p = tl.zeros(cols.shape, dtype=tl.float32)
    return p


@triton.jit
def _norm(s, NORM: tl.constexpr):
    if NORM:
        r = tl.rsqrt(s + 1e-6)
    else:
        r = tl.full(s.shape, 1.0, dtype=tl.float32)
    return r


@triton.jit
def _finish(A, L, rq, rk_r, rk_s, b, scale, STRICT_A: tl.constexpr, STRICT_L: tl.constexpr, R: tl.constexpr):
    """Raw [R, R] blocks -> A_qk's (times the norms and scale) and L's (times the key norms and beta_r), zeros
    above the diagonal (and on it for L: the pair (r, r) is not in L) unless the block is below it."""
    rr = tl.arange(0, R)
    if STRICT_A:
        A = tl.where(rr[:, None] >= rr[None, :], A, 0.0)  # above the diagonal: masked, may be inf or NaN
    if STRICT_L:
        L = tl.where(rr[:, None] > rr[None, :], L, 0.0)
    return A * (rq * scale)[:, None] * rk_s[None, :], L * (rk_r * b)[:, None] * rk_s[None, :]


@triton.jit
def _walk16(
    q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, I: tl.constexpr,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKP: tl.constexpr, NORM: tl.constexpr,
    GATE: tl.constexpr, MID: tl.constexpr, IEEE: tl.constexpr, SPAN_MAX: tl.constexpr,
):
    """Sub-chunk I: G2 out, its diagonal blocks of A_qk and L out; returns its row norms (rq, rk) [BC]."""
    row0 = I * BC
    rq = tl.full([BC], 1.0, dtype=tl.float32)
    rk = tl.full([BC], 1.0, dtype=tl.float32)
    if row0 < n_rows:
        A = tl.zeros([BC, BC], dtype=tl.float32)
        L = tl.zeros([BC, BC], dtype=tl.float32)
        sq = tl.zeros([BC], dtype=tl.float32)
        sk = tl.zeros([BC], dtype=tl.float32)
        for kk in range(0, K, BKP):
            cols = kk + tl.arange(0, BKP)
            qi = _rows(q, bos, row0, n_rows, h, cols, H, K, BC)
            ki = _rows(k, bos, row0, n_rows, h, cols, H, K, BC)
            Gl = tl.cumsum(_decay(g, A_log, dt_bias, bos, row0, n_rows, h, cols, lower_bound, H, K, GATE, BC), axis=0)
            _store_rows(G2, _prefix(G2, bos, n_rows, h, cols, I, H, K, BC)[None, :] + Gl, bos, row0, n_rows, h,
                        cols, H, K, BC)
            if NORM:
                sq += tl.sum(qi * qi, axis=1)
                sk += tl.sum(ki * ki, axis=1)
            if MID:
                # padded rows repeat the last valid row's Gl: they widen no span and overflow no factor
                if tl.max(tl.max(Gl, axis=0) - tl.min(Gl, axis=0), axis=0) <= SPAN_MAX:
                    dA, dL = _mid(qi, ki, Gl, IEEE)
                else:
                    dA, dL = _exact(qi, ki, Gl)
            else:
                dA, dL = _exact(qi, ki, Gl)
            A += dA
            L += dL
        rq = _norm(sq, NORM)
        rk = _norm(sk, NORM)
        rr = tl.arange(0, BC)
        A, L = _finish(A, L, rq, rk, rk, _beta(beta, bos, row0, n_rows, h, H, BC), scale, True, True, BC)
        _store_rows(Aqk, A, bos, row0, n_rows, h, row0 + rr, H, BT, BC)
        _store_rows(Ld, L, bos, row0, n_rows, h, rr, H, BC, BC)
    return rq, rk


@triton.jit
def _cat(a, b):
    """[R] and [R] -> [2R] (a first)."""
    return tl.reshape(tl.permute(tl.join(a, b), (1, 0)), (2 * a.shape[0],))


@triton.jit
def _walk8(
    q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, I: tl.constexpr,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKP: tl.constexpr, NORM: tl.constexpr,
    GATE: tl.constexpr,
):
    """As :func:`_walk16` on two 8-row halves a, b: the blocks (a, a), (b, b) exact, (b, a) factored through the
    last row of a (both factors <= 1)."""
    HC: tl.constexpr = BC // 2
    row0 = I * BC
    rq = tl.full([BC], 1.0, dtype=tl.float32)
    rk = tl.full([BC], 1.0, dtype=tl.float32)
    if row0 < n_rows:
        Aaa = tl.zeros([HC, HC], dtype=tl.float32)
        Aba = tl.zeros([HC, HC], dtype=tl.float32)
        Abb = tl.zeros([HC, HC], dtype=tl.float32)
        Laa = tl.zeros([HC, HC], dtype=tl.float32)
        Lba = tl.zeros([HC, HC], dtype=tl.float32)
        Lbb = tl.zeros([HC, HC], dtype=tl.float32)
        sqa = tl.zeros([HC], dtype=tl.float32)
        sqb = tl.zeros([HC], dtype=tl.float32)
        ska = tl.zeros([HC], dtype=tl.float32)
        skb = tl.zeros([HC], dtype=tl.float32)
        for kk in range(0, K, BKP):
            cols = kk + tl.arange(0, BKP)
            qa = _rows(q, bos, row0, n_rows, h, cols, H, K, HC)
            ka = _rows(k, bos, row0, n_rows, h, cols, H, K, HC)
            qb = _rows(q, bos, row0 + HC, n_rows, h, cols, H, K, HC)
            kb = _rows(k, bos, row0 + HC, n_rows, h, cols, H, K, HC)
            xa = _decay(g, A_log, dt_bias, bos, row0, n_rows, h, cols, lower_bound, H, K, GATE, HC)
            xb = _decay(g, A_log, dt_bias, bos, row0 + HC, n_rows, h, cols, lower_bound, H, K, GATE, HC)
            Ga = tl.cumsum(xa, axis=0)
            Gb = tl.cumsum(xb, axis=0)  # local to half b: G_r - G_(last row of a)
            sa = tl.sum(xa, axis=0)
            p = _prefix(G2, bos, n_rows, h, cols, I, H, K, BC)
            _store_rows(G2, p[None, :] + Ga, bos, row0, n_rows, h, cols, H, K, HC)
            _store_rows(G2, (p + sa)[None, :] + Gb, bos, row0 + HC, n_rows, h, cols, H, K, HC)
            if NORM:
                sqa += tl.sum(qa * qa, axis=1)
                sqb += tl.sum(qb * qb, axis=1)
                ska += tl.sum(ka * ka, axis=1)
                skb += tl.sum(kb * kb, axis=1)
            dA, dL = _exact(qa, ka, Ga)
            Aaa += dA
            Laa += dL
            dA, dL = _exact(qb, kb, Gb)
            Abb += dA
            Lbb += dL
            kf = ka * tl.exp2(tl.minimum(sa[None, :] - Ga, 0.0))  # k_s 2^(G_7 - G_s)
            eb = tl.exp2(tl.minimum(Gb, 0.0))  # 2^(G_r - G_7)
            kf3 = kf[None, :, :]
            Aba += tl.sum((qb * eb)[:, None, :] * kf3, axis=2)
            Lba += tl.sum((kb * eb)[:, None, :] * kf3, axis=2)
        rqa = _norm(sqa, NORM)
        rqb = _norm(sqb, NORM)
        rka = _norm(ska, NORM)
        rkb = _norm(skb, NORM)
        ba = _beta(beta, bos, row0, n_rows, h, H, HC)
        bb = _beta(beta, bos, row0 + HC, n_rows, h, H, HC)
        hh = tl.arange(0, HC)
        Aaa, Laa = _finish(Aaa, Laa, rqa, rka, rka, ba, scale, True, True, HC)
        Aba, Lba = _finish(Aba, Lba, rqb, rkb, rka, bb, scale, False, False, HC)
        Abb, Lbb = _finish(Abb, Lbb, rqb, rkb, rkb, bb, scale, True, True, HC)
        _store_rows(Aqk, Aaa, bos, row0, n_rows, h, row0 + hh, H, BT, HC)
        _store_rows(Aqk, Aba, bos, row0 + HC, n_rows, h, row0 + hh, H, BT, HC)
        _store_rows(Aqk, Abb, bos, row0 + HC, n_rows, h, row0 + HC + hh, H, BT, HC)
        _store_rows(Ld, Laa, bos, row0, n_rows, h, hh, H, BC, HC)
        _store_rows(Ld, tl.zeros([HC, HC], dtype=tl.float32), bos, row0, n_rows, h, HC + hh, H, BC, HC)
        _store_rows(Ld, Lba, bos, row0 + HC, n_rows, h, hh, H, BC, HC)
        _store_rows(Ld, Lbb, bos, row0 + HC, n_rows, h, HC + hh, H, BC, HC)
        rq = _cat(rqa, rqb)
        rk = _cat(rka, rkb)
    return rq, rk


@triton.jit
def _walk(
    q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, I: tl.constexpr,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKP: tl.constexpr, NORM: tl.constexpr,
    GATE: tl.constexpr, SPLIT: tl.constexpr, MID: tl.constexpr, IEEE: tl.constexpr, SPAN_MAX: tl.constexpr,
):
    if SPLIT:
        rq, rk = _walk8(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, I,
                        H, K, BT, BC, BKP, NORM, GATE)
    else:
        rq, rk = _walk16(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, I,
                         H, K, BT, BC, BKP, NORM, GATE, MID, IEEE, SPAN_MAX)
    tl.debug_barrier()  # the next sub-chunk reads this one's last G2 row, the second pass all of G2
    return rq, rk


@triton.jit
def _emit(q, k, G2, qn, kn, qg, kg, bos, n_rows, h, cols, g_last, rq, rk, scale, I: tl.constexpr,
          H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """qn, kn, qg, kg of sub-chunk I, K block ``cols`` (as the shipped ``_prep_kernel``)."""
    row0 = I * BC
    if row0 < n_rows:
        qv = _rows(q, bos, row0, n_rows, h, cols, H, K, BC) * rq[:, None]
        kv = _rows(k, bos, row0, n_rows, h, cols, H, K, BC) * rk[:, None]
        G = _rows(G2, bos, row0, n_rows, h, cols, H, K, BC)
        _store_rows(qn, qv, bos, row0, n_rows, h, cols, H, K, BC)
        _store_rows(kn, kv, bos, row0, n_rows, h, cols, H, K, BC)
        _store_rows(qg, qv * tl.exp2(G) * scale, bos, row0, n_rows, h, cols, H, K, BC)
        _store_rows(kg, kv * tl.exp2(g_last[None, :] - G), bos, row0, n_rows, h, cols, H, K, BC)


@triton.jit
def _prep_diag_kernel(
    q, k, g, A_log, dt_bias, qn, kn, G2, qg, kg, dl, beta, Aqk, Ld, chunk_start, chunk_len, scale, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKP: tl.constexpr, BKS: tl.constexpr,
    NORM: tl.constexpr, GATE: tl.constexpr, SPLIT: tl.constexpr, MID: tl.constexpr, IEEE: tl.constexpr,
    SPAN_MAX: tl.constexpr,
):
    """Per (chunk, head): everything the shipped ``_prep_kernel`` and diagonal step write (module docstring)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    bos, n_rows = _chunk(chunk_start, chunk_len, c)
    rq0, rk0 = _walk(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, 0,
                     H, K, BT, BC, BKP, NORM, GATE, SPLIT, MID, IEEE, SPAN_MAX)
    rq1, rk1 = _walk(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, 1,
                     H, K, BT, BC, BKP, NORM, GATE, SPLIT, MID, IEEE, SPAN_MAX)
    rq2, rk2 = _walk(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, 2,
                     H, K, BT, BC, BKP, NORM, GATE, SPLIT, MID, IEEE, SPAN_MAX)
    rq3, rk3 = _walk(q, k, g, A_log, dt_bias, G2, beta, Aqk, Ld, bos, n_rows, h, scale, lower_bound, 3,
                     H, K, BT, BC, BKP, NORM, GATE, SPLIT, MID, IEEE, SPAN_MAX)
    for kk in range(0, K, BKS):
        cols = kk + tl.arange(0, BKS)
        g_last = _row(G2, bos, n_rows - 1, n_rows, h, cols, H, K)
        tl.store(dl + (c.to(tl.int64) * H + h) * K + cols, tl.exp2(g_last), mask=cols < K)
        _emit(q, k, G2, qn, kn, qg, kg, bos, n_rows, h, cols, g_last, rq0, rk0, scale, 0, H, K, BC)
        _emit(q, k, G2, qn, kn, qg, kg, bos, n_rows, h, cols, g_last, rq1, rk1, scale, 1, H, K, BC)
        _emit(q, k, G2, qn, kn, qg, kg, bos, n_rows, h, cols, g_last, rq2, rk2, scale, 2, H, K, BC)
        _emit(q, k, G2, qn, kn, qg, kg, bos, n_rows, h, cols, g_last, rq3, rk3, scale, 3, H, K, BC)


def _prep_diag_step(
    cfg: dict[str, int], args: tuple[Any, ...], NC: int, H: int, K: int, BK: int, norm: bool, gate_kind: int
) -> None:
    """The fused kernel inside the shipped launcher (``chunk.PrepStep``)."""
    if cfg["fused_split"] and cfg["fused_mid"]:
        raise ValueError("fused_split and fused_mid exclude each other (the midpoint dots need 16-row tiles)")
    bkp = cfg["fused_bkp"]
    if bkp < 16 or bkp & (bkp - 1):
        raise ValueError(f"fused_bkp must be a power of two >= 16, got {bkp}")
    _prep_diag_kernel[(NC, H)](
        *args, H=H, K=K, BT=BT, BC=BC, BKP=min(bkp, BK), BKS=min(cfg["prep_bk"], BK), NORM=norm, GATE=gate_kind,
        SPLIT=bool(cfg["fused_split"]), MID=bool(cfg["fused_mid"]), IEEE=bool(cfg["diag_ieee"]),
        SPAN_MAX=shipped.SPAN_MAX, num_warps=cfg["fused_warps"],
    )


def chunk_kda_triton(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """As the shipped ``chunk_kda_triton`` (same arguments, shapes, checks and results), with v7's fused prep and
    diagonal step; ``tune`` also takes its keys (:data:`DEFAULTS`)."""
    return shipped.chunk_kda_triton(*args, _prep=_prep_diag_step, _defaults=DEFAULTS, **kwargs)
