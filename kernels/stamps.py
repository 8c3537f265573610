"""Clock stamps inside a decode kernel: where a latency-bound kernel's time goes, phase by phase (bench only).

The torch profiler gives a kernel's span; the step's latency-bound kernels (KDA decode ~11 us a layer at the 48B
shape for ~1 us of bytes) need to be seen inside. A kernel built with its ``STAMPS`` constexpr reads the SM's
cycle counter (``%clock64``) at the end of each phase and ``%globaltimer`` (ns, the same on every SM) at its start
and end, and its programs store them, one row each, in a buffer that ``bench/decode_48b.py --stamps`` reads after
a graph replay of the whole step. A phase's stamp takes the values the phase computed as inputs of the read (an
asm operand), so it is read once they have arrived, not when their loads were issued; a stamp of a tensor gives
one reading a thread, reduced (max) only where the row is stored, at the program's end. Off (the constexpr False)
the kernels compile to the same code as without this module. Needs sm_70 or later; never under the interpreter.

Launches made while ``ROWS`` is a dict (a CUDA graph's capture included) are built with their stamps and add their
buffers to it under the kernel's name; each run of the launch (each replay) fills them again.

Row layout (``WIDTH`` int64 a program): [0] globaltimer at the program's start, [1] globaltimer at its end,
[2 + i] clock64 at the end of phase i (i = 0: the program's start)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

WIDTH: tl.constexpr = tl.constexpr(16)
"""int64 values a program stores: two globaltimer readings, then up to 14 clock readings."""

ROWS: dict[str, list[Tensor]] | None = None
"""Bench only (``bench/decode_48b.py --stamps``): None, the kernels as shipped (no stamps compiled in); a dict,
each stamping kernel's launches append their stamp buffers [programs, ``WIDTH``] int64 under the kernel's name
(``kda_decode``, ``route``, ``moe_down``, ``matvec``)."""


LAUNCHES: list[tuple[str, Tensor]] = []
"""Bench only: every stamp buffer ``stamp_buffer`` made, with its kernel's name, in launch order (what the step's
stamped launches did one after another: when each started against the end of the one before)."""


def stamp_buffer(name: str, programs: int, device: torch.device) -> Tensor | None:
    """A stamp buffer for a launch of kernel ``name`` of ``programs`` programs, added to ``ROWS`` and
    ``LAUNCHES``; None (build the kernel without stamps) when ``ROWS`` is None or the device is not a GPU. Not
    zeroed: every program of a stamping kernel stores its row's columns each run, and a fill would be one more
    launch before the stamped one (in a graph, a node between two PDL launches: the stamped launch could no
    longer start early, and its start against the launch before would measure the fill)."""
    if ROWS is None or device.type != "cuda":
        return None
    buf = torch.empty(programs, int(WIDTH), dtype=torch.int64, device=device)
    ROWS.setdefault(name, []).append(buf)
    LAUNCHES.append((name, buf))
    return buf


@triton.jit
def clock_now():
    """The SM's cycle counter now (int64 scalar)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def global_ns():
    """The GPU's nanosecond timer now (int64 scalar), comparable across SMs."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def clock_after(x):
    """The SM's cycle counter once x (a float32 tensor or scalar) is computed: one reading per element (int64)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64; // $1", "=l,r", [x.to(tl.int32, bitcast=True)],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def store_ends(buf, row, last: tl.constexpr, g_start, c_start, c_wait):
    """Reads the program's end (clock and globaltimer) and stores the row's fixed columns: [0] ``g_start``, [1]
    the end's globaltimer, [2] ``c_start``, [3] ``c_wait`` (the clock after the PDL wait), [last] the end's clock.
    The kernel stores its phases' readings in the columns between."""
    c_end = clock_now()
    g_end = global_ns()
    store_at(buf, row, 0, g_start)
    store_at(buf, row, 1, g_end)
    store_at(buf, row, 2, c_start)
    store_at(buf, row, 3, c_wait)
    store_at(buf, row, last, c_end)


@triton.jit
def store_at(buf, row, i: tl.constexpr, value):
    """Stores an int64 scalar at column i of program row ``row``."""
    tl.store(buf + row.to(tl.int64) * WIDTH + i, value)


@triton.jit
def store_max_at(buf, row, i: tl.constexpr, readings):
    """Stores the latest of a 1-D tensor of readings (``clock_after`` of a tensor) at column i of row ``row``."""
    tl.store(buf + row.to(tl.int64) * WIDTH + i, tl.max(readings, axis=0))


@triton.jit
def store_max2_at(buf, row, i: tl.constexpr, readings):
    """``store_max_at`` for a 2-D tensor of readings."""
    tl.store(buf + row.to(tl.int64) * WIDTH + i, tl.max(tl.max(readings, axis=1), axis=0))


__all__ = ["LAUNCHES", "ROWS", "WIDTH", "clock_after", "clock_now", "global_ns", "stamp_buffer", "store_at", "store_ends",
           "store_max2_at", "store_max_at"]
