"""One row times a weight that fits in the GPU's shared memory, in Gluon for Hopper (sm_90): CUDA only.

y [1, O] = x [1, I] @ w [O, I]^T, as ``matvec_triton`` with one row, for a weight of at most ``SMEM_MAX_BYTES``
(o_proj's 2304 x 4096, 18.9 MB). Program p copies its ``ROWS`` rows whole into shared memory by one TMA copy
(``ROWS`` x I bf16, 32 KB at I 4096: all 576 of o_proj's programs resident at once beside the KDA decode's),
before its PDL wait, so the whole weight is on chip by the time the launch before ends; after the wait it reads
x and sums its rows' products there. The
Triton matvec holds its slab in registers, where only ~1,600 of o_proj's 2,304 rows fit beside the KDA decode's
launch: the rest load after it ends.

H100, the 48B shape's first 16 layers (12 KDA + 4 MLA o_proj calls), graph replays, three alternations in one call
(``bench/decode_48b.py --layers 16 --cases 1x131072,1x1048576 --modes fused,old-oproj,...``, 2026-12-06): 1 x 128K
1.9389 / 1.9374 / 1.9351 ms against 1.9522 / 1.9528 / 1.9516 in the Triton matvec (-15 us), 1 x 1M 3.3148 / 3.307 /
3.3076 against 3.3264 / 3.3229 / 3.3253 (-14); 8 rows a program the same. Clock stamps (``--stamps 131072``):
o_proj ends 3.6 us after the KDA decode instead of 5.9, every program resident from the start, but the KDA launch
takes ~1 us longer (its reads queue behind the 18.9 MB copy) and after the wait a program still takes 1.65 us:
x's L2 round trip, then widening and multiplying 143 KB of bf16 a multiprocessor on the CUDA cores (~0.65 us of
issue at two instructions an element). Tried: x copied by TMA too (one more round trip: +1.2 us; the PDL
chain test also failed with it, not diagnosed); the copies spaced out by 200-1,600 cycles between boxes (the KDA launch as fast as alone,
but o_proj ends up to 9 us after it); 16 copies a program rather than one 3-d copy; a warp a row (each widened x
again: 4x the conversions). Left: the products on the tensor cores (mma with x as a one-row operand), which would
leave only x's round trip after the wait.

Gluon kernels do not run under ``TRITON_INTERPRET=1``: CI compiles this one for sm_90 (no GPU needed); the device
tests it against the float32 product (tests/kernels/test_linear.py, gpu tests).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..moe.pdl import use_pdl
from ..stamps import WIDTH, stamp_buffer

try:  # Gluon (triton.experimental) is absent from older Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load is async_load in newer Triton (3.9), async_copy_global_to_shared in 3.6
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
except (ImportError, AttributeError):  # a Triton without Gluon: the Triton matvec serves every call
    gluon = None

SMEM_MATVEC = True
"""Whether ``linear`` runs one-row products of weights up to ``SMEM_MAX_BYTES`` in this kernel (``smem_matvec_ok``)."""

SMEM_MAX_BYTES = 20 * 2**20
"""The largest weight this kernel takes: its programs must all be resident at once (132 multiprocessors of
three 64 KB programs hold 25 MB)."""

ROWS = 4
"""Rows a program (32 KB of shared memory at I 4096)."""

BOX = 256
"""Columns a TMA copy (a box's side is at most 256)."""

if gluon is not None:

    @gluon.jit
    def _g_read(reg: gl.constexpr):
        """%clock64 or %globaltimer now (int64 scalar)."""
        return gl.inline_asm_elementwise("mov.u64 $0, " + reg + ";", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _smem_matvec_kernel(x, w_desc, y, stamps, I: gl.constexpr, BO: gl.constexpr, BOX: gl.constexpr,
                            PDL: gl.constexpr, STAMPS: gl.constexpr, SW: gl.constexpr):
        """y[o] = w[o] . x for the BO rows o of program_id(0): their I / BOX boxes of BOX columns copied into shared
        memory by one TMA copy (a [NBOX, BO, BOX] box of the view [NBOX, O, BOX] of w), then, after the PDL wait,
        x read and the products summed out of shared memory, each of the 4 warps on every 4th box (so each
        element of x is read and widened once a program). With STAMPS (``kernels.stamps``, rows of SW) program i
        stores in row i of ``stamps``: [0] globaltimer at its start, [1] at its end, [2] clock at its start, [3]
        after the wait, [4] once the copy is in, [5] at its end."""
        if STAMPS:
            g_start = _g_read("%globaltimer")
            c_start = _g_read("%clock64")
        NBOX: gl.constexpr = I // BOX
        o0 = gl.program_id(0) * BO
        lay3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
        buf = gl.allocate_shared_memory(gl.bfloat16, [NBOX, BO, BOX], lay3)
        bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bar.index(0), count=1)
        mbarrier.expect(bar.index(0), NBOX * BO * BOX * 2)
        _tma_load(w_desc, [0, o0, 0], bar.index(0), buf)
        if PDL:  # the weight is on its way; x is the launch before's output
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        if STAMPS:
            c_wait = _g_read("%clock64")
        # [4 boxes, BO rows, BOX columns] a step: warp a takes box a, a thread 8 columns of every row
        blk: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BO, 8], threads_per_warp=[1, 1, 32],
                                             warps_per_cta=[4, 1, 1], order=[2, 1, 0])
        bx = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, blk)))
        cx = gl.arange(0, BOX, layout=gl.SliceLayout(0, gl.SliceLayout(1, blk)))
        xoff = bx[:, None, None] * BOX + cx[None, None, :]
        mbarrier.wait(bar.index(0), 0)
        if STAMPS:
            c_copies = _g_read("%clock64")
        acc = gl.zeros([4, BO, BOX], gl.float32, layout=blk)
        for j in gl.static_range(NBOX // 4):
            xv = gl.load(x + j * 4 * BOX + xoff).to(gl.float32)
            acc += buf.slice(4 * j, 4).load(blk).to(gl.float32) * xv
        out = gl.sum(gl.sum(acc, axis=2), axis=0)
        rows = o0 + gl.arange(0, BO, layout=gl.SliceLayout(0, gl.SliceLayout(2, blk)))
        gl.store(y + rows, out.to(y.dtype.element_ty))
        mbarrier.invalidate(bar.index(0))
        if STAMPS:
            c_end = _g_read("%clock64")
            g_end = _g_read("%globaltimer")
            row = stamps + gl.program_id(0).to(gl.int64) * SW
            gl.store(row + 0, g_start)
            gl.store(row + 1, g_end)
            gl.store(row + 2, c_start)
            gl.store(row + 3, c_wait)
            gl.store(row + 4, c_copies)
            gl.store(row + 5, c_end)


def smem_matvec_ok(x: Tensor, w: Tensor) -> bool:
    """Whether this kernel serves x @ w^T: ``SMEM_MATVEC`` on, a Hopper GPU (sm_90), one bf16 row of x at unit
    stride, a bf16 weight of at most ``SMEM_MAX_BYTES`` with I a multiple of 4 ``BOX`` up to 4,096, O a multiple
    of ``ROWS``, 16-byte aligned rows and x (TMA)."""
    if gluon is None or not SMEM_MATVEC or not x.is_cuda or x.dim() != 2 or w.dim() != 2:
        return False
    O, I = w.shape
    return (x.shape[0] == 1 and x.stride(1) == 1 and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.data_ptr() % 16 == 0
            and w.stride(1) == 1 and I % (4 * BOX) == 0 and I <= 4096 and O % ROWS == 0 and O * I * 2 <= SMEM_MAX_BYTES
            and (w.stride(0) * 2) % 16 == 0 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def smem_matvec(x: Tensor, w: Tensor) -> Tensor:
    """x [1, I] @ w [O, I]^T -> [1, O] in bf16, float32 sums, where ``smem_matvec_ok``; one launch (PDL as
    ``matvec_triton``'s)."""
    O, I = w.shape
    y = x.new_empty(1, O)
    nbox = I // BOX
    # w as [NBOX, O, BOX] (box b of row o at o * I + b * BOX): a program's rows are one copy
    w_desc = TensorDescriptor(w.as_strided((nbox, O, BOX), (BOX, w.stride(0), 1)), [nbox, O, BOX],
                              [BOX, w.stride(0), 1], [nbox, ROWS, BOX],
                              gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3))
    pdl = use_pdl(x.device)
    grid = triton.cdiv(O, ROWS)
    stamps = stamp_buffer("smem_matvec", grid, x.device)
    _smem_matvec_kernel[(grid,)](x, w_desc, y, y if stamps is None else stamps, I=I, BO=ROWS, BOX=BOX, PDL=pdl,
                                 STAMPS=stamps is not None, SW=int(WIDTH), num_warps=4,
                                 **({"launch_pdl": True} if pdl else {}))
    return y


__all__ = ["ROWS", "SMEM_MATVEC", "SMEM_MAX_BYTES", "smem_matvec", "smem_matvec_ok"]
