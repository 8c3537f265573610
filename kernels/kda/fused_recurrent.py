"""Token-by-token KDA in Triton (decode is T = 1), the float32 state held in registers across the tokens.

One program per (V block, sequence, head) keeps its [K, BV] slice of the state; the state comes from
``initial_state`` or from a pool at a slot index and, for a pool, is written back there in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _fused_recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, pool, slots, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, USE_POOL: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    NORM: tl.constexpr,
):
    iv = tl.program_id(0)
    nh = tl.program_id(1)
    n = nh // H
    h = nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
    rk = tl.arange(0, BK)
    cv = iv * BV + tl.arange(0, BV)
    mk = rk < K
    mv = cv < V
    mkv = mk[:, None] & mv[None, :]
    off_s = rk[:, None] * V + cv[None, :]
    if USE_POOL:
        slot = tl.load(slots + n).to(tl.int64)
        sptr = pool + (slot * H + h) * K * V + off_s
        S = tl.load(sptr, mask=mkv, other=0.0)
    elif HAS_H0:
        S = tl.load(h0 + nh.to(tl.int64) * K * V + off_s, mask=mkv, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(bos, eos):
        qt = tl.load(q + (t * H + h) * K + rk, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + (t * H + h) * K + rk, mask=mk, other=0.0).to(tl.float32)
        gt = tl.load(g + (t * H + h) * K + rk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + (t * H + h) * V + cv, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(beta + t * H + h).to(tl.float32)
        if NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        S = S * tl.exp(gt)[:, None]
        pred = tl.sum(kt[:, None] * S, axis=0)
        S += kt[:, None] * (bt * (vt - pred))[None, :]
        ot = tl.sum((qt * scale)[:, None] * S, axis=0)
        tl.store(o + (t * H + h) * V + cv, ot.to(o.dtype.element_ty), mask=mv)
    if USE_POOL:
        tl.store(sptr, S, mask=mkv)
    if STORE_FINAL:
        tl.store(ht + nh.to(tl.int64) * K * V + off_s, S, mask=mkv)


def launch_config(N: int, H: int, V: int) -> tuple[int, int]:
    """The V block and warps of a launch over N sequences of H heads: small V blocks for many programs when there
    are few sequences (decode is latency-bound). Measured on the H200 (K = V = 128, H 32, pool in place,
    every V block 16-128 on 1-8 warps): BV 16 on 1 warp and BV 32 on 2 are even at
    8 and 16 sequences (16.0-16.7 / 24.6-25.7 us); at 32 sequences BV 32 on 2 warps takes 41.2-42.0 us against
    45.1-46.0; from 64 up it is the best of BV 16-128 on 1-8 warps (75.5 / 278.1 us at 64 / 256)."""
    BV = min(triton.next_power_of_2(V), 16 if N * H <= 512 else 32)
    return BV, 1 if BV <= 16 else 2


def _launch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor | None,
    final: Tensor | None, pool: Tensor | None, slots: Tensor | None, cu_seqlens: Tensor | None,
    N: int, T: int, use_qk_l2norm: bool,
) -> Tensor:
    """Packed q, k, g [T_total, H, K], v [T_total, H, V], beta [T_total, H] -> o [T_total, H, V]."""
    _, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    BK = triton.next_power_of_2(K)
    BV, num_warps = launch_config(N, H, V)
    _fused_recurrent_kernel[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, o, h0, final, pool, slots, cu_seqlens, scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, USE_POOL=pool is not None,
        STORE_FINAL=final is not None, IS_VARLEN=cu_seqlens is not None, NORM=use_qk_l2norm,
        num_warps=num_warps,
    )
    return o


def fused_recurrent_kda_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_pool: Tensor | None = None,
    slot_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA (fla's ``fused_recurrent_kda`` arguments) with an optional in-place state pool.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [N, H, K, V] float32; cu_seqlens int
    [N + 1] (then B = 1; read on the device, no host sync); state_pool [S, H, K, V] float32 contiguous with
    slot_indices int [N]: sequence n starts from ``state_pool[slot_indices[n]]`` and its state after its last
    token is written back there. Returns ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 |
    None)``. No host sync, so it can be captured in a CUDA graph.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must match q [B, T, H, K]={tuple(q.shape)}, got k {tuple(k.shape)}, g {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H] with B, T, H={B, T, H}, got "
                         f"{tuple(v.shape)}, {tuple(beta.shape)}")
    if (state_pool is None) != (slot_indices is None):
        raise ValueError("state_pool and slot_indices must be given together")
    if state_pool is not None and initial_state is not None:
        raise ValueError("give either initial_state or state_pool + slot_indices, not both")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1, got B={B}")
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V]={(N, H, K, V)}, got {tuple(initial_state.shape)}")
    if state_pool is not None:
        assert slot_indices is not None
        if state_pool.dtype != torch.float32 or not state_pool.is_contiguous() or tuple(state_pool.shape[1:]) != (H, K, V):
            raise ValueError(f"state_pool must be contiguous float32 [S, H, K, V]=[S, {H}, {K}, {V}], got "
                             f"{state_pool.dtype} {tuple(state_pool.shape)}")
        if slot_indices.shape != (N,):
            raise ValueError(f"slot_indices must be [N]=[{N}], got {tuple(slot_indices.shape)}")
    if scale is None:
        scale = K**-0.5
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    final = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    # [B, T, H, *] -> packed [B * T, H, *]
    o = _launch(
        q.reshape(B * T, H, K).contiguous(), k.reshape(B * T, H, K).contiguous(),
        v.reshape(B * T, H, V).contiguous(), g.reshape(B * T, H, K).contiguous(),
        beta.reshape(B * T, H).contiguous(), float(scale), h0, final, state_pool, slot_indices,
        cu_seqlens, N, T, use_qk_l2norm_in_kernel,
    )
    return o.view(B, T, H, V), final
