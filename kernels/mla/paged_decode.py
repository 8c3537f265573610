"""MLA decode over a paged latent cache in Triton, kv_b_proj absorbed (flash-decoding).

Every program takes one sequence's split of the context and all H heads, so each cached row [r + dr] is read
once and serves every head (the cache is shared by the heads, like MQA); a second launch merges the splits. The
number of splits comes from the page table's capacity, not from ``seq_lens``, so there is no host sync (CUDA-graph
safe). Two forms (``_default_form`` picks "tokens"; "heads" is kept to force, for comparison):

- ``"tokens"``: tokens on the rows of both products (scores^T = c q^T [BN, BH], acc^T += c^T p^T
  [r, BH]); each split stores its output already normalised, in q's dtype (float32 for float32 q), plus one
  base-2 log-sum-exp per head, and the merge reads them in one pass. Splits past a sequence's end store 0 and
  a log-sum-exp of -1e30, which the merge weighs 0.
- ``"heads"``: heads on the rows (scores = q c^T [BH, BN]); float32 partials (unnormalised latent sum,
  running max, running denominator).

On an sm_90 GPU the "tokens" split kernel is the Gluon one of paged_decode_gluon.py wherever it applies (bf16,
r 512, dr 64, P % 64 == 0): it keeps the next tile's copy in flight while a tile is computed, which this Triton
kernel cannot (1 x 1M 283.8 us against 439.2 on the H200). ``use_gluon=False`` forces the Triton kernel, which CI
tests under the interpreter and which serves every other shape. There the split kernel and the merge are
programmatic dependent launches (``pdl``, on by default): each waits in the kernel for its predecessor's writes,
so neither pays a launch gap (1 x 32K 20.7 against 21.6 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # programmatic dependent launch (Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

from .paged_decode_gluon import gluon_split_ok, launch_split_gluon

_LOG2E = 1.4426950408889634
FORMS = ("heads", "tokens")


@triton.jit
def _split_setup(q_lat, q_pe, seq_lens, s, n, hb, tokens_per_split, H: tl.constexpr, R: tl.constexpr,
                 DR: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr):
    """A split program's token range [start, end) of sequence n, its head block (rh, mask mh), the r and dr
    ranges, and q's latent [BH, BR] and rope [BH, BDR] parts for those heads."""
    L = tl.load(seq_lens + n)
    start = s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, L)
    rh = hb * BH + tl.arange(0, BH)
    rr = tl.arange(0, BR)
    rd = tl.arange(0, BDR)
    mh = rh < H
    ql = tl.load(q_lat + (n * H + rh[:, None]) * R + rr[None, :], mask=mh[:, None] & (rr[None, :] < R), other=0.0)
    qp = tl.load(q_pe + (n * H + rh[:, None]) * DR + rd[None, :], mask=mh[:, None] & (rd[None, :] < DR), other=0.0)
    return start, end, rh, rr, rd, mh, ql, qp


# the page-table width, the split length and the split count vary with the context: not specialised, so one
# compiled kernel serves every context (eager decode would otherwise compile again every few hundred tokens)
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel(
    q_lat, q_pe, kv, page_table, seq_lens, acc_out, m_out, l_out, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr,
):
    s = tl.program_id(0)
    n = tl.program_id(1)
    hb = tl.program_id(2)
    start, end, rh, rr, rd, mh, ql, qp = _split_setup(q_lat, q_pe, seq_lens, s, n, hb, tokens_per_split,
                                                      H, R, DR, BH, BR, BDR)
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    pt = page_table + n.to(tl.int64) * max_pages
    for t0 in range(start, end, BN):
        tok = t0 + tl.arange(0, BN)
        mt = tok < end
        page = tl.load(pt + tok // P, mask=mt, other=0).to(tl.int64)
        # [BN] offset of each token's cache row; the hint lets the loads be 16-byte vectors
        row = tl.multiple_of((page * P + tok % P) * (R + DR), ALIGN)
        c = tl.load(kv + row[:, None] + rr[None, :], mask=mt[:, None] & (rr[None, :] < R), other=0.0)
        pe = tl.load(kv + row[:, None] + R + rd[None, :], mask=mt[:, None] & (rd[None, :] < DR), other=0.0)
        sc = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(pe))  # [BH, BN]
        sc = tl.where(mt[None, :], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp2(sc - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    base = (n * NSPLIT + s) * H + rh
    tl.store(m_out + base, m_i, mask=mh)
    tl.store(l_out + base, l_i, mask=mh)
    tl.store(acc_out + base[:, None].to(tl.int64) * R + rr[None, :], acc, mask=mh[:, None] & (rr[None, :] < R))


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


# the split kernel of the "tokens" form: as _split_kernel, with the products transposed and normalised partials
@triton.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
def _split_kernel_tokens(
    q_lat, q_pe, kv, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split, NSPLIT,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, P: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr, ALIGN: tl.constexpr,
    PAGE_TILE: tl.constexpr,
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
    # PAGE_TILE: each tile's page id is loaded one iteration ahead and carried, so the tile's copy does not wait
    # on a page-table load of its own iteration (1 x 1M 441 us against 465)
    page_nx = tl.load(pt + tl.minimum(start // P, max_pages - 1), mask=start < end, other=0)
    for t0 in range(start, end, BN):
        tok = t0 + tl.arange(0, BN)
        mt = tok < end
        # page ids masked and clamped to the sequence's row: no copy of these loads that the pipeliner issues
        # ahead can address past the table
        if PAGE_TILE:  # BN divides P and every tile starts at a multiple of BN: the tile lies in one page
            page = page_nx.to(tl.int64)
            page_nx = tl.load(pt + tl.minimum((t0 + BN) // P, max_pages - 1), mask=t0 + BN < end, other=0)
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


COMBINE_EARLY_TRIGGER = True
"""The PDL merge lets its next launch (MLA's W_uv matvec) start before it waits for the split kernel: with
``linear.matvec_triton.HEAD_ROWS`` = 4 (W_uv's programs all resident), W_uv's and o_proj's weights load while the
split kernel runs. Its figures: ``HEAD_ROWS``'s (the two are measured together, mode ``old-uv`` turns both off)."""


@triton.jit(do_not_specialize=["NSPLIT"])
def _combine_kernel_lse(
    o_part, lse_part, out, NSPLIT, H: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr,
    PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr = False, lse_out=None, LSE_OUT: tl.constexpr = False,
):
    """One pass over the splits with a running max: out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m). Empty
    splits (lse -1e30, o 0) weigh 2^(-1e30 - m) = 0 beside any split with a token; masked lanes load -3e38.
    ``PDL``: launched as a programmatic dependent launch behind the split kernel, so it waits for the split kernel's
    writes before it reads them (sm_90; never under the interpreter). With EARLY_TRIGGER it lets the next launch
    start before its own wait (the next, W_uv's PDL matvec, reads only its weight before its wait), so W_uv's and
    then o_proj's weights can stream while the split kernel runs. ``LSE_OUT``: also the merged base-2 log-sum-exp
    of each (sequence, head) into ``lse_out`` [N, H] float32 (by the programs of the first r block)."""
    if PDL:
        if EARLY_TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY_TRIGGER:
            gdc_launch_dependents()
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
    if LSE_OUT:
        first = tl.arange(0, 1) + tl.program_id(2) == 0
        tl.store(lse_out + n * H + h + tl.arange(0, 1), m_run + tl.log2(den), mask=first)


def _pdl_launch(pdl: bool) -> dict:
    """The launch option of a programmatic dependent launch, passed only when asked for: a Triton release without
    ``launch_pdl`` rejects unknown launch options, even a False one."""
    return {"launch_pdl": True} if pdl else {}


def _num_splits(N: int, capacity: int, sm_count: int) -> int:
    """(sequence, split) programs for two waves of the GPU (eight from 8 sequences up), each split at least 256
    tokens of capacity. Measured on the H200 (graph replays, `bench/kernels.py --only mlasplits`):
    1 x 32K best at 128 splits (39.9-41.8 us, against 51 us at 64 with 512-token splits),
    1 x 128K and 1 x 1M at about two waves (95.7 / 498 us; more splits were slower), 32 x 32K at 36 splits
    (551 us, against 651 at 9)."""
    waves = 8 if N >= 8 else 2
    return max(1, min(triton.cdiv(waves * sm_count, max(N, 1)), triton.cdiv(capacity, 256)))


def _num_splits_tokens(N: int, capacity: int, sm_count: int, many_waves: int = 8) -> int:
    """The "tokens" form: (sequence, split) programs for one wave of the GPU below 8 sequences and ``many_waves``
    from 8 up, each split at least 256 tokens of capacity. Measured on the H200 (graph replays,
    `bench/kernels.py --only mlasplits`), Triton kernel: one sequence of 32K / 128K / 1M at 128 / 132 / 132 splits 31.2 / 73.7 /
    463.7 us, against 31.2 / 83.7 / 474.7 at two waves (128 / 264 / 264) and 58.4 / 104.7 / 492.2 at 528; 32 x
    32K at 36 splits (eight waves) 512.7 us, against 597.5 at 9 (two waves). The Gluon kernel keeps one
    wave below 8 sequences (1 x 32K / 128K 24.3 / 51.5 us at 128 / 132 splits, 25.4 / 57.2 at 96) and wants
    long splits from 8 up (32 x 32K 297.7 us at 8 splits, two waves; 323.7 at 16, 351-382 at 17 and 32, and 382.2
    at 9, where 288 programs leave a third wave of 24). The count is rounded down so the programs fill whole waves
    (at most ``waves`` x SMs)."""
    waves = many_waves if N >= 8 else 1
    return max(1, min(waves * sm_count // max(N, 1), triton.cdiv(capacity, 256)))


def _default_form(N: int) -> str:
    """The "tokens" form at every N (on the H200, with the split counts above: 1 x 32K / 128K / 1M
    31.2 / 73.7 / 463.7 us against 44.8 / 107.4 / 580.3 for "heads", and 32 x 32K 512.7 against 595.4). "heads"
    stays as a form to force (``form="heads"``): its float32 partials are exact to 4e-4 where the "tokens"
    form's bf16 partials give 1.8e-3 against the float32 twin."""
    del N
    return "tokens"


def _launch(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None, BN: int | None = None, BH: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, form: str | None = None, use_gluon: bool | None = None, pdl: bool | None = None,
    lse_out: Tensor | None = None,
) -> Tensor:
    """q_lat [N, H, r], q_pe [N, H, dr], kv_pages [num_pages, P, r + dr] (contiguous) -> [N, H, r]. ``form``
    (one of FORMS) overrides ``_default_form(N)``. Tiles, warps and stages default per form, as measured on the
    H200: "heads" BN 64, 4 warps, 3 stages; "tokens" BN 64, 4 warps, 2 stages at every split length
    (1 x 32K / 128K / 1M 31.5 / 84.2 / 470.4 us, against 34.5 / 89.5 / 523.4 with
    BN 64, 8 warps, 2 stages below 384 tokens per split and BN 32, 4 warps, 3 stages above). ``use_gluon`` and
    ``pdl`` (None: wherever they apply) force the Gluon split kernel and programmatic dependent launch on or off;
    forcing either on where it cannot apply raises ValueError. ``lse_out`` [N, H] float32 ("tokens" form only):
    also receives each head's base-2 log-sum-exp of its scaled scores (for a caller that merges other keys in)."""
    N, H, R = q_lat.shape
    if form is None:
        form = _default_form(N)
    elif form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if lse_out is not None and (form != "tokens" or tuple(lse_out.shape) != (N, H) or lse_out.dtype != torch.float32):
        raise ValueError(f"lse_out needs the \"tokens\" form and [N, H]={N, H} float32, got form={form!r}, "
                         f"{tuple(lse_out.shape)} {lse_out.dtype}")
    DR = q_pe.shape[-1]
    P = kv_pages.shape[1]
    max_pages = page_table.shape[1]
    out = torch.empty_like(q_lat)
    if N == 0:
        return out
    tokens = form == "tokens"
    BH = BH or max(16, triton.next_power_of_2(H))
    # the Gluon split kernel wherever it applies, unless the caller tunes the Triton kernel (tiles, warps, stages)
    gluon = (tokens and use_gluon is not False and BN in (None, 64) and num_warps is None and num_stages is None
             and gluon_split_ok(q_lat, kv_pages, R, DR, P, 64, BH))
    if use_gluon and not gluon:
        raise ValueError("use_gluon=True needs the \"tokens\" form on an sm_90 GPU with bf16, r 512, dr 64, "
                         f"P % 64 == 0 and default tiles; got form={form!r}, r={R}, dr={DR}, P={P}, "
                         f"dtype={q_lat.dtype}, device={q_lat.device}")
    # programmatic dependent launch: the Gluon split kernel and the merge are launched before their predecessor
    # ends and wait for its writes in the kernel, so a graph or stream runs them without a launch gap
    if pdl is None:
        pdl = gluon and gdc_wait is not None
    elif pdl and not (gluon and gdc_wait is not None):
        raise ValueError("pdl=True needs the Gluon split kernel (sm_90) and a Triton with griddepcontrol (3.3+)")
    if num_splits is None:
        sm = torch.cuda.get_device_properties(q_lat.device).multi_processor_count if q_lat.is_cuda else 4
        if tokens:
            num_splits = _num_splits_tokens(N, max_pages * P, sm, many_waves=2 if gluon else 8)
        else:
            num_splits = _num_splits(N, max_pages * P, sm)
    BN = BN or 64
    tps = triton.cdiv(triton.cdiv(max_pages * P, num_splits), BN) * BN
    num_splits = triton.cdiv(max_pages * P, tps)
    BR = triton.next_power_of_2(R)
    BDR = max(16, triton.next_power_of_2(DR))
    align = 1
    while align < 8 and (R + DR) % (2 * align) == 0:
        align *= 2
    BRC = min(BR, 64)  # the merge runs over r blocks too: H * N programs alone are too few for one sequence
    if tokens:
        half = q_lat.dtype in (torch.bfloat16, torch.float16)  # half the partials' traffic; float32 stays exact
        o_part = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=q_lat.dtype if half else torch.float32)
        lse = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
        if gluon:
            launch_split_gluon(q_lat, q_pe, kv_pages, page_table, seq_lens, o_part, lse, scale * _LOG2E, tps, BH,
                               pdl=pdl)
        else:
            _split_kernel_tokens[(triton.cdiv(H, BH), num_splits, N)](
                q_lat, q_pe, kv_pages, page_table, seq_lens, o_part, lse, scale * _LOG2E, max_pages, tps,
                num_splits, H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=BDR, BN=BN, ALIGN=align, PAGE_TILE=P % BN == 0,
                num_warps=num_warps or 4, num_stages=num_stages or 2,
            )
        # below 8 sequences the merge reads every split in one pass on 4 warps (1 x 32K: 3.4 us against 6.2 for 16
        # splits a step on 2 warps); from 8 up there are programs enough, and the
        # wider pass lost (32 x 32K 483 us against 469-472)
        one_pass = N < 8
        bs = min(256, max(16, triton.next_power_of_2(num_splits))) if one_pass else 16
        _combine_kernel_lse[(H, N, triton.cdiv(R, BRC))](o_part, lse, out, num_splits, H=H, R=R, BR=BRC, BS=bs,
                                                         PDL=pdl, EARLY_TRIGGER=COMBINE_EARLY_TRIGGER,
                                                         lse_out=lse_out, LSE_OUT=lse_out is not None,
                                                         num_warps=4 if one_pass else 2, **_pdl_launch(pdl))
        return out
    acc = torch.empty(N, num_splits, H, R, device=q_lat.device, dtype=torch.float32)
    m = torch.empty(N, num_splits, H, device=q_lat.device, dtype=torch.float32)
    lsum = torch.empty_like(m)
    _split_kernel[(num_splits, N, triton.cdiv(H, BH))](
        q_lat, q_pe, kv_pages, page_table, seq_lens, acc, m, lsum, scale * _LOG2E, max_pages, tps, num_splits,
        H=H, R=R, DR=DR, P=P, BH=BH, BR=BR, BDR=BDR, BN=BN,
        ALIGN=align, num_warps=num_warps or 4, num_stages=num_stages or 3,
    )
    _combine_kernel[(H, N, triton.cdiv(R, BRC))](acc, m, lsum, out, num_splits, H=H, R=R, BR=BRC, BS=16,
                                                 num_warps=2)
    return out


def mla_decode_paged_triton(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, scale: float,
    num_splits: int | None = None, form: str | None = None,
) -> Tensor:
    """One query per sequence over its paged latent cache (kv_b_proj absorbed).

    q_lat [N, H, r] (q_nope @ W_uk per head), q_pe [N, H, dr], kv_pages [num_pages, P, r + dr] in q's dtype,
    page_table [N, max_pages] int32, seq_lens [N] int (>= 1, the new token included). Returns the
    attention-weighted latent [N, H, r] in q_lat's dtype. ``num_splits`` overrides the split heuristic, ``form``
    ("heads" or "tokens", see the module docstring; anything else raises ValueError in ``_launch``) the choice
    by N.
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
        seq_lens.contiguous(), float(scale), num_splits, form=form,
    )
