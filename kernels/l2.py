"""Asking the L2 for bytes a later launch reads, from a launch that runs before it (bench option).

A decode step's KDA decode launch is a chain of memory round trips (its gate rows, then its state slice and conv
tails: ~4 MB at the 48B shape, one sequence), run while the next launch's weight streams beside it and queues
ahead of them. The launch before it (the layer's input matvec) can ask the L2 for those bytes from a few extra
programs at the end of its grid (``cp.async.bulk.prefetch.L2``, Hopper), so that the KDA decode finds them there.
A hint only: no value changes. Needs sm_90; never under the interpreter (kernels compile it only when asked).
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

PIECE_BYTES = 65536
"""Bytes one bulk prefetch asks for."""
PROGRAMS_A_RANGE = 8
"""Programs that share one range's bytes."""
MAX_RANGES = 4


@triton.jit
def l2_prefetch_range(addr, nbytes, NPIECE: tl.constexpr, PIECE: tl.constexpr):
    """Thread 0 of the program asks the L2 for ``nbytes`` (a multiple of 16) from the int64 address ``addr`` on,
    NPIECE bulk requests of up to PIECE bytes."""
    for i in tl.static_range(NPIECE):
        size = tl.minimum(nbytes - i * PIECE, PIECE).to(tl.int32)
        if size > 0:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr + i * PIECE, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_job(j, slot_ptr, b0, r0, n0, b1, r1, n1, b2, r2, n2, b3, r3, n3,
                    APROG: tl.constexpr, NPIECE: tl.constexpr, PIECE: tl.constexpr):
    """Extra program j of a launch: range j // APROG, share j % APROG of it. Range i starts at address b_i, plus
    ``slots[0] * r_i`` where r_i > 0 (a pool's row of one sequence), and holds n_i bytes."""
    r = j // APROG
    q = j % APROG
    base = tl.where(r == 0, b0, tl.where(r == 1, b1, tl.where(r == 2, b2, b3)))
    row = tl.where(r == 0, r0, tl.where(r == 1, r1, tl.where(r == 2, r2, r3)))
    n = tl.where(r == 0, n0, tl.where(r == 1, n1, tl.where(r == 2, n2, n3)))
    slot = tl.load(slot_ptr).to(tl.int64)
    share = ((n + APROG - 1) // APROG + 15) // 16 * 16
    start = q * share
    size = tl.minimum(share, n - start)
    l2_prefetch_range(base + slot * row + start, size, NPIECE, PIECE)


def prefetch_args(ranges: Sequence[tuple[Tensor, Tensor | None]] | None) -> tuple[int, list, int]:
    """(extra programs, kernel arguments after the slot pointer, pieces a program) for up to ``MAX_RANGES``
    ranges (tensor, slots or None): a whole tensor, or with slots its row ``slots[0]`` (the first dimension).
    (0, [], 0) for None or an empty list."""
    if not ranges:
        return 0, [0] * (3 * MAX_RANGES), 0
    assert len(ranges) <= MAX_RANGES
    args: list[int] = []
    most = 0
    for t, slots in ranges:
        row = t[0].numel() * t.element_size() if slots is not None else 0
        n = (row if slots is not None else t.numel() * t.element_size()) // 16 * 16
        args += [t.data_ptr(), row, n]
        most = max(most, n)
    args += [0, 0, 0] * (MAX_RANGES - len(ranges))
    share = triton.cdiv(triton.cdiv(most, PROGRAMS_A_RANGE), 16) * 16
    return len(ranges) * PROGRAMS_A_RANGE, args, triton.cdiv(share, PIECE_BYTES)


__all__ = ["MAX_RANGES", "PIECE_BYTES", "PROGRAMS_A_RANGE", "l2_prefetch_job", "l2_prefetch_range", "prefetch_args"]
