"""Depthwise causal short convolution with SiLU in Triton, for packed varlen prefill and T = 1 decode.

Each sequence reads as ``cat(tail_n, x_n)`` (the W - 1 rows before its first token, then its tokens): y_t sums
``weight[:, w] * seq[t + w]``. A second launch gathers W - 1 consecutive rows of that sequence for the new tails
(rows T_n .. T_n + W - 2) and for tails at requested positions p (rows p .. p + W - 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _seq_rows(x, stride_x, tail, n, bos, j, d, md, D: tl.constexpr, W: tl.constexpr):
    """Row j (a tensor of indices) of cat(tail_n, x_n), columns d: float32. x's rows are stride_x apart."""
    in_x = j >= W - 1
    xv = tl.load(x + (bos + j - (W - 1)) * stride_x + d, mask=md & in_x, other=0.0).to(tl.float32)
    tv = tl.load(tail + (n * (W - 1) + j) * D + d, mask=md & (j < W - 1) & (j >= 0), other=0.0).to(tl.float32)
    return xv + tv


@triton.jit
def _conv_kernel(
    x, weight, tail, y, seq_ids, cu_seqlens, T, stride_x,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ACT: tl.constexpr, PLANE: tl.constexpr,
):
    """y's column d of token t at t * D + d, or with PLANE (a multiple of BD) in plane d // PLANE of
    [D // PLANE, T, PLANE]."""
    it = tl.program_id(0)
    id_ = tl.program_id(1)
    t = it * BT + tl.arange(0, BT)
    d = id_ * BD + tl.arange(0, BD)
    mt = t < T
    mdv = d < D
    n = tl.load(seq_ids + t, mask=mt, other=0).to(tl.int64)
    bos = tl.load(cu_seqlens + n, mask=mt, other=0).to(tl.int64)
    local = t.to(tl.int64) - bos  # position of token t in its sequence
    m2 = mt[:, None] & mdv[None, :]
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        wt = tl.load(weight + d * W + w, mask=mdv, other=0.0).to(tl.float32)
        # token t's tap w reads row local + w of cat(tail, x)
        acc += wt[None, :] * _seq_rows(x, stride_x, tail, n[:, None], bos[:, None], (local + w)[:, None],
                                       d[None, :], m2, D, W)
    if ACT:
        acc = acc * tl.sigmoid(acc)
    if PLANE:  # the whole column block lies in plane id_ * BD // PLANE
        plane = (id_ * BD // PLANE).to(tl.int64)
        out = y + plane * T * PLANE + t[:, None].to(tl.int64) * PLANE + (d - plane * PLANE)[None, :]
    else:
        out = y + t[:, None].to(tl.int64) * D + d[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=m2)


@triton.jit
def _gather_tail_kernel(
    x, stride_x, tail, out, seq_of, start_of, cu_seqlens,
    D: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    m = tl.program_id(0)
    id_ = tl.program_id(1)
    n = tl.load(seq_of + m).to(tl.int64)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    start = tl.load(start_of + m).to(tl.int64)
    i = tl.arange(0, BR)
    d = id_ * BD + tl.arange(0, BD)
    m2 = (i[:, None] < W - 1) & (d[None, :] < D)
    rows = _seq_rows(x, stride_x, tail, n, bos, (start + i)[:, None], d[None, :], m2, D, W)
    tl.store(out + (m * (W - 1) + i[:, None]) * D + d[None, :], rows.to(out.dtype.element_ty), mask=m2)


def _launch(
    x: Tensor, weight: Tensor, tail: Tensor, cu_seqlens: Tensor, seq_of: Tensor, start_of: Tensor, M: int,
    activation: bool = True, plane: int = 0,
) -> tuple[Tensor, Tensor]:
    """x [T, D] (rows may be strided), weight [D, W], tail [N, W - 1, D] (contiguous) -> y [T, D] (with
    ``plane``: [D // plane, T, plane]), gathered tails [N + M, W - 1, D] (rows start_of[i] .. of sequence seq_of[i];
    the first N are the new tails)."""
    T, D = x.shape
    W = weight.shape[1]
    y = x.new_empty(D // plane, T, plane) if plane else x.new_empty(T, D)
    BD = min(128, triton.next_power_of_2(D))
    if plane and plane % BD:
        BD = math.gcd(plane, BD)
    if T > 0:
        seq_ids = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=x.device, dtype=cu_seqlens.dtype),
                                     right=True)
        BT = 16 if T <= 64 else 64
        _conv_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
            x, weight, tail, y, seq_ids, cu_seqlens, T, x.stride(0), D=D, W=W, BT=BT, BD=BD, ACT=activation,
            PLANE=plane, num_warps=4,
        )
    tails = x.new_empty(seq_of.numel(), W - 1, D)
    if seq_of.numel() > 0 and W > 1:
        _gather_tail_kernel[(seq_of.numel(), triton.cdiv(D, BD))](
            x, x.stride(0), tail, tails, seq_of, start_of, cu_seqlens, D=D, W=W,
            BR=max(2, triton.next_power_of_2(W - 1)), BD=BD, num_warps=4,
        )
    return y, tails


def causal_conv_triton(
    x: Tensor,
    weight: Tensor,
    tail: Tensor,
    cu_seqlens: Tensor,
    tail_positions: Sequence[Sequence[int]] | None = None,
    plane: int = 0,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Depthwise causal conv + SiLU over packed sequences, with tails as state.

    x [T, D] (N sequences packed by ``cu_seqlens`` int [N + 1]; its rows may be strided, e.g. columns of a wider
    projection); weight [D, W]; tail [N, W - 1, D], the W - 1 pre-conv rows before each sequence. Returns ``(y [T,
    D] in x's dtype, new tail [N, W - 1, D] in x's dtype, tails after p tokens for p in ``tail_positions[n]``
    flattened [M, W - 1, D] | None)``; with ``plane`` (dividing D) y is [D // plane, T, plane]: KDA's q, k and v
    each contiguous. Without positions there is no host sync (decode: T = N, cu_seqlens = arange(N + 1)).
    """
    D, W = weight.shape
    N = cu_seqlens.numel() - 1
    if x.dim() != 2 or x.shape[-1] != D or tuple(tail.shape) != (N, W - 1, D):
        raise ValueError(f"x must be [T, D={D}] and tail [N={N}, {W - 1}, {D}], got {tuple(x.shape)}, {tuple(tail.shape)}")
    if plane and D % plane:
        raise ValueError(f"plane must divide D={D}, got {plane}")
    if tail_positions is not None and len(tail_positions) != N:
        raise ValueError(f"tail_positions needs one list per sequence ({N}), got {len(tail_positions)}")
    dev = x.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    seq_of = torch.arange(N, device=dev)
    start_of = cu[1:] - cu[:-1]  # new tail: rows T_n .. T_n + W - 2 of cat(tail, x)
    M = 0
    if tail_positions is not None:
        extra_n = [n for n, ps in enumerate(tail_positions) for _ in ps]
        extra_p = [int(p) for ps in tail_positions for p in ps]
        M = len(extra_p)
        # non-blocking: a copy from pageable memory then waits for the staging only, not for the queued kernels
        extra = torch.tensor([extra_n, extra_p], dtype=torch.int64).to(dev, non_blocking=True)
        seq_of = torch.cat([seq_of, extra[0]])
        start_of = torch.cat([start_of, extra[1]])
    x = x if x.stride(1) == 1 else x.contiguous()
    y, tails = _launch(x, weight.contiguous(), tail.to(x.dtype).contiguous(), cu, seq_of, start_of, M, plane=plane)
    ck = tails[N:] if tail_positions is not None else None
    return y, tails[:N], ck
