"""MLA paged decode, candidate v5: the shipped "tokens" form with a leaner split kernel (bench/candidates/README.md).

The shipped split kernel (``kernels/mla/paged_decode.py``, ``_split_kernel_tokens``) is issue-bound on the H200
(one block of 4 warps per SM, each warp eligible 22% of cycles at 1M tokens), so v5 removes instructions from
its per-tile loop; the launcher, the merge (``_combine_kernel_lse``), the split counts and every default are the
shipped ones, imported from that module. Two changes, both in the split kernel:

- Lazy rescaling (FlashAttention-4): the running max m_i stays put until some head's tile max exceeds it by more
  than ``TAU`` (log2 units; launch knob, default 8.0, a factor 256); only then are acc^T [r, BH] and l_i
  rescaled, behind one scalar branch. Otherwise a tile costs no alpha and no [r, BH] multiply. p = 2^(s - m_i)
  may reach 2^TAU, which float32 sums and the bf16 / float16 operand of the second product hold (float16 up to
  TAU 15); the stored output (acc / l) and log-sum-exp (m_i + log2 l_i) stay exact.
- Full tiles without masks: the loop runs over the tiles that lie wholly inside the split's [start, end), with
  unmasked cache loads and no ``tl.where`` on the scores; the one partial tile a split can end with (only the
  split holding the sequence's end has one) runs after the loop, masked as in the shipped kernel.

Safety as shipped: page ids masked and clamped to the sequence's table row, no cache row at or past a sequence's
end read, and a split past the end stores a zero output and log-sum-exp -1e30 (weight 0 in the merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .paged_decode import _LOG2E, _combine_kernel_lse, _num_splits_tokens, _split_setup

TAU_DEFAULT = 8.0
TAU_MAX_HALF = 15.0  # p <= 2^TAU goes through float16 for a float16 cache (largest finite 65504 < 2^16)


@triton.jit
def _tile(
    kv, pt, t0, end, max_pages, rr, rd, qlt, qpt, m_i, l_i, acc, sm_scale,
    R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr,
    ALIGN: tl.constexpr, PAGE_TILE: tl.constexpr, TAU: tl.constexpr, MASKED: tl.constexpr,
):
    """One tile of BN tokens from t0: (m_i, l_i, acc^T) updated. MASKED: the tile may run past ``end``."""
    tok = t0 + tl.arange(0, BN)
    mt = tok < end
    # page ids masked and clamped to the sequence's row: no copy of these loads that the pipeliner issues ahead
    # can address past the table
    if PAGE_TILE:  # BN divides P and every tile starts at a multiple of BN: the tile lies in one page
        page = tl.load(pt + tl.minimum(t0 // P, max_pages - 1), mask=t0 < end, other=0).to(tl.int64)
        row = (page * P + t0 % P + tl.arange(0, BN)) * (R + DR)
    else:
        page = tl.load(pt + tl.minimum(tok // P, max_pages - 1), mask=mt, other=0).to(tl.int64)
        row = (page * P + tok % P) * (R + DR)
    row = tl.multiple_of(row, ALIGN)  # [BN] cache-row offsets: 16-byte vectors
    c_ptr = kv + row[:, None] + rr[None, :]
    pe_ptr = kv + row[:, None] + R + rd[None, :]
    if MASKED:
        c = tl.load(c_ptr, mask=mt[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(pe_ptr, mask=mt[:, None] & (rd[None, :] < DR), other=0.0)
    else:  # every row is inside the sequence; columns masked only where the widths are not powers of two
        if BR == R:
            c = tl.load(c_ptr)
        else:
            c = tl.load(c_ptr, mask=rr[None, :] < R, other=0.0)
        if BDR == DR:
            pe = tl.load(pe_ptr)
        else:
            pe = tl.load(pe_ptr, mask=rd[None, :] < DR, other=0.0)
    sc = (tl.dot(c, qlt) + tl.dot(pe, qpt)) * sm_scale  # [BN, BH]; sm_scale includes log2(e)
    if MASKED:
        sc = tl.where(mt[:, None], sc, float("-inf"))
    m_t = tl.max(sc, axis=0)  # [BH]; finite: a tile holds at least one token
    # rescale only when some head's max grew by more than TAU (the first tile always: m_i starts at -1e30)
    if TAU < 0:  # no branch: rescale every tile, as the shipped kernel (isolates the unmasked full tiles)
        m_new = tl.maximum(m_i, m_t)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[None, :]
        m_i = m_new
    elif tl.max(m_t - m_i, axis=0) > TAU:
        m_new = tl.maximum(m_i, m_t)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[None, :]
        m_i = m_new
    p = tl.exp2(sc - m_i[None, :])  # <= 2^TAU
    l_i += tl.sum(p, axis=0)
    acc = tl.dot(tl.trans(c), p.to(c.dtype), acc)
    return m_i, l_i, acc


# the page-table width, the split length and the split count vary with the context: not specialised, so one
# compiled kernel serves every context
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel_tokens(
    q_lat, q_pe, kv, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr,
    PAGE_TILE: tl.constexpr, TAU: tl.constexpr,
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
    # start is a multiple of BN (tokens_per_split is): tiles up to end_full are whole, at most one partial follows
    end_full = start + tl.maximum(end - start, 0) // BN * BN
    for t0 in range(start, end_full, BN):
        m_i, l_i, acc = _tile(kv, pt, t0, end, max_pages, rr, rd, qlt, qpt, m_i, l_i, acc, sm_scale,
                              R, DR, P, BR, BDR, BN, ALIGN, PAGE_TILE, TAU, False)
    if end_full < end:
        m_i, l_i, acc = _tile(kv, pt, end_full, end, max_pages, rr, rd, qlt, qpt, m_i, l_i, acc, sm_scale,
                              R, DR, P, BR, BDR, BN, ALIGN, PAGE_TILE, TAU, True)
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
    num_stages: int | None = None, form: str | None = None, **extra: float,
) -> Tensor:
    """The shipped ``_launch`` of ``kernels/mla/paged_decode.py`` with ``form="tokens"``: q_lat [N, H, r], q_pe
    [N, H, dr], kv_pages [num_pages, P, r + dr] (contiguous), page_table [N, max_pages] int32, seq_lens [N] ->
    [N, H, r] in q_lat's dtype. Same split counts and defaults (BN 64, 4 warps, 2 stages); ``form`` may be None
    or "tokens" only. ``extra``: ``TAU`` (default 8.0), the growth of a head's max (log2 units) that triggers a
    rescale; 0 rescales at every increase, as the shipped kernel does."""
    if form not in (None, "tokens"):
        raise ValueError(f"form must be 'tokens' or None (v5 has only the tokens form), got {form!r}")
    tau = float(extra.pop("TAU", TAU_DEFAULT))
    if extra:
        raise TypeError(f"unknown launch parameters {sorted(extra)}; v5 takes TAU besides the shipped ones")
    tau_max = TAU_MAX_HALF if q_lat.dtype == torch.float16 else 64.0  # float32 / bf16: far from 2^128
    if tau != -1.0 and not 0.0 <= tau <= tau_max:  # -1: rescale every tile without a branch
        raise ValueError(f"TAU must be in [0, {tau_max}] for {q_lat.dtype} (p reaches 2^TAU), got {tau}")
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
    BRC = min(BR, 64)  # the merge runs over r blocks too: H * N programs alone are too few for one sequence
    half = q_lat.dtype in (torch.bfloat16, torch.float16)  # half the partials' traffic; float32 stays exact
    o_part = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=q_lat.dtype if half else torch.float32)
    lse = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
    _split_kernel_tokens[(triton.cdiv(H, BH), num_splits, N)](
        q_lat, q_pe, kv_pages, page_table, seq_lens, o_part, lse, scale * _LOG2E, max_pages, tps, num_splits,
        H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=BDR, BN=BN, ALIGN=align, PAGE_TILE=P % BN == 0, TAU=tau,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    _combine_kernel_lse[(H, N, triton.cdiv(R, BRC))](o_part, lse, out, num_splits, H=H, R=R, BR=BRC, BS=16,
                                                     num_warps=2)
    return out
