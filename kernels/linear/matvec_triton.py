"""A few rows times a weight matrix in Triton: y [N, O] = x [N, I] @ w [O, I]^T for N of 1 to ``MAX_ROWS``.

A decode step's projections are matvecs: each reads its weight once, so its time is the weight's bytes over the
memory's rate, provided enough of them are in flight. Program p loads its BO rows of the weight whole, [BO, BI]
(BI = I rounded up to a power of two, the rest masked), in one load, so every byte of the slab is requested before
any arrives (a loop over tiles of I would wait a memory round trip per tile); then each row of x is one product
and a sum over I. One row of x: o_proj's 2304 x 4096 at 2.7 TB/s on the H200, in one launch where cuBLAS runs a
split-K GEMV and a reduce at 1.9 (``linear.MATVEC_MAX_ROWS`` has the figures).

On Hopper it is a PDL launch (``kernels.moe.pdl``): a program loads its weight slab, which no launch writes,
before it waits for the launch before (``gdc_wait``) and reads x, so where that launch lets its dependents start
early (the MoE down kernel, KDA's decode kernels) the weight streams while it ends. It lets its own dependents
start at once: theirs are PDL launches that read only weights before their wait (or plain launches).

One row of x is many more programs than the GPU holds at once (12,576 for KDA's input), so the launch after starts
only as the last ones do: the KDA decode kernel's first programs start 0.5 us before this launch ends and leave
their wait 0.3 us after it (clock stamps, ``bench/decode_48b.py --stamps``, H100, 16 layers of the 48B shape,
1 x 128K). Tried (H100, the 48B shape's first 16 layers, two alternations, 2026-12-06): every one-row
matvec on 2 or 3 programs a multiprocessor, each looping over blocks of 4 rows (8,192 columns), the next block
requested before the current one's sums, all resident from the start: the 1 x 128K step 1.927 / 1.922 ms ->
1.962 / 1.958 (2 a multiprocessor) and 1.933 / 1.933 (3); at 1 x 1M 3.254 / 3.246 -> 3.282 / 3.280 and 3.255 /
3.255; with the KDA decode asking the L2 for its rows, state and conv tails before its wait as well: 1.975 /
1.977 and 3.325 / 3.325, its programs still waiting 0.5 us.

o_proj's matvec (2,304 rows) starts with the KDA decode and loads its rows before its wait, but only ~1,600 of
them fit in the registers beside that launch (58 registers a program of one row), and o_proj still ends 5.9 us
after the KDA decode. Tried (H100, 16 layers of the 48B shape, two alternations each, 2026-12-06): the slab held as
int32 pairs of bfloat16 until after the wait, each pair's products from its halves (ptxas: 8 rows on 8 warps in 80
registers, 2,144 rows resident): on 8 rows a program o_proj ends 4.6 us after the KDA decode but that launch takes
13.4 us instead of 11.0 (its reads queue behind the larger preload), the 1 x 128K step 1.8241 / 1.8239 ms ->
1.8438 / 1.8435; on 4 rows and 8 warps -1 to -7 us at 1 x 128K and -5 to -9 at 1 x 1M over four alternations (in
the runs' noise, not kept); one row, packed: +2 / +3 us. The KDA layer's input matvec asking the L2, from 32 extra
programs at its grid's end, for what the KDA decode then reads (gate rows, state slice, conv tails: 4 MB): that
launch 11.5 -> 9.5 us, but it starts 1.3 us after the matvec's end instead of 0.5 before (the extra programs are
the last to start), so it ends at the same time: the step +1 / +4 us; with the packed 8-row o_proj as well, +7.

o_proj's whole weight held in shared memory (a Gluon kernel, sm_90; tried 2026-12-06, H100, 16 layers): each
program's 4 rows (32 KB) copied by one 3-d TMA copy before its PDL wait, all 576 programs resident beside the KDA
decode, after the wait each warp reading a quarter of x and summing from shared memory. Clock stamps: o_proj ends
3.6 us after the KDA decode instead of 5.9, but the KDA launch takes 11.8 us instead of 10.5 (its gate and conv
reads queue behind the 18.9 MB copy), and after its wait a program still takes 1.65 us (x's L2 round trip, then
143 KB of bf16 a multiprocessor read from shared memory, widened and multiplied: ~0.65 us at shared memory's 128
bytes a cycle, whatever unit multiplies). The step: on one machine -15 / -14 us at 1 x 128K / 1 x 1M over three
alternations, on another none over four (1 x 128K 1.8438 / 1.8422 / 1.8422 / 1.8424 ms against 1.8431 / 1.8421 /
1.8429 / 1.8421); not kept. Variants: x copied by TMA too (one more serial round trip, +5 us), a warp a row (x
widened by every warp; -4 to -10 us on the second machine), the copy held back 0.6-2.3 us so the KDA decode's
first reads go ahead (its gate phase 5.4 -> 2.5 us, but its conv phase 2.6 -> 5.2-6.0: +2 to +10 us), the copy
split into 16 paced boxes (+35 us at 800 cycles apart).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..moe.pdl import use_pdl
from ..stamps import clock_now, global_ns, stamp_buffer, store_ends

MAX_ROWS = 8
"""The most rows of x the kernel takes (one product and sum over the slab per row)."""


@triton.jit
def _matvec_kernel(x, s_x, w, s_w, y, s_y, O, I: tl.constexpr, N: tl.constexpr, BO: tl.constexpr,
                   BI: tl.constexpr, PDL: tl.constexpr = False, HO: tl.constexpr = 0, s_xh=0, s_wh=0, stamps=None,
                   STAMPS: tl.constexpr = False):
    """y[n, o] = w[o] . x[n] for the BO rows o of program_id(0). With HO > 0 the rows come in heads of HO (BO
    divides HO): row o is row o % HO of head o // HO (at w + head * s_wh) and multiplies x[n]'s head, at
    x + n * s_x + head * s_xh; y's rows stay flat, [N, heads * HO]. (Each row of x RMS-normed by every program
    itself, so that the norm after a layer's last launch could move into the next layer's input matvec: 84 us
    slower a 1 x 128K step of the 48B shape, 2.515 ms against 2.431, H200, 2026-12-05.)

    With STAMPS (``kernels.stamps``) program i stores in row i of ``stamps``: [2] start, [3] after the wait, [4]
    end."""
    if STAMPS:
        g_start = global_ns()
        c_start = clock_now()
    ro = tl.program_id(0) * BO + tl.arange(0, BO)
    mo = ro < O
    k = tl.arange(0, BI)
    mk = k < I
    if HO > 0:
        head = (tl.program_id(0) * BO) // HO
        w_rows = w + head.to(tl.int64) * s_wh + (ro % HO).to(tl.int64)[:, None] * s_w
        xh = x + head.to(tl.int64) * s_xh
    else:
        w_rows = w + ro.to(tl.int64)[:, None] * s_w
        xh = x
    wt = tl.load(w_rows + k[None, :], mask=mo[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [BO, BI]
    if PDL:  # the weight is requested; x is the launch before's output
        gdc_launch_dependents()
        gdc_wait()
    if STAMPS:
        c_wait = clock_now()
    for n in tl.static_range(N):
        xv = tl.load(xh + n * s_x + k, mask=mk, other=0.0).to(tl.float32)
        tl.store(y + n * s_y + ro, tl.sum(wt * xv[None, :], axis=1).to(y.dtype.element_ty), mask=mo)
    if STAMPS:
        store_ends(stamps, tl.program_id(0), 4, g_start, c_start, c_wait)


def matvec_config(N: int, O: int, I: int) -> tuple[int, int]:
    """(BO, num_warps) for x [N, I] and w [O, I]: one row on 2 warps. H200, graph replays over copies beyond the L2,
    one row of x, us (BO/warps 1/2, 1/4, 2/4, 4/4, 4/8): o_proj 2304 x 4096 6.92, 7.11, 7.11, 8.31, 7.14; KDA's merged
    input 12576 x 2304 16.91, 16.94, 18.86, 18.36, 19.43; MLA's q | kv_a 6720 x 2304 10.35, 10.46, 12.23, 11.57,
    12.65."""
    del N, O, I
    return 1, 2


def matvec_triton(x: Tensor, w: Tensor, config: tuple[int, int] | None = None) -> Tensor:
    """x [N, I] (unit column stride, 1 <= N <= MAX_ROWS), w [O, I] (unit column stride) -> y [N, O] in x's dtype.
    ``config``: (BO, num_warps), default ``matvec_config``."""
    N, I = x.shape
    O = w.shape[0]
    y = x.new_empty(N, O)
    BO, warps = config or matvec_config(N, O, I)
    pdl = use_pdl(x.device)
    stamps = stamp_buffer("matvec", triton.cdiv(O, BO), x.device)
    _matvec_kernel[(triton.cdiv(O, BO),)](x, x.stride(0), w, w.stride(0), y, y.stride(0), O, I=I, N=N, BO=BO,
                                          BI=triton.next_power_of_2(I), PDL=pdl, stamps=stamps,
                                          STAMPS=stamps is not None, num_warps=warps,
                                          **({"launch_pdl": True} if pdl else {}))
    return y




HEAD_ROWS = 4
"""Rows a program of ``head_matvec_triton`` (1, 2 or 4; on 2 warps). With one, MLA's W_uv at the 48B shape is 4,096
programs, more than the GPU holds at once, so the PDL trigger that lets o_proj's matvec start (every program's)
fires only as the last ones start: o_proj's weight load is not hidden (the step's timeline: o_proj adds 7.1-7.7 us
after W_uv against 4.4-4.7 after the KDA decode). With 4, 1,024 programs, all resident at once. With
``paged_decode.COMBINE_EARLY_TRIGGER`` (``bench/decode_48b.py`` mode ``old-uv`` turns both off):
the 1 x 128K step -28 us on the H200 (2.403 ms against 2.431, 2026-12-05); on an H100 at 16 layers of the 48B
shape, two alternations, -17 us at 1 x 128K (1.912 / 1.911 ms against 1.926 / 1.930) and -19 at 1 x 1M
(3.279 / 3.278 against 3.303 / 3.293), 2026-12-06; the greedy tokens and logits the same bits as with 1."""


def head_matvec_triton(x: Tensor, w: Tensor) -> Tensor:
    """Per head h: y[n, h] = w[h] @ x[n, h] for x [N, H, I] (1 <= N <= MAX_ROWS; unit column stride) and w [H, O, I]
    (any head and row strides, unit column stride: e.g. a slice of each head's rows of a larger weight) ->
    y [N, H, O] in x's dtype, float32 sums; one launch (PDL as ``matvec_triton``'s)."""
    N, H, I = x.shape
    O = w.shape[1]
    y = x.new_empty(N, H, O)
    BO, warps = HEAD_ROWS if O % HEAD_ROWS == 0 else 1, 2
    pdl = use_pdl(x.device)
    stamps = stamp_buffer("matvec", H * O // BO, x.device)
    _matvec_kernel[(H * O // BO,)](x, x.stride(0), w, w.stride(1), y, H * O, H * O, I=I, N=N, BO=BO,
                             BI=triton.next_power_of_2(I), PDL=pdl, HO=O, s_xh=x.stride(1), s_wh=w.stride(0),
                             stamps=stamps, STAMPS=stamps is not None, num_warps=warps,
                             **({"launch_pdl": True} if pdl else {}))
    return y


__all__ = ["HEAD_ROWS", "MAX_ROWS", "head_matvec_triton", "matvec_config", "matvec_triton"]
