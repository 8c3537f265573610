"""Fused MoE in Triton: group the (token, expert) pairs by expert, then two grouped GEMMs over the stacked
expert weights in place (the approach of vLLM's fused_moe).

1. Align: the T * k pairs (``p = t * k + j``, expert ``chosen[t, j]``) are sorted by expert, stably, into
   ``sorted_ids``, each expert's run padded to a multiple of the row block BM with the sentinel ``T * k``;
   ``block_expert[b]`` is the expert of row block b and ``num_padded`` the used length. A single-program
   Triton kernel does it for few pairs (decode: one launch); torch ops (sort, cumsum, searchsorted) for many.
2. Up: each row block multiplies its pairs' token rows by ``w13[e]``'s gate and up columns in two accumulators
   and stores ``silu(gate) * up`` [T * k, F].
3. Down: each row block multiplies those rows by ``w2[e]`` and scales by the routing weight -> [T * k, D];
   the k rows of each token are summed into [T, D].

Few tokens (decode, ``DIRECT_MAX_TOKENS``) skip the grouping: the up kernel runs one program per (pair, column
block), reading the pair's expert rows straight from ``chosen``, and the down kernel one program per (token,
row block of D) that sums the token's k pairs itself (no [T * k, D] buffer, no reduction launch): two launches
a layer, GEMVs by multiply-and-sum with the whole reduction unrolled (every load of a program in flight).

The direct down kernel can also take the residual add and RMSNorm after the layer: its last program to finish
(an arrival counter, as the decode router's) adds and norms the few rows (``fused_moe_direct_add_norm``). On
Hopper both direct kernels are PDL launches (``pdl``): the down kernel's programs start while the up kernel ends
and load their first expert tiles before they wait for it.

Every launch has a grid fixed by the shapes (at most ``T * k + min(E, T * k) * (BM - 1)`` padded rows); row
blocks past ``num_padded`` return at once. No host sync anywhere, so a decode step is CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..linear import MATVEC_MAX_ROWS
from ..stamps import clock_after, clock_now, global_ns, stamp_buffer, store_at, store_ends, store_max_at
from ..tma import TensorDescriptor, tma_device
from .pdl import use_pdl
from .route import arrival_counters

ALIGN_KERNEL_MAX_PAIRS = 1024
"""Up to this many pairs the single-program align kernel groups them; above, torch ops do (prefill)."""


@dataclass(frozen=True)
class MoeLaunch:
    """Tile sizes of the two grouped GEMMs: rows BM (pairs), columns BN, reduction BK; ``down``: the down
    kernel's own (BN, BK, num_warps, num_stages), its rows still BM (the blocks of the grouping); None: the same
    as the up kernel's."""

    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    down: tuple[int, int, int, int] | None = None

    def down_tile(self) -> tuple[int, int, int, int]:
        """(BN, BK, num_warps, num_stages) of the down kernel."""
        return self.down or (self.BN, self.BK, self.num_warps, self.num_stages)


SMALL_BLOCK_PAIRS_PER_EXPERT = 8
"""``launch_config`` keeps 16-row blocks up to this many pairs per expert on average (with ``num_experts``): a short
prefill's experts then get a block or two each, not one 64-row block of mostly padding. 0: by ``num_pairs`` alone
(<= 256)."""


def launch_config(num_pairs: int, elem_size: int = 2, max_shared: int | None = None,
                  num_experts: int | None = None) -> MoeLaunch:
    """Few pairs (decode): 16-row blocks, each a GEMV-like read of one expert's tile; many pairs (prefill):
    64-row blocks that reuse each weight tile across rows. Chosen by ``bench/decode_48b.py --sweep`` on an H200
    (docs/benchmarks.md) for 2-byte weights, up to 256 pairs; the prefill tile (64 x 256, 8 warps, 3 stages) on an
    H100 (``--layers 2 --cases= --moe-tokens 512,2048,4096,8192 --greedy-steps 0 --sweep``, 2026-12-07): one layer
    1,430 / 1,718 / 2,220 / 3,383 us against 1,451 / 1,828 / 2,437 / 3,769 for 64 x 128 on 4 warps (8,192 tokens:
    307 TFLOP/s, 31% of peak; seven other tiles slower at every size); the down kernel's own tile there 256 x 64 on
    8 warps, 4 stages (its reduction is only F long: 8,192 tokens 1,098 us persistent through TMA, 1,191 at 3 stages,
    1,181 a program a tile; six other tiles slower, ``--sweep``'s "sweep down" entries); with ``num_experts``, 16-row
    blocks also up to
    ``SMALL_BLOCK_PAIRS_PER_EXPERT`` pairs per expert (a short prefill: 64 tokens are ~2 pairs an expert at 256
    experts, top 8 + the shared one). ``max_shared``: the device's shared memory per block (bytes);
    given, the pipeline gets fewer stages (then a shorter BK) until the up kernel's tiles of ``elem_size``-byte
    values fit in it (float32 prefill tiles at 4 stages need 240 KB, over an H200's 227)."""
    few = num_pairs <= 256 or (num_experts is not None and num_pairs <= SMALL_BLOCK_PAIRS_PER_EXPERT * num_experts)
    cfg = (MoeLaunch(BM=16, BN=64, BK=128, num_warps=4, num_stages=4) if few
           else MoeLaunch(BM=64, BN=256, BK=64, num_warps=8, num_stages=3, down=(256, 64, 8, 4)))
    if max_shared is None:
        return cfg
    while _up_shared_bytes(cfg, elem_size) > max_shared:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.BK > 16:
            cfg = replace(cfg, BK=cfg.BK // 2)
        else:
            break
    while _down_shared_bytes(cfg, elem_size) > max_shared:
        dn, dk, dw, ds = cfg.down_tile()
        if ds > 2:
            cfg = replace(cfg, down=(dn, dk, dw, ds - 1))
        elif dk > 16:
            cfg = replace(cfg, down=(dn, dk // 2, dw, ds))
        else:
            break
    return cfg


def _up_shared_bytes(cfg: MoeLaunch, elem_size: int) -> int:
    """Shared memory of ``_up_kernel`` (the larger of the two): the x tile and both weight tiles, buffered
    num_stages - 1 times, with 8 KB spare for Triton's own scratch."""
    return (cfg.num_stages - 1) * (cfg.BM * cfg.BK + 2 * cfg.BK * cfg.BN) * elem_size + 8192


def _down_shared_bytes(cfg: MoeLaunch, elem_size: int) -> int:
    """Shared memory of ``_down_kernel_tma``: its flattened loop buffers the act and weight tiles num_stages
    times, with 16 KB spare."""
    dn, dk, _, ds = cfg.down_tile()
    return ds * (cfg.BM * dk + dn * dk) * elem_size + 16384


@functools.cache
def max_shared_bytes(device: torch.device) -> int:
    """Shared memory a block may opt in to on ``device`` (99 KB where torch does not say)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


DIRECT_MAX_TOKENS = 16
"""Up to this many tokens ``fused_moe_triton`` runs the direct kernels (no align step)."""


ADD_NORM_MAX_TOKENS = 1
"""Up to this many tokens ``fused_moe_add_norm`` norms in the down kernel's last program. That program adds and
norms the rows one after another while the rest of the GPU idles: a launch less pays at one token; with it at
every direct batch the 8 x 32K step replay measured 8.36 ms on the H200, at one token only 7.95."""


@dataclass(frozen=True)
class DirectLaunch:
    """Tiles of the direct (decode) kernels: up, BN_UP columns of w1 and of w3 by BK_UP of the width a step;
    down, BN_DOWN rows of D by BK_DOWN of F a step, the first weight tiles of the token's first PRE_DOWN pairs (0,
    1 or 2) loaded before the PDL wait (``pdl``); at one token GROUP_DOWN pairs a reduction (more tokens: all k
    pairs in one, the grid is large enough that programs holding all their loads at once still fill the GPU)."""

    BN_UP: int
    BK_UP: int
    WARPS_UP: int
    BN_DOWN: int
    BK_DOWN: int
    WARPS_DOWN: int
    PRE_DOWN: int = 2
    GROUP_DOWN: int = 2


FIXED_FIRST = True
"""Given the always-on expert of every token's last pair (``fused_moe_direct_add_norm``'s ``always_on``: the
shared expert), the up kernel's programs of that expert come first in its grid and read their weight rows before
the PDL wait, while the router still selects (``_up_direct_kernel``). Against off (``bench/decode_48b.py
--layers 16`` mode ``old-shared``; an H100, the first 16 layers of the 48B shape: 15 MoE layers; two alternations,
2026-12-06): 1 x 128K 1.904 / 1.905 ms against 1.926 / 1.930 (-23 us), 1 x 1M 3.268 / 3.272 against 3.303 /
3.293 (-28 us), ~1.5-1.9 us a MoE layer; the greedy tokens and logits the same bits. Not yet timed on the H200."""




DIRECT_LAUNCH = DirectLaunch(2, 512, 2, 2, 512, 2, 2, 2)
"""Two rows a program on two warps, both kernels: the fastest of ``bench/decode_48b.py --sweep``'s direct tiles on
the H200 at the 48B shape (D 2304, F 1024, 9 experts a token), at 1 and at 8 tokens (docs/benchmarks.md). At one
token the down kernel reduces every two pairs: 96 registers, so its 1,152 programs are all resident at once; one
reduction for all nine takes 138 and measured slower (``--moe-chain 1 --chain-sweep``, H200: the MoE block 40.6 us
a layer against 42.3, a reduction after every pair 42.3).

Up and down as one launch, the down programs after the up ones in the grid, each spinning on per-pair counts of
the up programs done (H200, bits equal): the MoE block 51.2-51.6 us a layer against 40.6, the 1 x 128K
step 2.65-2.69 ms against 2.44, 1 x 1M 4.29-4.32 against 4.06, with or without a sleep in the spin. A grid's
programs start in order, so its down programs start only once every up program has, where the down launch's
programs (PDL) are resident from the start of the up launch, loading their first tiles."""


GROUPED_TMA = True
"""The grouped GEMMs (``_up_kernel_tma``, ``_down_kernel_tma``) read the experts' rows, and the down kernel its
input, through TMA descriptors from ``GROUPED_TMA_MIN_PAIRS`` pairs, where the device has TMA (sm_90 on) and the
layout allows (``_tma_fits``); else, or False: pointer loads throughout (``_up_kernel``, ``_down_kernel``)."""

GROUPED_TMA_MIN_PAIRS = 32768
"""One MoE layer of the 48B shape (`bench/decode_48b.py --layers 2 --cases= --moe-tokens 32,64,128,512,2048,8192
--greedy-steps 0`, H100, 2026-12-07): 8,192 tokens (73,728 pairs) 3,006 us through TMA against 3,289 with pointer
loads (up 1,626 us, 43% of peak; down, persistent, 1,098); 32-2,048 tokens 3-6% slower through TMA (759 / 729 us at
32, 1,751 / 1,695 at 2,048)."""


def _tma_fits(x: Tensor, w13: Tensor, w2: Tensor, cfg: MoeLaunch) -> bool:
    """Whether the TMA kernels can take these tensors: each weight stack viewable as 2-D rows, rows and bases
    16-byte aligned, blocks within TMA's 256 a side and at least 16 bytes wide. CPU tensors (the interpreter) pass."""
    if not tma_device(x.device):
        return False
    e = x.element_size()
    F2 = w13.shape[1]
    rows_2d = w13.stride(0) == F2 * w13.stride(1) and w2.stride(0) == w2.shape[1] * w2.stride(1)
    aligned = all(t.data_ptr() % 16 == 0 for t in (w13, w2)) and all(
        v * e % 16 == 0 for v in (w13.stride(1), w2.stride(1), F2 // 2))
    dn, dk = cfg.down_tile()[:2]
    return rows_2d and aligned and min(cfg.BK, dk) * e >= 16 and max(cfg.BM, cfg.BN, cfg.BK, dn, dk) <= 256


def max_padded(num_pairs: int, num_experts: int, BM: int) -> int:
    """An upper bound of the padded length that depends on shapes only: every non-empty expert pads < BM rows."""
    return num_pairs + min(num_experts, num_pairs) * (BM - 1)


@triton.jit
def _fill_sentinel(sorted_ids, num_pairs, maxp, BF: tl.constexpr):
    """sorted_ids[:maxp] = num_pairs (the padding rows' pair), then a barrier: the fill lands before the caller's
    scatter overwrites some of it."""
    f = tl.arange(0, BF)
    for r0 in range(0, maxp, BF):
        tl.store(sorted_ids + r0 + f, num_pairs, mask=r0 + f < maxp)
    tl.debug_barrier()


@triton.jit
def _store_block_experts(block_expert, ends, E: tl.constexpr, maxp, EP: tl.constexpr, BM: tl.constexpr,
                         BB: tl.constexpr):
    """block_expert[b] for every block of BM rows: the experts whose padded run (ending at ``ends`` [EP]) ends at
    or before the block's first row precede it, so their count is its expert."""
    e_ok = tl.arange(0, EP) < E
    b = tl.arange(0, BB)
    num_blocks = maxp // BM
    for b0 in range(0, num_blocks, BB):
        start = (b0 + b) * BM  # [BB]
        eb = tl.sum(((ends[None, :] <= start[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert + b0 + b, eb, mask=b0 + b < num_blocks)


@triton.jit
def _align_kernel(
    chosen, sorted_ids, block_expert, num_padded, num_pairs, maxp,
    E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BB: tl.constexpr, BF: tl.constexpr,
):
    """One program. chosen [num_pairs] -> sorted_ids [maxp], block_expert [maxp // BM], num_padded [1]. The sizes
    are runtime values, so a new batch size needs no new compile."""
    e = tl.arange(0, EP)
    i = tl.arange(0, BP)
    # counts per expert, by a one-hot sum over chunks of BP pairs
    counts = tl.zeros([EP], dtype=tl.int32)
    for p0 in range(0, num_pairs, BP):
        valid = p0 + i < num_pairs
        ids = tl.load(chosen + p0 + i, mask=valid, other=0).to(tl.int32)
        hot = (ids[:, None] == e[None, :]) & valid[:, None]  # [BP, EP]
        counts += tl.sum(hot.to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    run = ends - padded  # next free row of each expert
    total = tl.sum(padded, axis=0)
    tl.store(num_padded, total)
    _fill_sentinel(sorted_ids, num_pairs, maxp, BF)
    for p0 in range(0, num_pairs, BP):
        valid = p0 + i < num_pairs
        ids = tl.load(chosen + p0 + i, mask=valid, other=0).to(tl.int32)
        hot = (ids[:, None] == e[None, :]) & valid[:, None]  # [BP, EP]
        base = tl.sum(tl.where(hot, run[None, :], 0), axis=1)  # [BP] next row of the pair's expert
        same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]  # [BP, BP]
        rank = tl.sum(same.to(tl.int32), axis=1)  # earlier pairs of this chunk on the same expert: stable
        tl.store(sorted_ids + base + rank, p0 + i, mask=valid)
        run += tl.sum(hot.to(tl.int32), axis=0)
    _store_block_experts(block_expert, ends, E, maxp, EP, BM, BB)


@triton.jit
def _align_sort_kernel(
    chosen, sorted_ids, block_expert, num_padded, num_pairs, maxp,
    E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BB: tl.constexpr, BF: tl.constexpr,
):
    """``_align_kernel``'s grouping with no loop over the pairs (num_pairs <= BP): every pair loaded at once, the
    counts by one histogram, each pair's rank within its expert from one sort of (expert, pair) keys: the i-th
    smallest key's pair goes to row i + (its expert's first padded row - its first sorted position)."""
    i = tl.arange(0, BP)
    valid = i < num_pairs
    ids = tl.load(chosen + i, mask=valid, other=0).to(tl.int32)
    e = tl.arange(0, EP)
    counts = tl.histogram(ids, EP) - tl.where(e == 0, BP - num_pairs, 0)  # the padding was counted at expert 0
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    offset = (ends - padded) - (tl.cumsum(counts, axis=0) - counts)
    tl.store(num_padded, tl.sum(padded, axis=0))
    _fill_sentinel(sorted_ids, num_pairs, maxp, BF)
    key = tl.sort(tl.where(valid, ids * BP + i, EP * BP + i))  # the padding's keys last
    expert = tl.minimum(key // BP, EP - 1)
    tl.store(sorted_ids + i + tl.gather(offset, expert, 0), key % BP, mask=valid)
    _store_block_experts(block_expert, ends, E, maxp, EP, BM, BB)


ALIGN_CONFIG: tuple[int, int, int] | tuple[str, int, int] = ("sort", 1024, 4)
"""("sort", sentinel rows written at once, warps) for ``_align_sort_kernel``, or ``_align_kernel``'s (pairs a loop
iteration takes, sentinel rows, warps). H100, one launch replayed (``bench/moe_align.py``): 144 / 576 / 1,017 pairs
7.6 / 16.5 / 17.0 us sorted, against 17.7 / 43.7 / 114.1 for the loop kernel's (64, 64, 4)."""


def align_triton(chosen: Tensor, num_experts: int, BM: int,
                 config: tuple[int, int, int] | tuple[str, int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """chosen [T, k] -> (sorted_ids [maxp] int32, block_expert [maxp // BM] int32, num_padded [1] int32), maxp
    from ``max_padded`` rounded up to BM. ``config``: ``ALIGN_CONFIG``'s, for a benchmark."""
    P = chosen.numel()
    maxp = triton.cdiv(max_padded(P, num_experts, BM), BM) * BM
    dev = chosen.device
    sorted_ids = torch.empty(maxp, dtype=torch.int32, device=dev)
    block_expert = torch.empty(maxp // BM, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    bp, bf, warps = config or ALIGN_CONFIG
    EP = triton.next_power_of_2(num_experts)
    if bp == "sort" and P <= ALIGN_KERNEL_MAX_PAIRS:
        _align_sort_kernel[(1,)](
            chosen.reshape(-1), sorted_ids, block_expert, num_padded, P, maxp,
            E=num_experts, EP=EP, BM=BM, BP=max(16, triton.next_power_of_2(P)), BB=64, BF=bf, num_warps=warps,
        )
        return sorted_ids, block_expert, num_padded
    BP = min(bp if isinstance(bp, int) else 64, max(16, triton.next_power_of_2(P)))
    _align_kernel[(1,)](
        chosen.reshape(-1), sorted_ids, block_expert, num_padded, P, maxp,
        E=num_experts, EP=EP, BM=BM, BP=BP, BB=64, BF=bf, num_warps=warps,
    )
    return sorted_ids, block_expert, num_padded


def align_torch(chosen: Tensor, num_experts: int, BM: int) -> tuple[Tensor, Tensor, Tensor]:
    """The same grouping as ``align_triton`` from torch ops (a stable sort), for many pairs; no host sync."""
    flat = chosen.reshape(-1).long()  # [P]
    P, dev = flat.numel(), flat.device
    maxp = triton.cdiv(max_padded(P, num_experts, BM), BM) * BM
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    ends = padded.cumsum(0)
    sorted_e, order = torch.sort(flat, stable=True)  # pairs by expert, in pair order within an expert
    first = counts.cumsum(0) - counts  # index in ``order`` of each expert's first pair
    rows = (ends - padded)[sorted_e] + torch.arange(P, device=dev) - first[sorted_e]
    sorted_ids = torch.full((maxp,), P, dtype=torch.int32, device=dev)
    sorted_ids.index_copy_(0, rows, order.to(torch.int32))
    starts = torch.arange(0, maxp, BM, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _up_kernel(
    x, w13, act, sorted_ids, block_expert, num_padded, num_pairs, D, Fw,
    stride_x, stride_we, stride_wn, stride_a,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """act[p] = silu(x[p // k] @ w1[e].T) * (x[p // k] @ w3[e].T) for the pairs p of row block program_id(0)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded):
        return
    ex = tl.load(block_expert + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BM + tl.arange(0, BM))  # [BM] pair ids; num_pairs pads
    valid = rows < num_pairs
    tok = (rows // TOP_K).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < Fw
    kk = tl.arange(0, BK)
    a_ptr = x + tok[:, None] * stride_x + kk[None, :]  # [BM, BK]
    g_ptr = w13 + ex * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BK, BN]: w1[e].T
    u_ptr = g_ptr + Fw * stride_wn  # w3[e].T
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = kk < D - k0
        a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(u_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
        a_ptr += BK
        g_ptr += BK
        u_ptr += BK
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out = act + rows[:, None].to(tl.int64) * stride_a + n[None, :]
    tl.store(out, h.to(act.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act, w2, y, route_w, sorted_ids, block_expert, num_padded, num_pairs, D, Fw,
    stride_a, stride_we, stride_wn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """y[p] = route_w[p] * act[p] @ w2[e].T for the pairs p of row block program_id(0)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded):
        return
    ex = tl.load(block_expert + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids + pid_m * BM + tl.arange(0, BM))
    valid = rows < num_pairs
    r64 = rows.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < D
    kk = tl.arange(0, BK)
    a_ptr = act + r64[:, None] * stride_a + kk[None, :]  # [BM, BK]
    w_ptr = w2 + ex * stride_we + n[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BK, BN]: w2[e].T
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, Fw, BK):
        k_ok = kk < Fw - k0
        a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptr += BK
        w_ptr += BK
    rw = tl.load(route_w + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    out = y + r64[:, None] * stride_y + n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _up_kernel_tma(
    x, w_desc, act, sorted_ids, block_expert, num_padded, num_pairs, D, Fw, stride_x, stride_a,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """``_up_kernel`` with the expert's rows read through a TMA descriptor of w13 as [E * 2F, D] (gate rows at
    ``e * 2F``, up rows ``F`` after) and ``act`` stored in sorted order (padded rows 0): the down kernel reads it
    back through a descriptor. Rows past F of the last column block come from the next rows of w13 (or zeros
    past its end): they feed only act's columns past F, which the store masks. (A persistent loop, as the down
    kernel's, was slower here: 1,766 us against 1,616 at 8,192 tokens, H100, its pipeline one stage shorter.)"""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(num_padded):
        return
    ex = tl.load(block_expert + pid_m)
    rows = tl.load(sorted_ids + pid_m * BM + tl.arange(0, BM))
    valid = rows < num_pairs
    kk = tl.arange(0, BK)
    a_ptr = x + (rows // TOP_K).to(tl.int64)[:, None] * stride_x + kk[None, :]  # [BM, BK]
    g_row = ex * 2 * Fw + pid_n * BN
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = tl.load(a_ptr, mask=valid[:, None] & (kk < D - k0)[None, :], other=0.0)
        wg = w_desc.load([g_row, k0])  # [BN, BK]; past D: zeros
        wu = w_desc.load([g_row + Fw, k0])
        if IEEE:
            acc_g = tl.dot(a, wg.T, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu.T, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg.T, acc_g)
            acc_u = tl.dot(a, wu.T, acc_u)
        a_ptr += BK
    h = acc_g * tl.sigmoid(acc_g) * acc_u  # padded rows: 0
    n = pid_n * BN + tl.arange(0, BN)
    out = act + (pid_m * BM + tl.arange(0, BM))[:, None].to(tl.int64) * stride_a + n[None, :]
    tl.store(out, h.to(act.dtype.element_ty), mask=(n < Fw)[None, :])


@triton.jit
def _down_kernel_tma(
    act_desc, w_desc, y, route_w, sorted_ids, block_expert, num_padded, num_pairs, D, Fw, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """``_down_kernel`` as a persistent loop over the (row block, column block) tiles, column block major (the
    programs at work at once share each expert's weight tile), flattened so that the next tile's first loads
    overlap this tile's last products and its store (the reduction is short: F). The sorted act rows and w2 as
    [E * D, F] come through TMA descriptors; rows past D of the last column block feed only the columns the
    store masks."""
    blocks = tl.load(num_padded) // BM
    for tile in tl.range(tl.program_id(0), blocks * tl.cdiv(D, BN), tl.num_programs(0), flatten=True):
        pid_m = tile % blocks
        pid_n = tile // blocks
        ex = tl.load(block_expert + pid_m)
        rows = tl.load(sorted_ids + pid_m * BM + tl.arange(0, BM))
        valid = rows < num_pairs
        w_row = ex * D + pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, Fw, BK):
            a = act_desc.load([pid_m * BM, k0])  # past F: zeros
            w = w_desc.load([w_row, k0])
            if IEEE:
                acc = tl.dot(a, w.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.T, acc)
        rw = tl.load(route_w + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        n = pid_n * BN + tl.arange(0, BN)
        out = y + rows[:, None].to(tl.int64) * stride_y + n[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=valid[:, None] & (n < D)[None, :])


@triton.jit
def _up_rows(x_row, w13, chosen, p, n, n_ok, stride_we, stride_wn, D: tl.constexpr, Fw: tl.constexpr,
             BK: tl.constexpr):
    """(w1[e][n] . x, w3[e][n] . x) for pair p's expert e = chosen[p] and the rows n (mask n_ok), float32: the
    whole width in BK-column steps, unrolled (every load in flight at once)."""
    ex = tl.load(chosen + p).to(tl.int64)
    kk = tl.arange(0, BK)
    g_ptr = w13 + ex * stride_we + n[:, None].to(tl.int64) * stride_wn + kk[None, :]  # [BN, BK] of w1[e]
    u_ptr = g_ptr + Fw * stride_wn  # w3[e]
    acc_g = tl.zeros(g_ptr.shape, dtype=tl.float32)
    acc_u = tl.zeros(g_ptr.shape, dtype=tl.float32)
    for k0 in tl.static_range(0, D, BK):
        k_ok = k0 + kk < D
        xv = tl.load(x_row + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(g_ptr + k0, mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(u_ptr + k0, mask=m, other=0.0).to(tl.float32) * xv
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def _up_direct_kernel(
    x, w13, act, chosen, stride_x, stride_we, stride_wn, stride_a, T, fixed,
    D: tl.constexpr, Fw: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
    FIXED: tl.constexpr = False, D1: tl.constexpr = 16, DR: tl.constexpr = 16,
):
    """act[p, n] = silu(w1[e][n] . x[p // k]) * (w3[e][n] . x[p // k]), e = chosen[p], for the BN columns n of
    program (p, n block). Without FIXED, program (p, n block) is (program_id(0), program_id(1)).

    With FIXED every token's last pair is expert ``fixed`` (a shared expert, ``moe_route``'s ``always_on``): the
    grid is one axis whose first T * cdiv(Fw, BN) programs are those pairs (launched first, so resident first), and
    they load their whole weight rows (D1 + DR columns: D's largest power of two and the rest, padded) before the
    PDL wait, while the router before them still selects: that expert's bytes leave the launch's critical path.
    The other programs follow in the order of the two-axis grid."""
    n_blocks: tl.constexpr = (Fw + BN - 1) // BN
    if FIXED:
        pid = tl.program_id(0)
        is_fixed = pid < T * n_blocks
        if TOP_K == 1:
            p = pid // n_blocks
            nb = pid % n_blocks
        else:
            q = tl.maximum(pid - T * n_blocks, 0)
            rest = T * (TOP_K - 1)  # the other pairs, pair index fastest as in the two-axis grid
            r = q % rest
            p = tl.where(is_fixed, (pid // n_blocks) * TOP_K + TOP_K - 1, (r // (TOP_K - 1)) * TOP_K + r % (TOP_K - 1))
            nb = tl.where(is_fixed, pid % n_blocks, q // rest)
        n = nb * BN + tl.arange(0, BN)
        n_ok = n < Fw
        k1 = tl.arange(0, D1)
        k2 = D1 + tl.arange(0, DR)
        f_rows = w13 + fixed.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
        # the other programs load nothing here (masked by rows: the columns' masks stay constexpr, 16-byte loads)
        n_pre = n < tl.where(is_fixed, Fw, 0)
        m1 = n_pre[:, None] & (k1 < D)[None, :]
        m2 = n_pre[:, None] & (k2 < D)[None, :]
        g1 = tl.load(f_rows + k1[None, :], mask=m1, other=0.0)  # [BN, D1]: before the wait
        g2 = tl.load(f_rows + k2[None, :], mask=m2, other=0.0)
        u1 = tl.load(f_rows + Fw * stride_wn + k1[None, :], mask=m1, other=0.0)
        u2 = tl.load(f_rows + Fw * stride_wn + k2[None, :], mask=m2, other=0.0)
    else:
        p = tl.program_id(0)
        nb = tl.program_id(1)
        n = nb * BN + tl.arange(0, BN)
        n_ok = n < Fw
    if PDL:
        gdc_wait()  # x and chosen are the router's outputs
        # only after the wait: the down kernel's prologue reads the router's outputs too
        gdc_launch_dependents()
    tok = p // TOP_K
    x_row = x + tok.to(tl.int64) * stride_x
    if FIXED:
        if is_fixed:
            x1 = tl.load(x_row + k1, mask=k1 < D, other=0.0).to(tl.float32)[None, :]
            x2 = tl.load(x_row + k2, mask=k2 < D, other=0.0).to(tl.float32)[None, :]
            g = tl.sum(g1.to(tl.float32) * x1, axis=1) + tl.sum(g2.to(tl.float32) * x2, axis=1)
            u = tl.sum(u1.to(tl.float32) * x1, axis=1) + tl.sum(u2.to(tl.float32) * x2, axis=1)
        else:
            g, u = _up_rows(x_row, w13, chosen, p, n, n_ok, stride_we, stride_wn, D, Fw, BK)
    else:
        g, u = _up_rows(x_row, w13, chosen, p, n, n_ok, stride_we, stride_wn, D, Fw, BK)
    h = g * tl.sigmoid(g) * u
    tl.store(act + p.to(tl.int64) * stride_a + n, h.to(act.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_direct_kernel(
    act, w2, y, chosen, route_w, stride_a, stride_we, stride_wn, stride_y,
    res, norm_w, s_out, h_out, counter, T, eps,
    D: tl.constexpr, Fw: tl.constexpr, TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NORM: tl.constexpr, BD: tl.constexpr, PRE: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    TRIGGER: tl.constexpr = False, stamps=None, STAMPS: tl.constexpr = False,
):
    """y[t, n] = sum_j route_w[t, j] * (w2[e_j][n] . act[t * k + j]) for the BN rows n of program (t, n block):
    the products of GROUP pairs at a time summed in one [BN, BK] accumulator (routing weight folded into the
    activation), then reduced: no barrier stands between the loads of a group's experts. The first PRE (<= 2) pairs'
    first weight tiles are loaded before the PDL wait: their expert ids are the router's, which every program of
    the up kernel waited for before this launch could start; act is the up kernel's. (Asking the L2 for the other
    pairs' rows there too, ``prefetch.global.L2`` at normal or ``evict_last`` priority, measured slower on the H200:
    the 1 x 128K step 2.57 ms against 2.44, 1 x 1M 4.19 against 4.06 / 4.11. Loading every pair's id and routing
    weight before the wait, as a vector, one reduction per pair to pick its own: the 1 x 1M step 37 us slower.) With NORM the last program
    to finish (an arrival counter, reset by it) adds the T rows of y to the residual rows res [T, D] and norms
    them as ``kernels.norm.add_rms_norm`` does: s_out = res + y, h_out = rms_norm(s_out) * norm_w (both [T, D]
    contiguous). With TRIGGER (a PDL launch of up to ``linear.MATVEC_MAX_ROWS`` tokens, whose next launch, the next
    layer's input projection, is then a PDL matvec) each program lets the next launch start after its wait. (Each
    program adding the residual to its own rows, no counter, and the norm left to the next layer's input matvec,
    each of whose programs norms the row itself: 84 us slower, the 1 x 128K step of the 48B shape 2.515 ms against
    2.431, H200, 2026-12-05. Triggering at this kernel's start instead, so that the matvec's weights load during
    its tail: within noise, ``route._route_decode_kernel``'s docstring has the figures.)

    With STAMPS (``kernels.stamps``) program (t, n block) stores its phases' clock readings in row t *
    num_programs(1) + n block of ``stamps``: [2] start, [3] after the wait, [4] its rows of y summed, [5] arrived
    (with NORM; else [4] again), [6] end (the last program's add and norm included)."""
    if STAMPS:
        g_start = global_ns()
        c_start = clock_now()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < D
    kk = tl.arange(0, BK)
    w_rows = w2 + n[:, None].to(tl.int64) * stride_wn + kk[None, :]  # [BN, BK]: rows n of an expert's w2
    ex_a = tl.load(chosen + t * TOP_K).to(tl.int64)
    if PRE > 0:
        w_a = tl.load(w_rows + ex_a * stride_we, mask=n_ok[:, None] & (kk < Fw)[None, :], other=0.0)
    if PRE > 1:
        ex_b = tl.load(chosen + t * TOP_K + 1).to(tl.int64)
        w_b = tl.load(w_rows + ex_b * stride_we, mask=n_ok[:, None] & (kk < Fw)[None, :], other=0.0)
    if PDL:
        gdc_wait()  # act is the up kernel's output
    if STAMPS:
        c_wait = clock_now()
    if TRIGGER:
        # the next launch may start (the next layer's input matvec: its weight streams while this one ends),
        # after the wait as the up kernel's: a dependent's prologue runs once the up kernel and the router are done
        gdc_launch_dependents()
    acc = tl.zeros([BN], dtype=tl.float32)
    part = tl.zeros([BN, BK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = t * TOP_K + j
        if j == 0:
            ex = ex_a
        elif j == 1 and PRE > 1:
            ex = ex_b
        else:
            ex = tl.load(chosen + p).to(tl.int64)
        rw = tl.load(route_w + p).to(tl.float32)
        a_ptr = act + p.to(tl.int64) * stride_a + kk
        for k0 in tl.static_range(0, Fw, BK):
            k_ok = k0 + kk < Fw
            a = tl.load(a_ptr + k0, mask=k_ok, other=0.0).to(tl.float32) * rw
            if k0 == 0 and j == 0 and PRE > 0:
                w = w_a
            elif k0 == 0 and j == 1 and PRE > 1:
                w = w_b
            else:
                w = tl.load(w_rows + ex * stride_we + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            part += w.to(tl.float32) * a[None, :]
        if (j + 1) % GROUP == 0 or j == TOP_K - 1:  # GROUP pairs a reduction
            acc += tl.sum(part, axis=1)  # [BN]
            part = tl.zeros([BN, BK], dtype=tl.float32)
    if STAMPS:
        c_sum = clock_after(acc)
    tl.store(y + t.to(tl.int64) * stride_y + n, acc.to(y.dtype.element_ty), mask=n_ok)
    if NORM:
        tl.debug_barrier()  # every thread's rows of y are written before this program's arrival is released
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if STAMPS:
            c_arrive = clock_after(arrived)
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            d = tl.arange(0, BD)
            d_ok = d < D
            nw = tl.load(norm_w + d, mask=d_ok, other=0.0).to(tl.float32)
            for r in range(T):  # T * D is small (a decode batch): int32 offsets
                yv = tl.load(y + r * stride_y + d, mask=d_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                v = (tl.load(res + r * D + d, mask=d_ok, other=0.0).to(tl.float32) + yv).to(s_out.dtype.element_ty)
                tl.store(s_out + r * D + d, v, mask=d_ok)
                v = v.to(tl.float32)
                inv = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
                tl.store(h_out + r * D + d, (v * inv * nw).to(h_out.dtype.element_ty), mask=d_ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    if STAMPS:
        r = t * tl.num_programs(1) + tl.program_id(1)
        store_ends(stamps, r, 6, g_start, c_start, c_wait)
        store_max_at(stamps, r, 4, c_sum)
        if NORM:
            store_at(stamps, r, 5, c_arrive)
        else:
            store_max_at(stamps, r, 5, c_sum)


def fused_moe_direct(
    x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, cfg: DirectLaunch | None = None
) -> Tensor:
    """``fused_moe_triton`` for few tokens in two launches, no grouping: up over (pair, column block), down over
    (token, row block) summing the token's k pairs. Same arguments; chosen and weights are made contiguous."""
    return _direct(x, w13, w2, chosen, weights, cfg, None)[0]


def fused_moe_direct_add_norm(
    x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, res: Tensor, norm_weight: Tensor,
    eps: float, cfg: DirectLaunch | None = None, always_on: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``fused_moe_direct`` and the residual add and RMSNorm after it, in its two launches (the last program of
    the down kernel adds and norms the few rows): res [T, D], norm_weight [D] -> (s = res + moe(x), h =
    rms_norm(s) * norm_weight), both [T, D] in x's dtype, as ``kernels.norm.add_rms_norm`` gives them.
    ``always_on``: the expert id of chosen's last column in every row (``moe_route``'s), whose up rows the up
    kernel then reads before its PDL wait (``FIXED_FIRST``); that column is not read."""
    _, s, h = _direct(x, w13, w2, chosen, weights, cfg, (res, norm_weight, eps), always_on)
    assert s is not None and h is not None
    return s, h


def _direct(
    x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, cfg: DirectLaunch | None,
    add_norm: tuple[Tensor, Tensor, float] | None, fixed: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    T, D = x.shape
    F2 = w13.shape[1]
    Fw = F2 // 2
    k = chosen.shape[1]
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dimension"
    c = cfg or DIRECT_LAUNCH
    x = x.contiguous()
    flat = chosen.reshape(-1).contiguous()
    route_w = weights.reshape(-1).contiguous()
    act = torch.empty(T * k, Fw, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    launch = {"launch_pdl": True} if pdl else {}
    bk_up = min(c.BK_UP, max(16, triton.next_power_of_2(D)))
    n_blocks = triton.cdiv(Fw, c.BN_UP)
    pre_fixed = fixed is not None and FIXED_FIRST
    d1 = 1 << (D.bit_length() - 1)  # D's largest power of two, then the rest (padded) for the fixed expert's rows
    _up_direct_kernel[(T * k * n_blocks,) if pre_fixed else (T * k, n_blocks)](
        x, w13, act, flat, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), T, fixed or 0,
        D=D, Fw=Fw, TOP_K=k, BN=c.BN_UP, BK=bk_up, PDL=pdl, FIXED=pre_fixed, D1=d1,
        DR=max(16, triton.next_power_of_2(D - d1)), num_warps=c.WARPS_UP, **launch,
    )
    y = torch.empty_like(x)
    if add_norm is None:
        res, norm_w, s, h, eps, counter = x, x, None, None, 0.0, flat
    else:
        res, norm_w, eps = add_norm
        res = res.contiguous()
        s, h = torch.empty_like(x), torch.empty_like(x)
        counter = arrival_counters(x.device)[1:]  # the router uses [0]: launches on one stream never overlap
    bk_down = min(c.BK_DOWN, max(16, triton.next_power_of_2(Fw)))
    assert 0 <= c.PRE_DOWN <= 2 and c.GROUP_DOWN >= 1, f"PRE_DOWN must be 0, 1 or 2 and GROUP_DOWN >= 1, got {c}"
    stamps = stamp_buffer("moe_down", T * triton.cdiv(D, c.BN_DOWN), x.device)
    _down_direct_kernel[(T, triton.cdiv(D, c.BN_DOWN))](
        act, w2, y, flat, route_w, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        res, norm_w, y if s is None else s, y if h is None else h, counter, T, float(eps),
        D=D, Fw=Fw, TOP_K=k, BN=c.BN_DOWN, BK=bk_down, NORM=add_norm is not None,
        BD=triton.next_power_of_2(D), PRE=min(c.PRE_DOWN, k), GROUP=min(c.GROUP_DOWN, k) if T == 1 else k,
        PDL=pdl, TRIGGER=pdl and T <= MATVEC_MAX_ROWS, stamps=stamps, STAMPS=stamps is not None,
        num_warps=c.WARPS_DOWN, **launch,
    )
    return y, s, h


def fused_moe_triton(
    x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, cfg: MoeLaunch | None = None,
    direct: bool | None = None, tma: bool | None = None,
) -> Tensor:
    """x [T, D], w13 [E, 2F, D], w2 [E, D, F], chosen [T, k], weights [T, k] -> [T, D] (see ``fused_moe``).
    The weights' last dimension must be contiguous; x is made contiguous. ``direct``: the decode kernels
    (``fused_moe_direct``) rather than the grouped ones; None: when T <= ``DIRECT_MAX_TOKENS`` and no ``cfg``.
    ``tma``: the grouped kernels through TMA descriptors; None: ``GROUPED_TMA`` from ``GROUPED_TMA_MIN_PAIRS``
    pairs where ``_tma_fits``."""
    T, D = x.shape
    E, F2, _ = w13.shape
    Fw = F2 // 2
    k = chosen.shape[1]
    P = T * k
    if P == 0:
        return torch.zeros_like(x)
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need a contiguous last dimension"
    if direct is None:
        direct = cfg is None and T <= DIRECT_MAX_TOKENS
    if direct:
        return fused_moe_direct(x, w13, w2, chosen, weights)
    cfg = cfg or launch_config(P, x.element_size(), max_shared_bytes(x.device) if x.device.type == "cuda" else None, E)
    x = x.contiguous()
    align = align_triton if P <= ALIGN_KERNEL_MAX_PAIRS else align_torch
    sorted_ids, block_expert, num_padded = align(chosen, E, cfg.BM)
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    if tma is None:
        tma = GROUPED_TMA and P >= GROUPED_TMA_MIN_PAIRS and _tma_fits(x, w13, w2, cfg)
    if tma:
        return _grouped_tma(x, w13, w2, weights, sorted_ids, block_expert, num_padded, cfg, k)
    act = torch.empty(P, Fw, dtype=x.dtype, device=x.device)
    _up_kernel[(blocks, triton.cdiv(Fw, cfg.BN))](
        x, w13, act, sorted_ids, block_expert, num_padded, P, D, Fw,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=k, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    route_w = weights.reshape(-1).contiguous()
    dn, dk, dw, ds = cfg.down_tile()
    _down_kernel[(blocks, triton.cdiv(D, dn))](
        act, w2, y, route_w, sorted_ids, block_expert, num_padded, P, D, Fw,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BM=cfg.BM, BN=dn, BK=dk, IEEE=ieee, num_warps=dw, num_stages=ds,
    )
    return y.view(T, k, D).sum(1)  # each token's k weighted rows


PERSISTENT_PROGRAMS: int | None = None
"""Programs of the TMA down kernel's persistent loop; None: one a multiprocessor (its tiles fill most of the
shared memory), 3 on a CPU (the interpreter: a few tiles each)."""


def _persistent_programs(device: torch.device) -> int:
    if PERSISTENT_PROGRAMS is not None:
        return PERSISTENT_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


def _grouped_tma(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, sorted_ids: Tensor, block_expert: Tensor,
                 num_padded: Tensor, cfg: MoeLaunch, k: int) -> Tensor:
    """The grouped GEMMs through TMA descriptors: act in sorted order [maxp, F], then y [T * k, D] by pair."""
    T, D = x.shape
    E, F2, _ = w13.shape
    Fw = F2 // 2
    P = T * k
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty(sorted_ids.numel(), Fw, dtype=x.dtype, device=x.device)
    dn, dk, dw, ds = cfg.down_tile()
    a_desc = TensorDescriptor(act, [act.shape[0], Fw], [Fw, 1], [cfg.BM, dk])
    w13_desc = TensorDescriptor(w13, [E * F2, D], [w13.stride(1), 1], [cfg.BN, cfg.BK])
    w2_desc = TensorDescriptor(w2, [E * D, Fw], [w2.stride(1), 1], [dn, dk])
    _up_kernel_tma[(blocks, triton.cdiv(Fw, cfg.BN))](
        x, w13_desc, act, sorted_ids, block_expert, num_padded, P, D, Fw, x.stride(0), act.stride(0),
        TOP_K=k, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    _down_kernel_tma[(min(blocks * triton.cdiv(D, dn), _persistent_programs(x.device)),)](
        a_desc, w2_desc, y, weights.reshape(-1).contiguous(), sorted_ids, block_expert, num_padded, P, D, Fw,
        y.stride(0), BM=cfg.BM, BN=dn, BK=dk, IEEE=ieee, num_warps=dw, num_stages=ds,
    )
    return y.view(T, k, D).sum(1)


__all__ = [
    "ADD_NORM_MAX_TOKENS",
    "ALIGN_KERNEL_MAX_PAIRS",
    "DIRECT_LAUNCH",
    "DIRECT_MAX_TOKENS",
    "GROUPED_TMA",
    "GROUPED_TMA_MIN_PAIRS",
    "DirectLaunch",
    "MoeLaunch",
    "align_torch",
    "align_triton",
    "fused_moe_direct",
    "fused_moe_direct_add_norm",
    "fused_moe_triton",
    "launch_config",
]
