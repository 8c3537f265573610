"""The split kernel of MLA paged decode ("tokens" form) in Gluon, for Hopper (sm_90): CUDA only.

Same contract as ``_split_kernel_tokens`` in paged_decode.py (one program per head block, split and sequence;
normalised partials in q's dtype plus a base-2 log-sum-exp per head, merged by ``_combine_kernel_lse``). The
Triton kernel cannot keep a tile copy in flight while it computes: its pipeliner issues the next copy after the
current tile's products at 2 stages, and 3 stages of 72 KB tiles do not fit in shared memory. Here the order is
explicit, in a ring of two stages: the prologue's loads (seq_lens, three page ids, q) go out together, then both
stages' TMA copies, then q is staged; each iteration waits for its tile, runs its products and refills the stage
it freed with the tile two ahead (1 x 32K / 128K / 1M 20.7 / 47.9 / 283.8 us, 43 / 74 / 100% of the copy
bandwidth, against 28.1 / 67.6 / 439.2 us for the Triton kernel on the H200). A tile is two
TMA copies: its latent part as one [8, BN, 64] box of a strided 3-d view [8, rows, 64] of the cache (box b of row
t at t * 576 + b * 64, so each 64-column box lands as its own [BN, 64] tile with the 128-byte swizzle that wgmma
reads), and its rope part as one [BN, 64] box. Launched as a programmatic dependent launch (``pdl``), it waits
for the kernel before it (griddepcontrol.wait) before it reads anything, and lets the merge launch at once.

Gluon kernels do not run under ``TRITON_INTERPRET=1``: CI compiles this one for sm_90 (no GPU needed) and tests
the Triton kernel against the twin; this one is checked against the same twin on the device
(tests/kernels/test_mla_gluon.py, a gpu test), where it is bitwise equal to the Triton
kernel. Served shapes (``gluon_split_ok``): bf16, r 512, dr 64, tiles of 64 rows within a page (P % 64 == 0),
head blocks of 16-64. Blocks of 64 query rows (the absorbed prefill's tokens x heads) go to
``_split_kernel_gluon_qm`` (``QUERIES_ON_M``): the same tiles and ring with the queries on wgmma's M, within
bf16 rounding of the others (its products sum in another order).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

try:  # Gluon (triton.experimental) is absent from older Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load is async_load in newer Triton (3.9; async_copy_global_to_shared raises there), the old name in 3.6
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # the CTA barrier: gl.barrier in newer Triton (3.9), gl.thread_barrier in 3.6
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    # a shared-memory view under another shape and layout: reinterpret in newer Triton (3.9), _reinterpret in 3.6
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def _g_grid_dep_wait():
        """Programmatic dependent launch (sm_90): wait until the grids this one depends on have finished and their
        writes are visible, then let the next grid (the merge) launch. A no-op without ``launch_pdl``."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
except (ImportError, AttributeError):  # a Triton without Gluon: the Triton kernel serves every call
    gluon = None

if gluon is not None:

    @gluon.jit
    def _g_issue(desc, pe_desc, bar, buf, pe_buf, stage, row, pred, NB: gl.constexpr, BN: gl.constexpr):
        """One tile into ring stage ``stage``, on its barrier: one TMA copy of a [8, BN, 64] box of the 3-d view
        [8, rows, 64] of the latent part into buf[8 stage : 8 stage + 8] (seen as [2, 8, BN, 64] with the 3-d
        layout, which puts the same bytes where the 2-d boxes expect them), one [BN, 64] of the rope part into
        pe_buf[stage]. Two copies where nine 2-d ones took a CTA barrier each (split kernel 17.5 against 18.0 us
        at 1 x 32K)."""
        mbarrier.expect(bar.index(stage), NB * BN * 64 * 2, pred=pred)
        box3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        if _NEW_REINTERPRET:
            b4 = buf.reinterpret(gl.bfloat16, [2, NB - 1, BN, 64], box3)
        else:
            b4 = buf._reinterpret(gl.bfloat16, [2, NB - 1, BN, 64], box3)
        _tma_load(desc, [0, row, 0], bar.index(stage), b4.index(stage), pred=pred)
        _tma_load(pe_desc, [row, (NB - 1) * 64], bar.index(stage), pe_buf.index(stage), pred=pred)

    @gluon.jit
    def _g_first_pages(pt, start, max_pages, P: gl.constexpr, BN: gl.constexpr):
        """The page ids of a split's first three tiles from its sequence's table row ``pt``, clamped to the row
        (always in bounds; unused where a tile lies past the split)."""
        page0 = gl.load(pt + gl.minimum(start // P, max_pages - 1))
        page1 = gl.load(pt + gl.minimum((start + BN) // P, max_pages - 1))
        page2 = gl.load(pt + gl.minimum((start + 2 * BN) // P, max_pages - 1))
        return page0, page1, page2

    @gluon.jit
    def _g_q_boxes(q_lat, q_pe, n, row0, H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, BH: gl.constexpr,
                   ld: gl.constexpr):
        """Query rows row0 .. row0 + BH of sequence n as nine [BH, 64] boxes in layout ``ld``: eight of q_lat's
        512 columns, then q_pe (rows past H zero). Requested together, before the tiles' copies (behind a tile's
        72 KB their loads took 4.3 us)."""
        rh_l = row0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
        rc_l = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        q_ptr = q_lat + (n * H + rh_l[:, None]) * R + rc_l[None, :]
        mh_l = (rh_l < H)[:, None]
        q0 = gl.load(q_ptr + 0 * 64, mask=mh_l, other=0.0)
        q1 = gl.load(q_ptr + 1 * 64, mask=mh_l, other=0.0)
        q2 = gl.load(q_ptr + 2 * 64, mask=mh_l, other=0.0)
        q3 = gl.load(q_ptr + 3 * 64, mask=mh_l, other=0.0)
        q4 = gl.load(q_ptr + 4 * 64, mask=mh_l, other=0.0)
        q5 = gl.load(q_ptr + 5 * 64, mask=mh_l, other=0.0)
        q6 = gl.load(q_ptr + 6 * 64, mask=mh_l, other=0.0)
        q7 = gl.load(q_ptr + 7 * 64, mask=mh_l, other=0.0)
        q8 = gl.load(q_pe + (n * H + rh_l[:, None]) * DR + rc_l[None, :], mask=mh_l, other=0.0)
        return q0, q1, q2, q3, q4, q5, q6, q7, q8

    @gluon.jit
    def _g_stage_q(q_smem, q0, q1, q2, q3, q4, q5, q6, q7, q8):
        """The nine boxes of ``_g_q_boxes`` into q_smem [9, BH, 64], fenced for wgmma's async reads and seen by
        every warp (a CTA barrier) before it returns."""
        q_smem.index(0).store(q0)
        q_smem.index(1).store(q1)
        q_smem.index(2).store(q2)
        q_smem.index(3).store(q3)
        q_smem.index(4).store(q4)
        q_smem.index(5).store(q5)
        q_smem.index(6).store(q6)
        q_smem.index(7).store(q7)
        q_smem.index(8).store(q8)
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _g_refill(kv_desc, pe_desc, bar, buf, pe_buf, st, page, pt, t2, end, pred, max_pages, P: gl.constexpr,
                  NB: gl.constexpr, BN: gl.constexpr):
        """The tile at row t2 of the sequence (in ``page``) into ring stage ``st`` where ``pred``; returns the page
        id of the tile after it (0 past ``end``), for the next refill."""
        _g_issue(kv_desc, pe_desc, bar, buf, pe_buf, st, page * P + t2 % P, pred, NB, BN)
        return gl.load(pt + gl.minimum((t2 + BN) // P, max_pages - 1), mask=t2 + BN < end, other=0)

    @gluon.jit
    def _g_finish(bar, l_i, m_i):
        """After the tile loop: the ring's barriers invalidated; (l, or 1 where it is 0; each row's base-2
        log-sum-exp). A split past the sequence's end (l = 0) stores a zero output and log-sum-exp -1e30: weight
        0 in the merge."""
        mbarrier.invalidate(bar.index(0))
        mbarrier.invalidate(bar.index(1))
        nonempty = l_i > 0.0
        l_safe = gl.where(nonempty, l_i, 1.0)
        return l_safe, gl.where(nonempty, m_i + gl.log2(l_safe), -1.0e30)

    @gluon.jit
    def _g_pv(buf, j, p_smem, acc):
        """acc^T chunk [64 r, BH] += c_j^T [64 r, BN] p [BN, BH], c_j^T a transposed view of box j (wgmma reads
        it from shared memory; loading it into registers first was slower, 531 against 301 us at 1M)."""
        return warpgroup_mma(buf.index(j).permute((1, 0)), p_smem, acc, is_async=True)

    @gluon.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
    def _split_kernel_gluon(
        q_lat, q_pe, kv_desc, pe_desc, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split,
        NSPLIT, H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, P: gl.constexpr, BH: gl.constexpr,
        BN: gl.constexpr, PDL: gl.constexpr, WG: gl.constexpr = 1,
    ):
        gl.static_assert(R == 512)
        gl.static_assert(DR == 64)
        NB: gl.constexpr = 9  # boxes per tile: 8 of the latent, 1 of the rope part
        hb = gl.program_id(0)
        s = gl.program_id(1)
        n = gl.program_id(2)

        # WG warpgroups split the head block: each runs the products of its BH / WG heads on every tile, so a tile
        # copied once serves BH heads at the registers of BH / WG (see ``warpgroups``)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BH // WG, 16])
        box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BH * 2 if BH * 2 < 128 else 128,
                                                  element_bitwidth=16, rank=2)
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[4 * WG, 1], order=[1, 0])
        buf = gl.allocate_shared_memory(gl.bfloat16, [2 * (NB - 1), BN, 64], box)
        pe_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], box)
        bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
        mbarrier.init(bar.index(1), count=1)
        start = s * tokens_per_split
        pt = page_table + n.to(gl.int64) * max_pages
        if PDL:  # launched early, behind the kernel that writes q or the cache: nothing is read before this
            # (copying the first two tiles before the wait where they lie wholly before the newest cache row, the
            # only one the prep kernel writes: no faster, 2.438 ms a 1 x 128K step against 2.431, H200, 2026-12-05)
            _g_grid_dep_wait()
        # the loads of the prologue go out together, none waiting on another: seq_lens, the first three tiles'
        # page ids, then q [BH, 576] as NB boxes [BH, 64] (the B operand, q_k^T K-major, of the score product)
        L = gl.load(seq_lens + n)
        page0, page1, page_nx = _g_first_pages(pt, start, max_pages, P, BN)
        q0, q1, q2, q3, q4, q5, q6, q7, q8 = _g_q_boxes(q_lat, q_pe, n, hb * BH, H, R, DR, BH, ld)

        # the first two tiles' copies, each predicated off where its tile lies past the split
        end = gl.minimum(start + tokens_per_split, L)
        _g_issue(kv_desc, pe_desc, bar, buf, pe_buf, 0, page0 * P + start % P, start < end, NB, BN)
        _g_issue(kv_desc, pe_desc, bar, buf, pe_buf, 1, page1 * P + (start + BN) % P, start + BN < end, NB, BN)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NB, BH, 64], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH], pbox)
        _g_stage_q(q_smem, q0, q1, q2, q3, q4, q5, q6, q7, q8)

        m_i = gl.full([BH], -1e30, gl.float32, layout=gl.SliceLayout(0, mma))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(0, mma))
        acc0 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc1 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc2 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc3 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc4 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc5 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc6 = gl.zeros([64, BH], gl.float32, layout=mma)
        acc7 = gl.zeros([64, BH], gl.float32, layout=mma)
        tok = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        ntiles = (gl.maximum(end - start, 0) + BN - 1) // BN
        for i in range(0, ntiles):
            st = i % 2
            t0 = start + i * BN
            mbarrier.wait(bar.index(st), (i // 2) & 1)
            b0 = st * (NB - 1)
            sc = warpgroup_mma(buf.index(b0), q_smem.index(0).permute((1, 0)),
                               gl.zeros([BN, BH], gl.float32, layout=mma), use_acc=False, is_async=True)
            for k in gl.static_range(1, NB - 1):
                sc = warpgroup_mma(buf.index(b0 + k), q_smem.index(k).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma(pe_buf.index(st), q_smem.index(NB - 1).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            sc = gl.where((t0 + tok < end)[:, None], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
            m_new = gl.maximum(m_i, gl.max(sc, axis=0))
            p = gl.exp2(sc - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            _cta_barrier()
            al = alpha[None, :]
            acc0 = _g_pv(buf, b0 + 0, p_smem, acc0 * al)
            acc1 = _g_pv(buf, b0 + 1, p_smem, acc1 * al)
            acc2 = _g_pv(buf, b0 + 2, p_smem, acc2 * al)
            acc3 = _g_pv(buf, b0 + 3, p_smem, acc3 * al)
            acc4 = _g_pv(buf, b0 + 4, p_smem, acc4 * al)
            acc5 = _g_pv(buf, b0 + 5, p_smem, acc5 * al)
            acc6 = _g_pv(buf, b0 + 6, p_smem, acc6 * al)
            acc7 = _g_pv(buf, b0 + 7, p_smem, acc7 * al)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7))
            _cta_barrier()  # every warp is past this tile's products before its stage is refilled
            # tile i + 2 into the stage just freed, and the page id of tile i + 3 for the next iteration
            t2 = t0 + 2 * BN
            page_nx = _g_refill(kv_desc, pe_desc, bar, buf, pe_buf, st, page_nx, pt, t2, end, t2 < end, max_pages, P,
                                NB, BN)
        l_safe, lse = _g_finish(bar, l_i, m_i)
        inv = (1.0 / l_safe)[None, :]
        rh = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, mma))
        base = (n * NSPLIT + s) * H + rh
        # the partials leave through a layout with 8 consecutive r per thread (16-byte stores): straight from the
        # wgmma layout they were 2-byte stores, 2.0 us of the program's time at any context
        st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                              warps_per_cta=[1, 4 * WG], order=[0, 1])
        rh_s = hb * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, st_l))
        rr_s = gl.arange(0, 64, layout=gl.SliceLayout(1, st_l))
        optr = o_part + ((n * NSPLIT + s) * H + rh_s)[None, :].to(gl.int64) * R + rr_s[:, None]
        om = (rh_s < H)[None, :] & (rr_s < 64)[:, None]
        dt = o_part.dtype.element_ty
        gl.store(optr + 0 * 64, gl.convert_layout((acc0 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 1 * 64, gl.convert_layout((acc1 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 2 * 64, gl.convert_layout((acc2 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 3 * 64, gl.convert_layout((acc3 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 4 * 64, gl.convert_layout((acc4 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 5 * 64, gl.convert_layout((acc5 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 6 * 64, gl.convert_layout((acc6 * inv).to(dt), st_l), mask=om)
        gl.store(optr + 7 * 64, gl.convert_layout((acc7 * inv).to(dt), st_l), mask=om)
        gl.store(lse_part + base, lse, mask=rh < H)


    @gluon.jit
    def _g_scores(q_smem, buf, pe_buf, b0, st, zero, NB: gl.constexpr):
        """S [BM query rows, BN cached rows] of a tile, queries on wgmma's M: q's nine boxes (A, shared memory)
        against the tile's boxes seen K-major (B); issued, not waited for."""
        sc = warpgroup_mma(q_smem.index(0), buf.index(b0).permute((1, 0)), zero, use_acc=False, is_async=True)
        for k in gl.static_range(1, NB - 1):
            sc = warpgroup_mma(q_smem.index(k), buf.index(b0 + k).permute((1, 0)), sc, is_async=True)
        return warpgroup_mma(q_smem.index(NB - 1), pe_buf.index(st).permute((1, 0)), sc, is_async=True)

    @gluon.jit
    def _g_softmax(sc, m_i, l_i, t0, kv, end, sm_scale):
        """Online softmax of one tile's scores (base 2, rows past ``end`` masked): (p, alpha, m, l)."""
        sc = gl.where((t0 + kv < end)[None, :], sc * sm_scale, float("-inf"))  # sm_scale includes log2(e)
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        p = gl.exp2(sc - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit(do_not_specialize=["max_pages", "tokens_per_split", "NSPLIT"])
    def _split_kernel_gluon_qm(
        q_lat, q_pe, kv_desc, pe_desc, page_table, seq_lens, o_part, lse_part, sm_scale, max_pages, tokens_per_split,
        NSPLIT, H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, P: gl.constexpr, BN: gl.constexpr,
        PDL: gl.constexpr, PIPE: gl.constexpr,
    ):
        """``_split_kernel_gluon``'s contract for blocks of 64 query rows with the queries on wgmma's M (FlashMLA's
        form; ``QUERIES_ON_M``), on two warpgroups: S = Q K^T [64, BN], each warpgroup the scores of half the
        tile's rows; O [64, 512] += P V with P from shared memory and the tile's latent boxes as one [BN, 512]
        operand, each warpgroup half of r (128 float32 registers a thread). A tile reads ~296 KB of shared memory
        against ~408 KB with the queries on N (both operands of every product from shared memory, N 32). ``PIPE``:
        the next tile's scores are issued before this tile's P V, and their softmax runs while it does (the
        tile after the last is copied and masked, so every copy issued is waited for); its P waits in registers
        for this P V to end (a second P buffer does not fit in shared memory)."""
        gl.static_assert(R == 512)
        gl.static_assert(DR == 64)
        NB: gl.constexpr = 9
        BM: gl.constexpr = 64
        hb = gl.program_id(0)
        s = gl.program_id(1)
        n = gl.program_id(2)
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BN // 2, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, R // 2, 16])
        box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[8, 1], order=[1, 0])
        buf = gl.allocate_shared_memory(gl.bfloat16, [2 * (NB - 1), BN, 64], box)
        pe_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 64], box)
        bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
        mbarrier.init(bar.index(1), count=1)
        # a stage's eight latent boxes as one [BN, 512] operand: a [BN, 512] tile under the 128-byte swizzle is
        # eight [BN, 64] boxes one after another, as the TMA copy lays them
        if _NEW_REINTERPRET:
            lat = buf.reinterpret(gl.bfloat16, [2, BN, R], box)
        else:
            lat = buf._reinterpret(gl.bfloat16, [2, BN, R], box)
        start = s * tokens_per_split
        pt = page_table + n.to(gl.int64) * max_pages
        if PDL:
            _g_grid_dep_wait()
        L = gl.load(seq_lens + n)
        page0, page1, page_nx = _g_first_pages(pt, start, max_pages, P, BN)
        q0, q1, q2, q3, q4, q5, q6, q7, q8 = _g_q_boxes(q_lat, q_pe, n, hb * BM, H, R, DR, BM, ld)

        end = gl.minimum(start + tokens_per_split, L)
        ntiles = (gl.maximum(end - start, 0) + BN - 1) // BN
        # copies: tiles 0 .. ntiles - 1, and with PIPE tile ntiles too (scores issued one tile ahead); none where
        # the split is empty
        last = ntiles if PIPE else ntiles - 1
        live = ntiles > 0
        _g_issue(kv_desc, pe_desc, bar, buf, pe_buf, 0, page0 * P + start % P, live, NB, BN)
        _g_issue(kv_desc, pe_desc, bar, buf, pe_buf, 1, page1 * P + (start + BN) % P, live & (last >= 1), NB, BN)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NB, BM, 64], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], box)
        _g_stage_q(q_smem, q0, q1, q2, q3, q4, q5, q6, q7, q8)

        m_i = gl.full([BM], -1e30, gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, mma_s))
        acc = gl.zeros([BM, R], gl.float32, layout=mma_o)
        zero = gl.zeros([BM, BN], gl.float32, layout=mma_s)
        kv = gl.arange(0, BN, layout=gl.SliceLayout(0, mma_s))
        if PIPE:
            if live:
                mbarrier.wait(bar.index(0), 0)
                sc = _g_scores(q_smem, buf, pe_buf, 0, 0, zero, NB)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                p, alpha, m_i, l_i = _g_softmax(sc, m_i, l_i, start, kv, end, sm_scale)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                _cta_barrier()
                for i in range(0, ntiles):
                    st = i % 2
                    nx = 1 - st
                    t0 = start + i * BN
                    # the next tile's scores (past the last: a copied tile, all masked), then this tile's P V
                    mbarrier.wait(bar.index(nx), ((i + 1) // 2) & 1)
                    sc = _g_scores(q_smem, buf, pe_buf, nx * (NB - 1), nx, zero, NB)
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
                    acc = warpgroup_mma(p_smem, lat.index(st), acc, is_async=True)
                    sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
                    p, alpha, m_i, l_i = _g_softmax(sc, m_i, l_i, t0 + BN, kv, end, sm_scale)
                    pb = p.to(gl.bfloat16)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _cta_barrier()  # both warpgroups' P V have read P: the next one may replace it
                    p_smem.store(pb)
                    fence_async_shared()
                    _cta_barrier()  # every warp is past this tile's products and has stored the next P
                    t2 = t0 + 2 * BN
                    page_nx = _g_refill(kv_desc, pe_desc, bar, buf, pe_buf, st, page_nx, pt, t2, end, i + 2 <= last,
                                        max_pages, P, NB, BN)
        else:
            for i in range(0, ntiles):
                st = i % 2
                t0 = start + i * BN
                mbarrier.wait(bar.index(st), (i // 2) & 1)
                sc = _g_scores(q_smem, buf, pe_buf, st * (NB - 1), st, zero, NB)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                p, alpha, m_i, l_i = _g_softmax(sc, m_i, l_i, t0, kv, end, sm_scale)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                _cta_barrier()
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
                acc = warpgroup_mma(p_smem, lat.index(st), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _cta_barrier()
                t2 = t0 + 2 * BN
                page_nx = _g_refill(kv_desc, pe_desc, bar, buf, pe_buf, st, page_nx, pt, t2, end, t2 < end, max_pages,
                                    P, NB, BN)
        l_safe, lse = _g_finish(bar, l_i, m_i)
        rh = hb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_s))
        gl.store(lse_part + (n * NSPLIT + s) * H + rh, lse, mask=rh < H)
        inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, mma_o))
        out = (acc * inv[:, None]).to(o_part.dtype.element_ty)
        # 16-byte stores of 8 consecutive r (the buffers above are dead here: the conversion reuses their memory)
        st_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32],
                                              warps_per_cta=[8, 1], order=[1, 0])
        rh_s = hb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, st_l))
        rr_s = gl.arange(0, R, layout=gl.SliceLayout(0, st_l))
        optr = o_part + ((n * NSPLIT + s) * H + rh_s)[:, None].to(gl.int64) * R + rr_s[None, :]
        gl.store(optr, gl.convert_layout(out, st_l), mask=(rh_s < H)[:, None])



TWO_WARPGROUPS = True
"""Head blocks of 64 on two warpgroups (``warpgroups``); off: on one."""

QUERIES_ON_M = True
"""Head blocks of 64 (the absorbed prefill's query rows) through ``_split_kernel_gluon_qm``, the queries on wgmma's
M; off: ``_split_kernel_gluon`` (queries on N). One layer's absorbed call replayed (H100, `bench/mla_prefill.py
--padded`), 128 tokens after 1M / 128K / 32K cached rows: 20.1 / 2.68 / 0.89 ms against 23.3 / 3.12 / 0.99
(465 against 401 TFLOP/s at 1M)."""

PIPELINED = False
"""``_split_kernel_gluon_qm`` issues the next tile's scores before this tile's P V (``PIPE``). Off: slower than the
serial loop (1M, 128 tokens 24.1 against 20.1 ms, H100), by estimate its P's second barrier and the copied
tile past the last; kept for the bench's A/B (variant 64-mp)."""


def warpgroups(BH: int) -> int:
    """Warpgroups of the split kernel for head blocks of BH: one up to 32 heads; with ``TWO_WARPGROUPS``, two at
    64, each with the products of 32 heads (one warpgroup's accumulators for 64 heads, 64 KB of float32, are 256
    registers a thread: they spill, and ran twice as slow as two blocks of 32). At 64 a tile copied once serves
    twice the heads: the absorbed prefill's many query rows (absorbed.py) read each cached tile half as often."""
    return 2 if TWO_WARPGROUPS and BH >= 64 else 1


def gluon_split_serves(device: torch.device, dtype: torch.dtype, R: int, DR: int, P: int, BN: int, BH: int) -> bool:
    """Whether the Gluon kernel serves calls of this shape on ``device``: a Hopper GPU (sm_90), bf16, r 512, dr 64,
    page-aligned tiles of 64 rows, head blocks of 16-64 (``gluon_split_ok`` adds the cache's alignment)."""
    return (gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and dtype == torch.bfloat16 and R == 512 and DR == 64 and BN == 64 and P % BN == 0
            and BH in (16, 32, 64))


def gluon_split_ok(q_lat: Tensor, kv_pages: Tensor, R: int, DR: int, P: int, BN: int, BH: int) -> bool:
    """Whether the Gluon kernel serves a call: ``gluon_split_serves``, both tensors bf16, a 16-byte-aligned cache
    (TMA)."""
    return (kv_pages.dtype == q_lat.dtype and gluon_split_serves(q_lat.device, q_lat.dtype, R, DR, P, BN, BH)
            and kv_pages.data_ptr() % 16 == 0)


def launch_split_gluon(
    q_lat: Tensor, q_pe: Tensor, kv_pages: Tensor, page_table: Tensor, seq_lens: Tensor, o_part: Tensor,
    lse: Tensor, sm_scale: float, tokens_per_split: int, BH: int, pdl: bool = False,
) -> None:
    """The split kernel over q_lat [N, H, 512], q_pe [N, H, 64], kv_pages [num_pages, P, 576] (contiguous),
    page_table [N, max_pages] int32, seq_lens [N], into o_part [N, S, H, 512] and lse [N, S, H] float32;
    ``sm_scale`` includes log2(e). ``pdl``: launched as a programmatic dependent launch (the kernel waits for its
    predecessor's writes before it reads anything, and lets the merge launch at once)."""
    N, H, R = q_lat.shape
    P = kv_pages.shape[1]
    rows = kv_pages.view(-1, kv_pages.shape[-1])  # [num_pages * P, r + dr]: a tile is BN consecutive rows
    # [8, rows, 64]: box b of row t at t * 576 + b * 64, so one TMA box [8, 64, 64] is a tile's latent part (a
    # box's sides must be powers of 2: the rope part is a second copy)
    boxes = rows.as_strided((8, rows.shape[0], 64), (64, rows.shape[1], 1))
    desc = TensorDescriptor(boxes, list(boxes.shape), list(boxes.stride()), [8, 64, 64],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
    pe_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [64, 64],
                               gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    if QUERIES_ON_M and BH == 64:
        _split_kernel_gluon_qm[(triton.cdiv(H, BH), o_part.shape[1], N)](
            q_lat, q_pe, desc, pe_desc, page_table, seq_lens, o_part, lse, sm_scale, page_table.shape[1],
            tokens_per_split, o_part.shape[1], H=H, R=R, DR=q_pe.shape[-1], P=P, BN=64, PDL=pdl, PIPE=PIPELINED,
            num_warps=8, **({"launch_pdl": True} if pdl else {}),
        )
        return
    wg = warpgroups(BH)
    _split_kernel_gluon[(triton.cdiv(H, BH), o_part.shape[1], N)](
        q_lat, q_pe, desc, pe_desc, page_table, seq_lens, o_part, lse, sm_scale, page_table.shape[1],
        tokens_per_split, o_part.shape[1], H=H, R=R, DR=q_pe.shape[-1], P=P, BH=BH, BN=64, PDL=pdl, WG=wg,
        num_warps=4 * wg,
        **({"launch_pdl": True} if pdl else {}),  # only when asked: older Triton rejects the option
    )
