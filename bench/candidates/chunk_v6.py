"""Candidate chunk_kda v6: the shipped forward (kernels/kda/chunk.py, v5) with a cheaper diagonal step.

Everything but the diagonal blocks comes from the shipped module (``from . import chunk``: this file is loaded as a
module of ``kda_sessions.kernels.kda``, by bench/kernels.py ``--old`` and by tests/kernels/test_chunk_candidates.py).
The shipped ``_diag_kernel`` runs one program per (chunk, head, 16-token sub-chunk) and evaluates 2^(G_r - G_s) for
all 16 x 16 pairs (r, s) times K channels, though only s <= r are kept. v6 has two diagonal kernels instead:

- ``_diag_token_kernel`` (exact, any gate): one program per (chunk, row r, BH heads); it walks the keys s of r's
  sub-chunk up to r only, so 136 of the 256 pairs per sub-chunk (0.53x the exp2 and FMA work), with the q, k, G
  rows of r held in registers for the whole walk and one [BH, 16] store of each block row at the end.
- ``_diag_mid_kernel`` (tensor cores): per (chunk, head, sub-chunk), both factors through the midpoint m of the
  sub-chunk's cumulative decay, q_r 2^(G_r - m) and k_s 2^(m - G_s), then two [16, K] x [K, 16] dots: 2 x 16 x K
  exp2 instead of 16 x 16 x K. Safe where each factor stays inside float32's range, i.e. where the sub-chunk's
  span G_first - G_last (log2 units) is at most ``SPAN_MAX``. With the bounded gate fused (lower_bound lb) the span
  is at most 15 |lb| / ln 2 (108 at lb -5), so the launcher picks this kernel for it when that is within
  ``SPAN_MAX``; no check in the kernel. ``diag_span_check`` 1 also uses it for every other gate, with the span
  measured per sub-chunk and an exact column walk where it is too wide (steep decays stay exact).

Launch parameters beyond the shipped :data:`chunk.DEFAULTS` (``tune`` keys):

- ``tok_bh`` (4), ``tok_warps`` (4): heads per program and warps of the token-parallel kernel.
- ``diag_form`` (1): the exact diagonal kernel, 1 token-parallel, 0 the shipped sub-chunk kernel (for A/B).
- ``diag_mid`` (1): the bounded fused gate through ``_diag_mid_kernel``; 0 sends it to the exact kernel.
- ``diag_span_check`` (0): 1 sends every other gate through ``_diag_mid_kernel`` with its per-sub-chunk span check.
- ``diag_ieee`` (0): the midpoint kernel's dots in IEEE float32 rather than tf32.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from . import chunk as _shipped
from .chunk import BC, BT, _beta, _mm, _row, _rows, _store_rows

SPAN_MAX = 200.0  # widest sub-chunk decay span (log2 units) of the midpoint path: each factor within 2^100
DEFAULTS: dict[str, int] = {
    **_shipped.DEFAULTS,
    "tok_bh": 4, "tok_warps": 4, "diag_form": 1, "diag_mid": 1, "diag_span_check": 0, "diag_ieee": 0,
}


@triton.jit
def _diag_token_kernel(
    qn, kn, G2, beta, Aqk, Ld, chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
):
    """Row r of the diagonal blocks of A_qk (s <= r, times scale) and L (s < r, times beta_r; zeros from r on)
    for BH heads, exactly: only the keys s <= r of r's sub-chunk are visited."""
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
def _exact_blocks(qi, ki, Gi, kn, G2, bos, row0, n_rows, h, cols, H: tl.constexpr, K: tl.constexpr,
                  BC: tl.constexpr):
    """The same products exactly, one key column at a time (the shipped kernel's walk)."""
    rr = tl.arange(0, BC)
    A = tl.zeros([BC, BC], dtype=tl.float32)
    L = tl.zeros([BC, BC], dtype=tl.float32)
    for s in range(BC):
        k_s = _row(kn, bos, row0 + s, n_rows, h, cols, H, K)
        G_s = _row(G2, bos, row0 + s, n_rows, h, cols, H, K)
        e = tl.exp2(tl.minimum(Gi - G_s[None, :], 0.0)) * k_s[None, :]
        col = rr[None, :] == s
        A = tl.where(col, tl.sum(qi * e, axis=1)[:, None], A)
        L = tl.where(col, tl.sum(ki * e, axis=1)[:, None], L)
    return A, L


@triton.jit
def _diag_mid_kernel(
    qn, kn, G2, beta, Aqk, Ld, chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    CHECK_SPAN: tl.constexpr, SPAN_MAX: tl.constexpr, IEEE: tl.constexpr,
):
    """Diagonal block i of A_qk and L as in the shipped ``_diag_kernel``, on tensor cores: factored through the
    midpoint of the sub-chunk's decay range. CHECK_SPAN: measure that range and walk the key columns exactly
    where it exceeds SPAN_MAX (else the caller guarantees it does not)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    bos = tl.load(chunk_start + c).to(tl.int64)
    n_rows = tl.load(chunk_len + c)
    row0 = i * BC
    if row0 < n_rows:
        cols = tl.arange(0, BK)
        rr = tl.arange(0, BC)
        qi = _rows(qn, bos, row0, n_rows, h, cols, H, K, BC)
        ki = _rows(kn, bos, row0, n_rows, h, cols, H, K, BC)
        Gi = _rows(G2, bos, row0, n_rows, h, cols, H, K, BC)
        g_hi = _row(G2, bos, row0, n_rows, h, cols, H, K)  # G is non-increasing down the rows
        g_lo = _row(G2, bos, tl.minimum(row0 + BC, n_rows) - 1, n_rows, h, cols, H, K)
        if CHECK_SPAN:  # one uniform branch per program
            if tl.max(g_hi - g_lo, axis=0) <= SPAN_MAX:
                A, L = _mid_blocks(qi, ki, Gi, g_hi, g_lo, row0, n_rows, BC, IEEE)
            else:
                A, L = _exact_blocks(qi, ki, Gi, kn, G2, bos, row0, n_rows, h, cols, H, K, BC)
        else:
            A, L = _mid_blocks(qi, ki, Gi, g_hi, g_lo, row0, n_rows, BC, IEEE)
        b = _beta(beta, bos, row0, n_rows, h, H, BC)
        A = tl.where(rr[:, None] >= rr[None, :], A, 0.0) * scale  # above the diagonal the factors may overflow
        L = tl.where(rr[:, None] > rr[None, :], L, 0.0) * b[:, None]
        _store_rows(Aqk, A, bos, row0, n_rows, h, row0 + rr, H, BT, BC)
        _store_rows(Ld, L, bos, row0, n_rows, h, rr, H, BC, BC)


def _diag_step(cfg: dict[str, int], args: tuple[Any, ...], NC: int, H: int, K: int, BK: int, gate: Any) -> None:
    """v6's diagonal step inside the shipped launcher (``chunk.DiagStep``)."""
    lb = gate[2] if gate is not None else None
    # the fused bounded gate caps every step's log-decay at lb: a sub-chunk's span is at most 15 |lb| / ln 2
    bounded = lb is not None and 15 * abs(float(lb)) / 0.6931471805599453 <= SPAN_MAX
    if (bounded and cfg["diag_mid"]) or cfg["diag_span_check"]:
        _diag_mid_kernel[(NC, H, BT // BC)](
            *args, H=H, K=K, BT=BT, BC=BC, BK=BK, CHECK_SPAN=not (bounded and cfg["diag_mid"]),
            SPAN_MAX=SPAN_MAX, IEEE=bool(cfg["diag_ieee"]), num_warps=cfg["diag_warps"],
        )
    elif cfg["diag_form"] == 1:
        BH = min(cfg["tok_bh"], triton.next_power_of_2(H))
        _diag_token_kernel[(NC, BT, triton.cdiv(H, BH))](
            *args, H=H, K=K, BT=BT, BC=BC, BK=BK, BH=BH, num_warps=cfg["tok_warps"],
        )
    else:
        _shipped._diag_step(cfg, args, NC, H, K, BK, gate)


def chunk_kda_triton(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """As the shipped ``chunk_kda_triton`` (same arguments, shapes, checks and results), with v6's diagonal step;
    ``tune`` also takes the diagonal step's keys (:data:`DEFAULTS`)."""
    return _shipped.chunk_kda_triton(*args, _diag=_diag_step, _defaults=DEFAULTS, **kwargs)
