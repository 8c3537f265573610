"""The sigmoid router in Triton.

Many tokens (prefill): two kernels, the logits GEMM x @ gate.T with float32 accumulation (16 experts per
program), then the selection: scores, biased top-k, renormalisation and scale (one program per token).

Few tokens (decode, ``ROUTE_DECODE_MAX_TOKENS``): ONE launch. Each program computes the logits of ``BE``
experts for every token (the router's weight is read once, by ~E / 2 programs, each with its whole slice of the
width in flight), stores them, and the last program to finish (a per-device arrival counter, reset by that
program: CUDA-graph safe) selects the top k of every token at once: one packed (score, index) max per slot; at
one token over 256 experts by warp shuffles, with no barrier between the slots (``SELECT_LANES``). Launches of this kernel on one device must not overlap (one stream, as the decode step runs). The same launch can
take the residual add and RMSNorm before the layer (``add_norm_route_decode``): every program norms the rows
itself (they are a few KB) and program 0 stores them, one launch instead of two. On Hopper it is a PDL launch
(``pdl``): the gate rows load while the launch before ends, the counter is touched only after the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..stamps import (
    clock_after,
    clock_now,
    global_ns,
    stamp_buffer,
    store_at,
    store_ends,
    store_max2_at,
    store_max_at,
)
from . import ROUTE_DECODE_MAX_TOKENS
from .pdl import use_pdl


@triton.jit
def _logits_kernel(x, w, out, T, E, D, stride_x, stride_w, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr):
    """out[t, e] = sum_d x[t, d] w[e, d] in float32 for the BT x BE tile (program_id(0), program_id(1))."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    kk = tl.arange(0, BK)
    t_ok, e_ok = t < T, e < E
    xp = x + t[:, None].to(tl.int64) * stride_x + kk[None, :]  # [BT, BK]
    wp = w + e[None, :].to(tl.int64) * stride_w + kk[:, None]  # [BK, BE]: gate.T
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = kk < D - k0
        a = tl.load(xp, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(wp, mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK
    tl.store(out + t[:, None].to(tl.int64) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _route_kernel(
    logits, bias, chosen, weights, E, scale, always_on,
    K: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, EXTRA: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    ok = e < E
    s = tl.sigmoid(tl.load(logits + t * E + e, mask=ok, other=0.0).to(tl.float32))
    sel = tl.where(ok, s + tl.load(bias + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    j = tl.arange(0, K)
    ids = tl.zeros([K], dtype=tl.int32)
    w = tl.zeros([K], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(sel, axis=0)
        # the lowest index among the maxima, as a tie-break
        idx = tl.min(tl.where(sel == best, e, EP), axis=0)
        ids = tl.where(j == i, idx, ids)
        w = tl.where(j == i, tl.sum(tl.where(e == idx, s, 0.0), axis=0), w)
        sel = tl.where(e == idx, float("-inf"), sel)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    KO: tl.constexpr = K + EXTRA  # the row width of chosen and weights
    tl.store(chosen + t * KO + j, ids.to(tl.int64))
    tl.store(weights + t * KO + j, (w * scale).to(weights.dtype.element_ty))
    if EXTRA:
        tl.store(chosen + t * KO + K, always_on.to(tl.int64))
        tl.store(weights + t * KO + K, tl.full((), 1.0, tl.float32).to(weights.dtype.element_ty))



@triton.jit
def _select_top_k(
    logits, bias, chosen, weights, T, E, scale, always_on,
    BT: tl.constexpr, K: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr, EXTRA: tl.constexpr,
):
    """The top K of ``sigmoid(logits[t]) + bias`` for the T <= BT tokens at once (lowest index first among equal
    scores), their plain scores renormalised and scaled -> chosen [T, K + EXTRA], weights [T, K + EXTRA]. The
    logits were written by other programs of this launch: read through L2 (``.cg``). (The chosen experts' scores
    taken from the rows in registers, ``tl.gather``, instead of the second L2 read below: no faster, 2.432 ms a
    1 x 128K step of the 48B shape against 2.431, H200, 2026-12-05. At one token this phase is ~4.1 us of the
    launch's ~7 us after its wait (clock stamps, ``bench/decode_48b.py --stamps``, H100): each slot's max is a
    block reduction, one or two barriers; ``_select_top_k_lanes`` has none, 2.9 us. A loop-free selection by
    rank, each expert compared with every other 16 or 32 at a time, took 42 and 15.6 us instead: the compare
    tiles cost registers and a layout change each; the step 1.842 -> 2.385 ms, H100, 16 layers, 2026-12-06.)"""
    t = tl.arange(0, BT)
    e = tl.arange(0, EP)
    t_ok = t < T
    ok = t_ok[:, None] & (e < E)[None, :]
    lg = tl.load(logits + t[:, None] * E + e[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    b = tl.load(bias + e, mask=e < E, other=0.0).to(tl.float32)
    sel = tl.where(ok, tl.sigmoid(lg) + b[None, :], float("-inf"))
    # a float32 as an int32 of the same order, above it the index reversed: one max gives score and index
    bits = sel.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    packed = (key.to(tl.int64) << 32) | (EP - 1 - e)[None, :].to(tl.int64)
    j = tl.arange(0, K)
    ids = tl.zeros([BT, K], dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(packed, axis=1)  # [BT]
        idx = (EP - 1 - (best & (EP - 1))).to(tl.int32)
        ids = tl.where(j[None, :] == i, idx[:, None], ids)
        packed = tl.where(e[None, :] == idx[:, None], -9223372036854775807, packed)
    w = tl.sigmoid(tl.load(logits + t[:, None] * E + ids, mask=t_ok[:, None], other=0.0, cache_modifier=".cg"))
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    KO: tl.constexpr = K + EXTRA  # the row width of chosen and weights
    out_ok = t_ok[:, None] & (j < K)[None, :]
    tl.store(chosen + t[:, None] * KO + j[None, :], ids.to(tl.int64), mask=out_ok)
    tl.store(weights + t[:, None] * KO + j[None, :], (w * scale).to(weights.dtype.element_ty), mask=out_ok)
    if EXTRA:
        tl.store(chosen + t * KO + K, tl.zeros([BT], tl.int64) + always_on, mask=t_ok)
        tl.store(weights + t * KO + K, tl.full([BT], 1.0, tl.float32).to(weights.dtype.element_ty), mask=t_ok)


@triton.jit
def _lane(like):
    """This thread's lane in its warp, in the shape of ``like`` (an int32 tensor)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %laneid; // $1", "=r,r", [like], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _warp_max(v):
    """The max of int64 v over the 32 lanes of each warp, in every lane (five butterfly shuffles)."""
    for i in tl.static_range(5):
        v = tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi, olo, ohi; .reg .b64 o; mov.b64 {lo, hi}, $1; "
            "shfl.sync.bfly.b32 olo, lo, $2, 0x1f, 0xffffffff; shfl.sync.bfly.b32 ohi, hi, $2, 0x1f, 0xffffffff; "
            "mov.b64 o, {olo, ohi}; max.s64 $0, $1, o; }",
            "=l,l,r", [v, tl.full(v.shape, 16 >> i, tl.int32)], dtype=tl.int64, is_pure=True, pack=1)
    return v


@triton.jit
def _from_lane(v, src):
    """Float32 v of lane ``src`` (an int32 tensor, the same in every lane) in every lane of the warp."""
    return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                     [v.to(tl.int32, bitcast=True), src], dtype=tl.int32, is_pure=True,
                                     pack=1).to(tl.float32, bitcast=True)


@triton.jit
def _key(logits, bias, e, E: tl.constexpr):
    """(packed key, sigmoid) of expert(s) e: the score as an int32 of the same order above the reversed index."""
    ok = e < E
    s = tl.sigmoid(tl.load(logits + e, mask=ok, other=0.0, cache_modifier=".cg"))
    sel = tl.where(ok, s + tl.load(bias + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    bits = sel.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (255 - e).to(tl.int64), s


@triton.jit
def _select_top_k_lanes(
    logits, bias, chosen, weights, E: tl.constexpr, scale, always_on,
    K: tl.constexpr, RENORM: tl.constexpr, EXTRA: tl.constexpr, NT: tl.constexpr,
):
    """``_select_top_k`` of one token over E <= 256 experts with no barrier: lane l of every warp holds experts
    8 l .. 8 l + 7 (its lane read from ``%laneid``, so any layout of the [NT] tensors serves), and each of the K
    steps is a max over the lane's 8 keys, then over the warp's lanes by shuffles; the winner's plain score comes
    from its lane by one more shuffle. Every warp computes the same choices; one thread stores them. Same result
    and tie-break as ``_select_top_k`` (the renormalising sum in another order). Written out for the 8 keys and
    the K <= 8 choices a lane holds: Triton has no register arrays to index."""
    lane = _lane(tl.zeros([NT], tl.int32))
    e0 = lane * 8
    k0, s0 = _key(logits, bias, e0, E)
    k1, s1 = _key(logits, bias, e0 + 1, E)
    k2, s2 = _key(logits, bias, e0 + 2, E)
    k3, s3 = _key(logits, bias, e0 + 3, E)
    k4, s4 = _key(logits, bias, e0 + 4, E)
    k5, s5 = _key(logits, bias, e0 + 5, E)
    k6, s6 = _key(logits, bias, e0 + 6, E)
    k7, s7 = _key(logits, bias, e0 + 7, E)
    low: tl.constexpr = -9223372036854775807
    zi = tl.zeros([NT], dtype=tl.int32)
    zf = tl.zeros([NT], dtype=tl.float32)
    i0, i1, i2, i3, i4, i5, i6, i7 = zi, zi, zi, zi, zi, zi, zi, zi
    w0, w1, w2, w3, w4, w5, w6, w7 = zf, zf, zf, zf, zf, zf, zf, zf
    total = zf
    for i in tl.static_range(K):  # K <= 8: the step's choice and weight kept in i<step>, w<step> (no layout change)
        m = tl.maximum(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)),
                       tl.maximum(tl.maximum(k4, k5), tl.maximum(k6, k7)))
        best = _warp_max(m)
        idx = (255 - (best & 255)).to(tl.int32)
        slot = idx - e0  # 0..7 in the winner's lane
        sv = tl.where(slot == 0, s0, tl.where(slot == 1, s1, tl.where(slot == 2, s2, tl.where(
            slot == 3, s3, tl.where(slot == 4, s4, tl.where(slot == 5, s5, tl.where(slot == 6, s6, s7)))))))
        wv = _from_lane(sv, idx // 8)
        total += wv
        if i == 0:
            i0, w0 = idx, wv
        if i == 1:
            i1, w1 = idx, wv
        if i == 2:
            i2, w2 = idx, wv
        if i == 3:
            i3, w3 = idx, wv
        if i == 4:
            i4, w4 = idx, wv
        if i == 5:
            i5, w5 = idx, wv
        if i == 6:
            i6, w6 = idx, wv
        if i == 7:
            i7, w7 = idx, wv
        k0 = tl.where(slot == 0, low, k0)
        k1 = tl.where(slot == 1, low, k1)
        k2 = tl.where(slot == 2, low, k2)
        k3 = tl.where(slot == 3, low, k3)
        k4 = tl.where(slot == 4, low, k4)
        k5 = tl.where(slot == 5, low, k5)
        k6 = tl.where(slot == 6, low, k6)
        k7 = tl.where(slot == 7, low, k7)
    den = total + 1e-20 if RENORM else zf + 1.0
    one = tl.arange(0, NT) == 0  # one element (one thread) stores
    _store_choice(chosen, weights, 0, i0, w0 / den * scale, one, K)
    _store_choice(chosen, weights, 1, i1, w1 / den * scale, one, K)
    _store_choice(chosen, weights, 2, i2, w2 / den * scale, one, K)
    _store_choice(chosen, weights, 3, i3, w3 / den * scale, one, K)
    _store_choice(chosen, weights, 4, i4, w4 / den * scale, one, K)
    _store_choice(chosen, weights, 5, i5, w5 / den * scale, one, K)
    _store_choice(chosen, weights, 6, i6, w6 / den * scale, one, K)
    _store_choice(chosen, weights, 7, i7, w7 / den * scale, one, K)
    if EXTRA:
        tl.store(chosen + K, always_on.to(tl.int64))
        tl.store(weights + K, tl.full((), 1.0, tl.float32).to(weights.dtype.element_ty))


@triton.jit
def _store_choice(chosen, weights, q: tl.constexpr, idx, w, one, K: tl.constexpr):
    """Choice q (if q < K) of ``_select_top_k_lanes``: expert idx and weight w, from the elements ``one``."""
    if q < K:
        tl.store(chosen + q + idx * 0, idx.to(tl.int64), mask=one)
        tl.store(weights + q + idx * 0, w.to(weights.dtype.element_ty), mask=one)


SELECT_LANES = True
"""The one-token selection over 256 experts by warp shuffles (``_select_top_k_lanes``) rather than by block
reductions (``_select_top_k``), on CUDA. The last program's selection 4.1 -> 2.9 us and the router's launch 7.7 ->
6.1 us (clock stamps); the step -7.6 / -8.8 / -7.7 us at 1 x 128K (1.8241 / 1.8243 / 1.8216 -> 1.8165 / 1.8155 /
1.8139 ms) and -12.1 / -9.9 / -9.4 at 1 x 1M, three alternations (H100, the 48B shape's first 16 layers, 15 MoE
layers, ``bench/decode_48b.py --layers 16 --cases 1x131072,1x1048576 --modes fused,old-route,...``, 2026-12-06);
greedy, 4 layers at 8K: the same tokens and first logits; the same choices as the block reductions' (ties too,
``test_the_selection_by_lanes_gives_the_same_choices``)."""


@triton.jit
def _route_decode_kernel(
    x, gate, bias, logits, counter, chosen, weights, T, E, stride_x, stride_g, scale, always_on,
    res, norm_w, s_out, h_out, eps,
    D: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, K: tl.constexpr, EP: tl.constexpr,
    RENORM: tl.constexpr, EXTRA: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
    stamps=None, STAMPS: tl.constexpr = False, LANES: tl.constexpr = False, NT: tl.constexpr = 128,
):
    """Program i: logits[t, e] for the BE experts e of i and every token t < T <= BT; then the last program to
    arrive selects (``_select_top_k``) and resets the counter. With NORM the router's input is
    ``rms_norm(x + res) * norm_w`` (x, res [T, D] contiguous; each program computes it, program 0 stores the sum
    in s_out and the normed rows in h_out, both [T, D] in x's dtype), rounded as ``kernels.norm.add_rms_norm``'s.
    With PDL the first BK columns of the program's gate rows (all of them at one token) and of the norm's weight
    are loaded before the wait for the launch before (``pdl``): the weights' memory latency leaves the path.
    The next launch (the MoE up kernel) may start once every program has its logits stored. (Letting it start at
    this kernel's start, so that the up kernel's shared-expert rows load during the whole router: within noise,
    with the down kernel's trigger moved likewise -5 / -6 us at 1 x 128K and -10 / -1 at 1 x 1M over 15 MoE
    layers, H100, the 48B shape's first 16 layers, 2026-12-06.)

    With STAMPS (``kernels.stamps``) program i stores its phases' clock readings in row i of ``stamps``: [2] start,
    [3] after the wait, [4] the norm's sums of squares done, [5] the logits summed, [6] arrived, [7] end (the last
    program's selection included)."""
    if STAMPS:
        g_start = global_ns()
        c_start = clock_now()
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    e_ok = e < E
    t = tl.arange(0, BT)
    t_ok = t < T
    kk = tl.arange(0, BK)
    g_rows = gate + e[:, None].to(tl.int64) * stride_g + kk[None, :]  # [BE, BK]
    w_first = tl.load(g_rows, mask=e_ok[:, None] & (kk < D)[None, :], other=0.0)
    if NORM:
        nw_first = tl.load(norm_w + kk, mask=kk < D, other=0.0)
    if PDL:
        gdc_wait()  # x and res are the launch before's outputs
    if STAMPS:
        c_wait = clock_now()
    if NORM:  # the sum of squares of each token's residual sum, over the whole width first
        ss = tl.zeros([BT], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BK):
            m = t_ok[:, None] & (k0 + kk < D)[None, :]
            off = t[:, None] * D + k0 + kk[None, :]
            v = (tl.load(x + off, mask=m, other=0.0).to(tl.float32) + tl.load(res + off, mask=m, other=0.0).to(
                tl.float32)).to(x.dtype.element_ty).to(tl.float32)
            ss += tl.sum(v * v, axis=1)
        inv = tl.rsqrt(ss / D + eps)  # [BT]
        if STAMPS:
            c_norm = clock_after(inv)
    acc = tl.zeros([BT, BE, BK], dtype=tl.float32)  # products summed over the width at the end, once
    for k0 in tl.static_range(0, D, BK):  # unrolled: every load of the slice can be in flight at once
        k_ok = k0 + kk < D
        if k0 == 0:
            w = w_first.to(tl.float32)  # [BE, BK]
        else:
            w = tl.load(g_rows + k0, mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        m = t_ok[:, None] & k_ok[None, :]
        if NORM:
            off = t[:, None] * D + k0 + kk[None, :]
            sv = (tl.load(x + off, mask=m, other=0.0).to(tl.float32) + tl.load(res + off, mask=m, other=0.0).to(
                tl.float32)).to(x.dtype.element_ty)
            if k0 == 0:
                nw = nw_first.to(tl.float32)
            else:
                nw = tl.load(norm_w + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
            hv = (sv.to(tl.float32) * inv[:, None] * nw[None, :]).to(x.dtype.element_ty)
            if tl.program_id(0) == 0:
                tl.store(s_out + off, sv, mask=m)
                tl.store(h_out + off, hv, mask=m)
            xv = hv.to(tl.float32)
        else:
            xv = tl.load(x + t[:, None] * stride_x + k0 + kk[None, :], mask=m, other=0.0).to(tl.float32)  # [BT, BK]
        acc += xv[:, None, :] * w[None, :, :]
    logit = tl.sum(acc, axis=2)  # [BT, BE]
    if STAMPS:
        c_logit = clock_after(logit)
    tl.store(logits + t[:, None] * E + e[None, :], logit, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits are written before this program's arrival is released
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if STAMPS:
        c_arrive = clock_after(arrived)
    if PDL:
        gdc_launch_dependents()  # the next launch's programs may start: it waits for this one's end
    if arrived == tl.num_programs(0) - 1:
        if LANES:
            _select_top_k_lanes(logits, bias, chosen, weights, EP, scale, always_on, K, RENORM, EXTRA, NT)
        else:
            _select_top_k(logits, bias, chosen, weights, T, E, scale, always_on, BT, K, EP, RENORM, EXTRA)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    if STAMPS:
        r = tl.program_id(0)
        store_ends(stamps, r, 7, g_start, c_start, c_wait)
        if NORM:
            store_max_at(stamps, r, 4, c_norm)
        else:
            store_at(stamps, r, 4, c_wait)
        store_max2_at(stamps, r, 5, c_logit)
        store_at(stamps, r, 6, c_arrive)


_COUNTERS: dict[tuple[str, int | None], Tensor] = {}


def arrival_counters(device: torch.device) -> Tensor:
    """The arrival counters of ``device`` (zero between launches): [0] the decode router's, [1] the direct MoE
    down kernel's (``triton_moe``). Made outside a graph capture and kept; during a capture without them, fresh
    zeroed counters (a memset node in the graph)."""
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is None:
        c = torch.zeros(2, dtype=torch.int32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _COUNTERS[key] = c
    return c


def moe_route_decode(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float,
    always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``moe_route_triton`` for few tokens (T <= ``ROUTE_DECODE_MAX_TOKENS``) in one launch: x [T, D], gate
    [E, D] (x's dtype, last dimension contiguous), bias [E] (any float dtype) -> (chosen [T, k'] int64, weights
    [T, k'] in x's dtype), k' = k or k + 1 with ``always_on``. k must be a power of two."""
    chosen, weights, _, _ = _route_decode(x, gate, bias, top_k, renormalize, scale, always_on, None)
    return chosen, weights


def add_norm_route_decode(
    x: Tensor, res: Tensor, norm_weight: Tensor, eps: float, gate: Tensor, bias: Tensor, top_k: int,
    renormalize: bool, scale: float, always_on: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The residual add and RMSNorm before a MoE layer and ``moe_route_decode`` of the normed rows, in its one
    launch: x, res [T, D] (T <= ``ROUTE_DECODE_MAX_TOKENS``), norm_weight [D] -> (s = x + res, h = rms_norm(s) *
    norm_weight, both [T, D] in x's dtype, chosen, weights)."""
    chosen, weights, s, h = _route_decode(x, gate, bias, top_k, renormalize, scale, always_on,
                                          (res, norm_weight, eps))
    assert s is not None and h is not None
    return s, h, chosen, weights


def _route_decode(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float, always_on: int | None,
    norm: tuple[Tensor, Tensor, float] | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two"
    T, D = x.shape
    E = gate.shape[0]
    assert 0 < T <= ROUTE_DECODE_MAX_TOKENS and gate.stride(1) == 1
    x = x.contiguous()
    extra = int(always_on is not None)
    dev = x.device
    chosen = torch.empty(T, top_k + extra, dtype=torch.int64, device=dev)
    weights = torch.empty(T, top_k + extra, dtype=x.dtype, device=dev)
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    if norm is None:
        res, norm_w, s, h, eps = x, x, None, None, 0.0
    else:
        res, norm_w, eps = norm
        res = res.contiguous()
        s, h = torch.empty_like(x), torch.empty_like(x)
    BT = triton.next_power_of_2(T)
    BE = 2
    # [BT, BE, BK] products, 32 a thread each step; at one token the whole width (up to 4096) in one step, so
    # that all of a program's gate rows load before the PDL wait. Four warps: one warp at one token (the
    # selection's max reductions within a warp) measured slower on the H200, 8.0 us a layer against 6.5
    warps = 4
    DP = triton.next_power_of_2(D)
    BK = min(DP, 4096) if BT == 1 else max(16, min(DP, 1024 * warps // (BT * BE)))
    pdl = use_pdl(dev)
    stamps = stamp_buffer("route", triton.cdiv(E, BE), dev)
    _route_decode_kernel[(triton.cdiv(E, BE),)](
        x, gate, bias, logits, arrival_counters(dev), chosen, weights, T, E, x.stride(0), gate.stride(0),
        float(scale), always_on or 0, res, norm_w, x if s is None else s, x if h is None else h, float(eps),
        D=D, BT=BT, BE=BE, BK=BK, K=top_k, EP=triton.next_power_of_2(E), RENORM=renormalize, EXTRA=extra,
        NORM=norm is not None, PDL=pdl, stamps=stamps, STAMPS=stamps is not None,
        LANES=SELECT_LANES and dev.type == "cuda" and T == 1 and E == 256 and top_k <= 8, NT=32 * warps,
        num_warps=warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return chosen, weights, s, h


def router_logits_triton(x: Tensor, gate: Tensor) -> Tensor:
    """x [T, D], gate [E, D] (same dtype, last dimension contiguous) -> logits [T, E] float32."""
    T, D = x.shape
    E = gate.shape[0]
    assert x.stride(1) == 1 and gate.stride(1) == 1
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    BT = 16 if T <= 16 else 64
    BE = 16 if T <= 64 else 64
    if T:
        _logits_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
            x, gate, out, T, E, D, x.stride(0), gate.stride(0), BT=BT, BE=BE, BK=128,
            IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
        )
    return out


def moe_route_triton(
    x: Tensor, gate: Tensor, bias: Tensor, top_k: int, renormalize: bool, scale: float,
    always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """x [T, D], gate [E, D], bias [E] float32 -> (chosen [T, k'] int64, weights [T, k'] in x's dtype), k' = k,
    or k + 1 with ``always_on``; see ``naive_moe_route``. k must be a power of two."""
    assert top_k & (top_k - 1) == 0, "top_k must be a power of two"
    logits = router_logits_triton(x.contiguous(), gate)  # [T, E] float32
    T, E = logits.shape
    dtype = x.dtype
    extra = int(always_on is not None)
    chosen = torch.empty(T, top_k + extra, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k + extra, dtype=dtype, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias.float(), chosen, weights, E, scale, always_on or 0, K=top_k,
                            EP=triton.next_power_of_2(E), RENORM=renormalize, EXTRA=extra, num_warps=4)
    return chosen, weights


__all__ = [
    "ROUTE_DECODE_MAX_TOKENS",
    "add_norm_route_decode",
    "arrival_counters",
    "moe_route_decode",
    "moe_route_triton",
    "router_logits_triton",
]
