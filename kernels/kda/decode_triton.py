"""One KDA decode step in one Triton launch: conv + gate + beta + q/k norm + recurrence + read, the shift of the
conv tails, and with an output gate the layer's gated output norm, in place in the pools at the sequences' slots.

The kernel runs one program per (V block, sequence, head) like the fused-recurrent kernel; every program computes
its head's q and k from the conv tails (the q and k channels are shared by the V blocks of a head), so no program
may overwrite a tail another still reads. Each program shifts its own V block's v channels (read by it alone); the
last of a head's V blocks to finish (a per-(sequence, head) arrival counter, ``head_counters``) shifts the head's q
and k channels and norms the head's V outputs, which the others leave in memory. With one V block a head (from 8
sequences up at V 128) the program does all of it with no counter. Given the gates' weights, each program also
computes its head's gate logits from the low-rank gate input (f_b's [K, KF] rows) and its V block's output-gate
logits (g_b's rows), which saves the layer a matvec launch. Nothing is gathered or scattered, so a step costs one
launch instead of the ~25 of the separate conv, gate, cast and recurrence kernels, and it can be captured in a
CUDA graph (the counters are zero again at the end of every launch).

With ``pdl`` on Hopper it is a PDL launch (``kernels.moe.pdl``): it lets the next launch start at once and waits
for the launch before it before reading anything, so the output projection's PDL matvec starts early (it loads its
weight while this one runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..moe.pdl import use_pdl
from ..stamps import clock_after, clock_now, global_ns, stamp_buffer, store_ends, store_max_at


@triton.jit
def _conv_tail(tail, cw, s_cd, s_cw, ch, m, Dc: tl.constexpr, W: tl.constexpr):
    """Channels ``ch`` of one token's conv over the W - 1 tail rows: (sum of weight * row, float32; the new
    row's weights, float32), for ``_conv_silu``."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for w in tl.static_range(W - 1):
        acc += tl.load(tail + w * Dc + ch, mask=m, other=0.0).to(tl.float32) * \
            tl.load(cw + ch * s_cd + w * s_cw, mask=m, other=0.0).to(tl.float32)
    return acc, tl.load(cw + ch * s_cd + (W - 1) * s_cw, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _conv_silu(x_row, acc, w_new, ch, m):
    """Channels ``ch`` of one token's conv: the tail's sum ``acc`` plus the new row x times its weights, then
    SiLU, rounded to x's dtype (as the separate conv kernel stores it); float32."""
    acc += tl.load(x_row + ch, mask=m, other=0.0).to(tl.float32) * w_new
    y = acc * tl.sigmoid(acc)
    return y.to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _head_matvec(x, w_rows, m, KF: tl.constexpr, BJ: tl.constexpr):
    """sum_j w_rows[:, j] x[j] over j < KF, rounded to x's dtype (as a separate projection's output is stored),
    float32: one head's gate logits from the low-rank gate input x [KF] and the head's weight rows (pointers
    [B] to rows of unit column stride, mask m), BJ columns a step."""
    acc = tl.zeros(m.shape, dtype=tl.float32)
    for j0 in tl.static_range(0, KF, BJ):
        rj = j0 + tl.arange(0, BJ)
        mj = rj < KF
        xj = tl.load(x + rj, mask=mj, other=0.0).to(tl.float32)
        wt = tl.load(w_rows[:, None] + rj[None, :], mask=m[:, None] & mj[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * xj[None, :], axis=1)
    return acc.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _shift(qkv, s_x, tail, n, d, md, Dc: tl.constexpr, W: tl.constexpr):
    """Channels d (mask md) of one sequence's tail (``tail``: its first row): rows 1 .. W - 2 move down one row, the
    new pre-conv row of sequence n last."""
    for w in tl.static_range(W - 2):
        tl.store(tail + w * Dc + d, tl.load(tail + (w + 1) * Dc + d, mask=md), mask=md)
    row = tl.load(qkv + n.to(tl.int64) * s_x + d, mask=md)
    tl.store(tail + (W - 2) * Dc + d, row.to(tail.dtype.element_ty), mask=md)


@triton.jit
def _gate_weight(gate, s_g, n, h, d, m, nw, ogw, s_ogw, V: tl.constexpr, VF: tl.constexpr, BJ: tl.constexpr):
    """Channels d (mask m) of head h's ``weight * sigmoid(gate logits)`` of sequence n, float32: the logits from
    gate's row n [H*V], or with VF > 0 from g_a's output [VF] (``gate``) and head h's rows of g_b's weight
    [H*V, VF] (``ogw``)."""
    if VF > 0:
        z = _head_matvec(gate + n.to(tl.int64) * s_g, ogw + (h * V + d).to(tl.int64) * s_ogw, m, VF, BJ)
    else:
        z = tl.load(gate + n.to(tl.int64) * s_g + h * V + d, mask=m, other=0.0).to(tl.float32)
    return tl.load(nw + d, mask=m, other=0.0).to(tl.float32) * tl.sigmoid(z)


@triton.jit
def _decay_gate(raw, s_raw, gw, s_gw, dt_bias, A_log, b, s_b, lower_bound, n, h, rk, mk,
                K: tl.constexpr, KF: tl.constexpr, BJ: tl.constexpr, BOUNDED: tl.constexpr):
    """Head h's log-decay [BK] of sequence n from its raw logits + dt_bias (kernels/gate/naive.py), and its beta
    (sigmoid of b), float32. The logits: raw's row, or with KF > 0 f_a's output [KF] (``raw``) times head h's rows
    of f_b's weight [H*K, KF] (``gw``)."""
    if KF > 0:
        logit = _head_matvec(raw + n.to(tl.int64) * s_raw, gw + (h * K + rk).to(tl.int64) * s_gw, mk, KF, BJ)
    else:
        logit = tl.load(raw + n.to(tl.int64) * s_raw + h * K + rk, mask=mk, other=0.0).to(tl.float32)
    return _log_decay(logit, dt_bias, A_log, lower_bound, h, rk, mk, K, BOUNDED), \
        tl.sigmoid(tl.load(b + n.to(tl.int64) * s_b + h).to(tl.float32))


@triton.jit
def _log_decay(logit, dt_bias, A_log, lower_bound, h, rk, mk, K: tl.constexpr, BOUNDED: tl.constexpr):
    """Head h's log-decay [BK] from its gate logits (kernels/gate/naive.py), float32."""
    gx = logit + tl.load(dt_bias + h * K + rk, mask=mk, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    if BOUNDED:
        gt = lower_bound * tl.sigmoid(a * gx)
    else:
        softplus = tl.where(gx > 20.0, gx, tl.maximum(gx, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(gx))))
        gt = -a * softplus
    return gt


@triton.jit
def _two_head_matvecs(x, w_rows, m, y, u_rows, mu, KF: tl.constexpr, BJ: tl.constexpr):
    """``_head_matvec`` of (x, w_rows, m) and of (y, u_rows, mu) over the same KF columns in one loop, each
    product summed once at the end: every block's loads of both can be in flight at once."""
    acc_w = tl.zeros([m.shape[0], BJ], dtype=tl.float32)
    acc_u = tl.zeros([mu.shape[0], BJ], dtype=tl.float32)
    for j0 in tl.static_range(0, KF, BJ):
        rj = j0 + tl.arange(0, BJ)
        mj = rj < KF
        xj = tl.load(x + rj, mask=mj, other=0.0).to(tl.float32)
        yj = tl.load(y + rj, mask=mj, other=0.0).to(tl.float32)
        acc_w += tl.load(w_rows[:, None] + rj[None, :], mask=m[:, None] & mj[None, :], other=0.0).to(
            tl.float32) * xj[None, :]
        acc_u += tl.load(u_rows[:, None] + rj[None, :], mask=mu[:, None] & mj[None, :], other=0.0).to(
            tl.float32) * yj[None, :]
    return tl.sum(acc_w, axis=1).to(x.dtype.element_ty).to(tl.float32), \
        tl.sum(acc_u, axis=1).to(y.dtype.element_ty).to(tl.float32)


@triton.jit
def _decode_kernel(
    qkv, s_x, raw, s_raw, b, s_b, cw, s_cd, s_cw, conv, A_log, dt_bias, lower_bound, state, slots, o, scale, gw, s_gw,
    gate, s_g, nw, y, gz, eps, ogw, s_ogw, counter, stamps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BOUNDED: tl.constexpr, KF: tl.constexpr, BJ: tl.constexpr, NORM: tl.constexpr, VF: tl.constexpr,
    BJO: tl.constexpr, BVH: tl.constexpr, PDL: tl.constexpr = False, STAMPS: tl.constexpr = False,
):
    """Program (V block, sequence n * H + head h). With PDL it lets the next launch start, then waits for the
    launch before before it reads anything. (Loading the state slice, the conv tails and the gate's rows before the
    wait took 255 registers and measured 10-13 us a step slower at 1 x 128K and 1 x 1M on the H200. Asking the L2
    for them before the wait instead, no registers held (``prefetch.global.L2::evict_last``): no faster at 1 x 128K,
    2.42-2.44 ms a step against 2.44, and 51 us slower at 1 x 1M, 4.11 against 4.06. Reading only the slot, the
    conv tails and the conv's weights before the wait, their products summed there, a few registers: no faster,
    2.432 ms a 1 x 128K step against 2.431, H200, 2026-12-05.)

    The next launch (o_proj's PDL matvec) starts with this one and loads its 18.9 MB of weight before its wait, so
    those bytes queue ahead of this kernel's own reads: its gate phase takes 5.1 us against 2.5 without them, and
    the matvec still ends 5.9 us after this launch (clock stamps, ``bench/decode_48b.py --stamps``: its 2,304 rows
    do not all fit in the registers beside this launch, and the rest load after; held in shared memory instead, it
    ends 3.6 us after but this launch takes ~1.3 us longer: ``matvec_triton``'s docstring). Tried (H100, the 48B shape's first
    16 layers, two alternations, 2026-12-06): letting the matvec start only once this kernel's gate reads have
    arrived, or its state's: the gate phase 2.5 us but the conv's 2.0 -> 3.5 (or the arrival's 1.3 -> 3.9), the
    matvec still 5.9 us after; the 1 x 128K step 1.8249 / 1.8234 ms -> 1.8311 / 1.8308 and 1.8306 / 1.8285, within
    1 us at 1 x 1M and 8 x 32K. Asking the L2 for o_proj's weight from one more column of programs
    (``cp.async.bulk.prefetch.L2``, before the wait): all of it 1.8236 / 1.8219 -> 1.8489 / 1.8482 ms, its last 40%
    (the rows of the matvec programs not resident during this launch) 1.823 / 1.825 -> 1.838 / 1.838, its last 25%
    1.831 / 1.832; the matvec's end after this launch 5.9 -> 5.1 us, this launch's gate phase 5.1 -> 6.7.

    After the wait it reads the gates' inputs and rows first (nothing of them waits on the slot), both gates'
    matvecs in one loop with their products summed once at the end, then the state slice with the conv tails (both
    wait on the slot alone). Clock stamps (``kernels.stamps``) of the order before, H100, the 48B shape's first 16
    layers, 1 x 128K, each launch measured alone (o_proj's matvec not loading beside it):
    conv 3.4 us, decay gate 2.0, output gate 1.1, state read 1.2, update 0.8, arrival and norm 1.3, a launch
    11.0-11.5 us; the gates first in one loop: 10.0 us (11.5 in the step as it runs, o_proj's matvec loading beside
    it), the step 1.939 / 1.935 / 1.937 ms -> 1.915 /
    1.915 / 1.917 at 1 x 128K and 3.266 / 3.262 / 3.258 -> 3.239 / 3.243 / 3.240 at 1 x 1M, three alternations
    (``bench/decode_48b.py --layers 16 --cases 1x131072,1x1048576``, 2026-12-06). The gates first as two matvecs:
    half of that (-14 us); the state's load moved up alone, the gates after the conv: +36 us; the matvecs' products
    summed once with the order before: no change. Instruction fetch is not what holds the rest: 64 KB of cold
    straight-line code costs ~3.4 us more than its loop (``bench/icache.py``), and this kernel is 28 KB.

    The conv tails shift here too. A program's V block of v channels is read by that program alone: it shifts them
    itself once all its threads have read them. The head's q and k channels are read by all of its V blocks: the
    last of them to arrive (``counter`` [N * H], zero before the launch and reset by that program) shifts them.
    With NORM (the gated output norm into y) that program also norms the head's V outputs: the others' from o
    and gz (their ``weight * sigmoid(gate)``, each program computes its own block's). With one V block a head
    there is no counter and o is never stored: the program has the whole head.

    With STAMPS (``kernels.stamps``) each program stores its phases' clock readings in its row of
    ``stamps`` (program nh * NV + iv): [2] start, [3] after the wait, [4] decay gate done, [5] output gate done,
    [6] conv done, [7] q and k normed, [8] state read and the prediction summed, [9] state updated and o summed,
    [10] end (the arrival and the last program's norm included)."""
    if STAMPS:
        g_start = global_ns()
        c_start = clock_now()
    if PDL:
        gdc_launch_dependents()  # the next launch reads nothing before its wait
        gdc_wait()
    if STAMPS:
        c_wait = clock_now()
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    h = nh % H
    Dc: tl.constexpr = 2 * H * K + H * V
    NV: tl.constexpr = (V + BV - 1) // BV
    slot = tl.load(slots + n).to(tl.int64)
    rk = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = cv < V
    tail = conv + slot * (W - 1) * Dc
    # the gates first: their reads wait on nothing but the launch before, so they go out with the slot's
    if NORM and KF > 0 and VF == KF and BJO == BJ:  # both gates' matvecs in one loop (the model's shape)
        logit, z = _two_head_matvecs(raw + n.to(tl.int64) * s_raw, gw + (h * K + rk).to(tl.int64) * s_gw, mk,
                                     gate + n.to(tl.int64) * s_g, ogw + (h * V + cv).to(tl.int64) * s_ogw, mv, KF, BJ)
        gt = _log_decay(logit, dt_bias, A_log, lower_bound, h, rk, mk, K, BOUNDED)
        bt = tl.sigmoid(tl.load(b + n.to(tl.int64) * s_b + h).to(tl.float32))
        gzv = tl.load(nw + cv, mask=mv, other=0.0).to(tl.float32) * tl.sigmoid(z)
        if STAMPS:
            c_gate = clock_after(gt)
            c_ogate = clock_after(gzv)
    else:
        gt, bt = _decay_gate(raw, s_raw, gw, s_gw, dt_bias, A_log, b, s_b, lower_bound, n, h, rk, mk,
                             K, KF, BJ, BOUNDED)
        if STAMPS:
            c_gate = clock_after(gt)
            c_ogate = c_gate  # no output gate: a phase of nothing
        if NORM:
            gzv = _gate_weight(gate, s_g, n, h, cv, mv, nw, ogw, s_ogw, V, VF, BJO)
            if STAMPS:
                c_ogate = clock_after(gzv)
    # the recurrence's [K, BV] slice of the state, in place at the slot: its load goes out with the conv tails'
    mkv = mk[:, None] & mv[None, :]
    sptr = state + (slot * H + h) * K * V + rk[:, None] * V + cv[None, :]
    S = tl.load(sptr, mask=mkv, other=0.0)
    q_acc, q_w = _conv_tail(tail, cw, s_cd, s_cw, h * K + rk, mk, Dc, W)
    k_acc, k_w = _conv_tail(tail, cw, s_cd, s_cw, H * K + h * K + rk, mk, Dc, W)
    v_acc, v_w = _conv_tail(tail, cw, s_cd, s_cw, 2 * H * K + h * V + cv, mv, Dc, W)
    x_row = qkv + n.to(tl.int64) * s_x
    qt = _conv_silu(x_row, q_acc, q_w, h * K + rk, mk)
    kt = _conv_silu(x_row, k_acc, k_w, H * K + h * K + rk, mk)
    vt = _conv_silu(x_row, v_acc, v_w, 2 * H * K + h * V + cv, mv)
    if STAMPS:
        c_conv = clock_after(qt + kt)
    qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6) * scale
    kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
    if STAMPS:
        c_norm = clock_after(qt + kt)
    S = S * tl.exp(gt)[:, None]
    pred = tl.sum(kt[:, None] * S, axis=0)
    if STAMPS:
        c_pred = clock_after(pred)
    S += kt[:, None] * (bt * (vt - pred))[None, :]
    tl.store(sptr, S, mask=mkv)
    ot = tl.sum(qt[:, None] * S, axis=0).to(o.dtype.element_ty)  # o as stored: the norm reads it so
    if STAMPS:
        c_out = clock_after(ot.to(tl.float32))
    row = nh.to(tl.int64) * V
    if NV == 1:
        if NORM:
            of = ot.to(tl.float32)
            inv = tl.rsqrt(tl.sum(of * of, axis=0) / V + eps)
            tl.store(y + row + cv, (of * inv * gzv).to(y.dtype.element_ty), mask=mv)
        else:
            tl.store(o + row + cv, ot, mask=mv)
    else:
        tl.store(o + row + cv, ot, mask=mv)
        if NORM:
            tl.store(gz + row + cv, gzv, mask=mv)
    if W > 1:
        tl.debug_barrier()  # every thread of the program has read the tails before any moves
        _shift(qkv, s_x, tail, n, 2 * H * K + h * V + cv, mv, Dc, W)
        if NV == 1:
            _shift(qkv, s_x, tail, n, h * K + rk, mk, Dc, W)
            _shift(qkv, s_x, tail, n, H * K + h * K + rk, mk, Dc, W)
    if NV > 1 and (W > 1 or NORM):
        # the release: every thread's reads of the q and k tails and its stores of o and gz come before this
        # program's arrival; the last to arrive (acquire) sees every other's
        tl.debug_barrier()
        arrived = tl.atomic_add(counter + nh, 1, sem="acq_rel", scope="gpu")
        if arrived == NV - 1:
            if W > 1:
                _shift(qkv, s_x, tail, n, h * K + rk, mk, Dc, W)
                _shift(qkv, s_x, tail, n, H * K + h * K + rk, mk, Dc, W)
            if NORM:
                d = tl.arange(0, BVH)
                m = d < V
                # .cg: from L2, where the other programs' stores are, never from a stale L1 line
                of = tl.load(o + row + d, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                g = tl.load(gz + row + d, mask=m, other=0.0, cache_modifier=".cg")
                inv = tl.rsqrt(tl.sum(of * of, axis=0) / V + eps)
                tl.store(y + row + d, (of * inv * g).to(y.dtype.element_ty), mask=m)
            tl.atomic_xchg(counter + nh, 0, sem="relaxed", scope="gpu")
    if STAMPS:
        r = nh * NV + iv
        store_ends(stamps, r, 10, g_start, c_start, c_wait)
        store_max_at(stamps, r, 4, c_gate)
        store_max_at(stamps, r, 5, c_ogate)
        store_max_at(stamps, r, 6, c_conv)
        store_max_at(stamps, r, 7, c_norm)
        store_max_at(stamps, r, 8, c_pred)
        store_max_at(stamps, r, 9, c_out)


MAX_GRID_Y = 65535
"""CUDA's limit on a launch grid's second axis, where the decode kernel puts one program per (sequence, head):
``kda_decode_triton`` splits a larger batch (at H 32: 2,047 sequences a launch)."""


def decode_launch_config(N: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) of the decode kernel: two V blocks a head (at V 128) below 8 sequences, for more programs
    in a latency-bound step; from 8 up one (no arrival counter, no o through memory). H200, H 32, K = V = 128, the
    model's calls (the gates' projections in the kernel up to 8 sequences, PDL at one), graph replays, us a layer
    (``bench/kernels.py --only kdadecode``): at 1 sequence BV 64 on 4 warps 9.98 (128 on 4: 10.20, on 8: 12.78;
    32 on 2: 11.14); at 8, 128 on 4 18.79 (64 on 4: 22.88, 32 on 2: 25.70, 128 on 8: 27.84); at 32 without the
    gates' projections 128 on 4 47.66 (64 on 4: 53.90, 32 on 2: 54.64, 128 on 8: 92.69). With the gates read first
    (H100, the 48B shape's first 16 layers, 1 x 128K step, two alternations, ``bench/decode_48b.py --modes
    fused,kda-bv64w8,...``, 2026-12-06): 64 on 4 1.826 / 1.823 ms, 32 on 4 1.815 / 1.814 (its launches' stamped
    span longer, 10.2 us against 9.7: left as is until the H200 says), 64 on 8 1.835 / 1.835, 32 on 2 1.831 /
    1.834, 128 on 8 1.852 / 1.849."""
    return min(triton.next_power_of_2(V), 64 if N < 8 else 128), 4


def kda_decode_triton(
    qkv: Tensor, raw: Tensor, b: Tensor, conv_weight: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
    lower_bound: float | None, state: Tensor, slots: Tensor, scale: float,
    out_norm: tuple[Tensor, Tensor, float] | None = None, gate_proj: Tensor | None = None,
    out_gate_proj: Tensor | None = None, config: tuple[int, int] | None = None, pdl: bool = False,
) -> Tensor:
    """Shapes as :func:`kda_sessions.kernels.kda.decode.kda_decode` (validated there). Returns o [N, H, V], or
    with ``out_norm`` = (weight [V], gate [N, H*V] rows of unit column stride, eps) the gated norm of o. With
    ``gate_proj`` [H*K, KF], raw is [N, KF] and each head's gate logits are its rows of gate_proj times raw, in
    the kernel; likewise ``out_gate_proj`` [H*V, VF] with out_norm's gate [N, VF]. ``config``: the kernel's
    (BV, num_warps), default ``decode_launch_config``. ``pdl``: see ``kda_decode`` (on a device where
    ``kernels.moe.pdl.use_pdl``, else ignored). One launch (several above ``MAX_GRID_Y`` sequence-heads), on the
    device's ``head_counters`` where a head has several V blocks: launches that use them must not run
    concurrently (one stream)."""
    N, H = b.shape
    if N * H > MAX_GRID_Y:  # the decode kernel's grid holds N * H programs on its second axis: several launches
        per = MAX_GRID_Y // H
        return torch.cat([
            kda_decode_triton(
                qkv[i : i + per], raw[i : i + per], b[i : i + per], conv_weight, conv_state, A_log, dt_bias,
                lower_bound, state, slots[i : i + per], scale,
                None if out_norm is None else (out_norm[0], out_norm[1][i : i + per], out_norm[2]),
                gate_proj, out_gate_proj, config, pdl,
            )
            for i in range(0, N, per)
        ])
    K, V = state.shape[2:]
    W = conv_weight.shape[1]
    # the kernel reads b's columns, slots and the norm weight at unit stride: other views are copied first (the
    # model's are unit-stride already: nothing is copied, nothing more is captured in a CUDA graph)
    b = b if b.stride(1) == 1 else b.contiguous()
    slots = slots if slots.stride(0) == 1 else slots.contiguous()
    if out_norm is not None and out_norm[0].stride(0) != 1:
        out_norm = (out_norm[0].contiguous(), out_norm[1], out_norm[2])
    out = qkv.new_empty(N, H, V)
    if N == 0:
        return out
    BV, num_warps = config or decode_launch_config(N, V)
    NV = triton.cdiv(V, BV)
    pdl = pdl and use_pdl(qkv.device)
    launch = {"launch_pdl": True} if pdl else {}
    KF = 0 if gate_proj is None else gate_proj.shape[1]
    gw = raw if gate_proj is None else gate_proj  # a placeholder pointer where KF = 0
    if out_norm is None:
        nw, gate, eps, VF, ogw, o, gz = qkv, qkv, 0.0, 0, qkv, out, out
    else:
        nw, gate, eps = out_norm
        VF = 0 if out_gate_proj is None else out_gate_proj.shape[1]
        ogw = gate if out_gate_proj is None else out_gate_proj
        # with several V blocks a head, o and the blocks' weight * sigmoid(gate) go through memory to the last
        o, gz = (qkv.new_empty(N, H, V), torch.empty(N, H, V, dtype=torch.float32, device=qkv.device)) if NV > 1 \
            else (out, out)
    counter = head_counters(qkv.device, N * H) if NV > 1 else slots  # a placeholder pointer with one V block
    stamps = stamp_buffer("kda_decode", NV * N * H, qkv.device)
    _decode_kernel[(NV, N * H)](
        qkv, qkv.stride(0), raw, raw.stride(0), b, b.stride(0), conv_weight, conv_weight.stride(0),
        conv_weight.stride(1), conv_state, A_log, dt_bias, float(lower_bound or 0.0), state, slots, o, scale,
        gw, gw.stride(0), gate, gate.stride(0), nw, out, gz, float(eps), ogw, ogw.stride(0), counter,
        slots if stamps is None else stamps,
        H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=BV, BOUNDED=lower_bound is not None,
        KF=KF, BJ=min(32, triton.next_power_of_2(max(KF, 1))), NORM=out_norm is not None, VF=VF,
        BJO=min(32, triton.next_power_of_2(max(VF, 1))), BVH=triton.next_power_of_2(V), PDL=pdl,
        STAMPS=stamps is not None,
        num_warps=num_warps, **launch,
    )
    return out


_COUNTERS: dict[tuple[str, int | None], Tensor] = {}
_RETIRED: list[Tensor] = []


def head_counters(device: torch.device, n: int) -> Tensor:
    """At least ``n`` arrival counters on ``device``, one per (sequence, head) of a decode launch, zero between
    launches (each launch's last arrivers reset theirs). Made outside a CUDA graph capture, they are kept (and
    grown to a power of two, at least 1,024, when a launch needs more; the smaller ones are kept alive too, as a
    captured graph may still use them); during a capture without enough of them, fresh zeroed ones (a memset
    node in the graph). Launches on one stream never overlap in them: a PDL launch waits before it touches
    them."""
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is not None and c.numel() >= n:
        return c
    fresh = torch.zeros(max(1024, triton.next_power_of_2(n)), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        if c is not None:
            _RETIRED.append(c)
        _COUNTERS[key] = fresh
    return fresh


__all__ = ["decode_launch_config", "head_counters", "kda_decode_triton"]
