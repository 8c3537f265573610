"""Asking the L2 for the next launch's weights while a latency-bound kernel runs.

In a one-token decode step some launches read little and wait on a chain of memory round trips (the KDA decode:
~10 us a layer for ~1 us of bytes at the 48B shape), while the memory stays idle; the launch after them streams a
weight from HBM (the output projection: 18.9 MB, ~4.5 us). A latency-bound kernel given that weight's address
(``PREFETCH``) runs a few extra programs that ask the L2 for it in bulk (``cp.async.bulk.prefetch.L2``, Hopper):
nothing is read into registers and nothing waits, so the next launch then reads it from the L2. A hint only: no
value changes. Needs sm_90; never under the interpreter (the kernels compile it only when asked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

PIECE_BYTES = 65536
"""Bytes one bulk prefetch asks for."""
PIECE: tl.constexpr = tl.constexpr(PIECE_BYTES)


@triton.jit
def l2_prefetch_share(base, nbytes, share, q, NPIECE: tl.constexpr, PIECE_BYTES: tl.constexpr):
    """Thread 0 of the program asks the L2 for bytes [q * share, min((q + 1) * share, nbytes)) of the buffer at
    ``base`` (a pointer; share and nbytes multiples of 16), NPIECE bulk requests of up to PIECE_BYTES."""
    start = q.to(tl.int64) * share
    end = tl.minimum(start + share, nbytes)
    addr = base.to(tl.int64, bitcast=True) + start
    for i in tl.static_range(NPIECE):
        size = tl.minimum(end - start - i * PIECE_BYTES, PIECE_BYTES).to(tl.int32)
        if size > 0:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr + i * PIECE_BYTES, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_plan(t: Tensor | None, programs: int, tail: float = 1.0) -> tuple[Tensor | None, int, int, int]:
    """(base, nbytes, share, pieces) of ``l2_prefetch_share`` for the last ``tail`` (0 to 1) of ``t``'s bytes over
    ``programs`` programs; (None, 0, 0, 0) for None, a zero tail, or a tensor that is not contiguous or not
    16-byte aligned (a hint only: nothing asked)."""
    if t is None or programs <= 0 or tail <= 0 or not t.is_contiguous() or t.data_ptr() % 16:
        return None, 0, 0, 0
    total = t.numel() * t.element_size() // 16 * 16
    skip = int(total * (1.0 - min(tail, 1.0))) // 16 * 16
    nbytes = total - skip
    if nbytes <= 0:
        return None, 0, 0, 0
    base = t.view(-1).view(torch.uint8)[skip:]
    share = triton.cdiv(triton.cdiv(nbytes, programs), 16) * 16
    return base, nbytes, share, triton.cdiv(share, PIECE_BYTES)


__all__ = ["PIECE", "PIECE_BYTES", "l2_prefetch_share", "prefetch_plan"]
