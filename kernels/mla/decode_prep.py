"""The steps of an MLA decode between the input projection and attention, in one Triton launch: the latent's
RMSNorm and its write into the page pool, the query's absorption into the latent space (q_nope @ W_uk per head),
and q_pe copied out contiguous. The separate ops (the norm, a concatenation, the page write, the batched matmul
with its strided operand, the copy) are ~6 launches of a few microseconds each, per MLA layer and step.

Grid (N, H * RB + 1): program (n, j) for j < H * RB computes the r-block j % RB of head j // RB's absorbed query
from its [dn, BR] tile of kv_b_proj's weight (read in place, no derived copy); program (n, H * RB) writes the
sequence's new cache row.

On Hopper, for up to ``linear.MATVEC_MAX_ROWS`` sequences (where the input projection before it is a PDL matvec
that lets it start early), it is a PDL launch (``kernels.moe.pdl``): each program loads its weights (W_uk's tile,
the norm's) before it waits for the input projection, and lets the next launch (the attention's split kernel,
which reads nothing before its own wait) start at once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..linear import MATVEC_MAX_ROWS
from ..moe.pdl import use_pdl


@triton.jit
def _prep_kernel(y, s_y, w, norm_w, kv, kv_rows, q_lat, q_pe, eps, H: tl.constexpr, DN: tl.constexpr,
                 DR: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BR: tl.constexpr, BDN: tl.constexpr,
                 BDR: tl.constexpr, BRF: tl.constexpr, PDL: tl.constexpr = False):
    n = tl.program_id(0)
    j = tl.program_id(1)
    RB: tl.constexpr = R // BR
    row = y + n.to(tl.int64) * s_y
    QW: tl.constexpr = H * (DN + DR)
    if j < H * RB:
        h = j // RB
        rb = j % RB
        d = tl.arange(0, BDN)
        md = d < DN
        c = rb * BR + tl.arange(0, BR)
        wt = tl.load(w + (h * (DN + DV) + d).to(tl.int64)[:, None] * R + c[None, :], mask=md[:, None],
                     other=0.0).to(tl.float32)  # [BDN, BR]: W_uk[h] rows d, columns c
        if PDL:  # the weight is requested; y is the input projection's output
            gdc_launch_dependents()
            gdc_wait()
        qn = tl.load(row + h * (DN + DR) + d, mask=md, other=0.0).to(tl.float32)  # [BDN]
        ql = tl.sum(qn[:, None] * wt, axis=0)
        tl.store(q_lat + (n * H + h).to(tl.int64) * R + c, ql.to(q_lat.dtype.element_ty))
        if rb == 0:
            e = tl.arange(0, BDR)
            me = e < DR
            pe = tl.load(row + h * (DN + DR) + DN + e, mask=me)
            tl.store(q_pe + (n * H + h).to(tl.int64) * DR + e, pe, mask=me)
    else:  # (names apart from the other branch's: Triton merges a name assigned in both, so their types must agree)
        cr = tl.arange(0, BRF)
        mc = cr < R
        nw = tl.load(norm_w + cr, mask=mc, other=0.0).to(tl.float32)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        v = tl.load(row + QW + cr, mask=mc, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(v * v, axis=0) / R + eps)
        # rounded to y's dtype as the norm's output is, then stored in the pool's
        normed = (v * inv * nw).to(y.dtype.element_ty)
        dst = kv + tl.load(kv_rows + n).to(tl.int64) * (R + DR)
        tl.store(dst + cr, normed.to(kv.dtype.element_ty), mask=mc)
        er = tl.arange(0, BDR)
        mr = er < DR
        k_pe = tl.load(row + QW + R + er, mask=mr)
        tl.store(dst + R + er, k_pe.to(kv.dtype.element_ty), mask=mr)


def mla_decode_prep_triton(
    y: Tensor, w_kv_b: Tensor, norm_w: Tensor, eps: float, kv_pages: Tensor, kv_rows: Tensor, H: int, dn: int
) -> tuple[Tensor, Tensor]:
    """Shapes as :func:`kda_sessions.kernels.mla.mla_decode_prep` (validated there)."""
    N = y.shape[0]
    r = w_kv_b.shape[1]
    dr = kv_pages.shape[-1] - r
    dv = w_kv_b.shape[0] // H - dn
    # the kernel reads both at unit stride: other views are copied first (the model's are unit-stride already)
    norm_w = norm_w if norm_w.stride(0) == 1 else norm_w.contiguous()
    kv_rows = kv_rows if kv_rows.stride(0) == 1 else kv_rows.contiguous()
    q_lat = y.new_empty(N, H, r)
    q_pe = y.new_empty(N, H, dr)
    if N == 0:
        return q_lat, q_pe
    BR = min(128, triton.next_power_of_2(r))
    while r % BR:
        BR //= 2
    pdl = use_pdl(y.device) and N <= MATVEC_MAX_ROWS
    _prep_kernel[(N, H * (r // BR) + 1)](
        y, y.stride(0), w_kv_b, norm_w, kv_pages, kv_rows, q_lat, q_pe, float(eps), H=H, DN=dn, DR=dr, DV=dv, R=r,
        BR=BR, BDN=triton.next_power_of_2(dn), BDR=triton.next_power_of_2(dr), BRF=triton.next_power_of_2(r),
        PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )
    return q_lat, q_pe


__all__ = ["mla_decode_prep_triton"]
