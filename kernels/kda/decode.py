"""One KDA decode step from the projections: short conv with its tails, gate, beta, q/k l2norm, the recurrence
and the read, with the conv tails and the states updated in place in their pools at each sequence's slot.

CUDA tensors go to one Triton launch (:mod:`.decode_triton`); CPU tensors to the twin, which is the separate
ops this step fuses (conv, gate, sigmoid, fused-recurrent with a pool), each through its own twin.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..conv.naive import naive_causal_conv
from ..gate.naive import naive_kda_gate
from ..linear.naive import naive_linear
from ..norm.naive import naive_gated_rms_norm
from .naive import naive_recurrent_kda


def kda_decode(
    qkv: Tensor,
    raw: Tensor,
    b: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    state: Tensor,
    slots: Tensor,
    scale: float | None = None,
    out_norm: tuple[Tensor, Tensor, float] | None = None,
    gate_proj: Tensor | None = None,
    out_gate_proj: Tensor | None = None,
    pdl: bool = False,
) -> Tensor:
    """One new token for each of N sequences.

    qkv [N, Dc] pre-conv q | k | v rows (Dc = 2 H K + H V), raw [N, H * K] gate logits, b [N, H] beta logits
    (rows of any stride: slices of one projection output); conv_weight [Dc, W] (any strides); conv_state
    [S, W - 1, Dc] contiguous, in qkv's dtype; A_log [H], dt_bias [H * K] (the gate of
    :mod:`kda_sessions.kernels.gate.naive`, ``lower_bound`` None or < 0); state [S, H, K, V] float32 contiguous;
    slots [N] int, distinct except for rows no one reads back. q and k are l2-normalised, q scaled by ``scale``
    (None: K^-0.5). Returns o [N, H, V] in qkv's dtype; the tails and states at the slots are updated in place.
    With ``out_norm`` = (weight [V], gate [N, H * V] output-gate logits of unit column stride, eps) it returns the
    layer's gated output norm of o instead (``kernels.norm.gated_rms_norm`` of o as stored, in qkv's dtype), in
    the same launch on CUDA. No host sync on CUDA, so it can be captured in a CUDA graph.

    The gates' second projections may run inside that launch: with ``gate_proj`` [H * K, KF] (f_b's weight,
    unit column stride) ``raw`` is [N, KF], f_a's output, and the logits are ``raw @ gate_proj^T`` rounded to raw's
    dtype (as the separate projection stores them); likewise ``out_gate_proj`` [H * V, VF] (g_b's weight) with
    out_norm's gate [N, VF], g_a's output.

    ``pdl`` (CUDA on Hopper, ``kernels.moe.pdl.use_pdl``; ignored elsewhere): it is a PDL launch
    that lets the next launch start at once and waits for the launch before it before it reads anything; worth it
    where the next launch loads something before its own wait (the model's output projection at one sequence, a
    PDL matvec).
    """
    N, H = b.shape
    S, H_, K, V = state.shape
    Dc, W = conv_weight.shape
    if H_ != H or Dc != 2 * H * K + H * V:
        raise ValueError(f"state must be [S, H={H}, K, V] with conv_weight [2HK + HV, W], got {tuple(state.shape)} "
                         f"and {tuple(conv_weight.shape)}")
    KF = H * K if gate_proj is None else gate_proj.shape[1]
    if gate_proj is not None and (tuple(gate_proj.shape) != (H * K, KF) or gate_proj.stride(1) != 1):
        raise ValueError(f"gate_proj must be [H*K, KF] with H*K={H * K} and unit column stride, got "
                         f"{tuple(gate_proj.shape)} {gate_proj.stride()}")
    if tuple(qkv.shape) != (N, Dc) or tuple(raw.shape) != (N, KF) or qkv.stride(1) != 1 or raw.stride(1) != 1:
        raise ValueError(f"qkv must be [N, Dc]={N, Dc} and raw [N, {'KF' if gate_proj is not None else 'H*K'}]="
                         f"{N, KF} with unit column stride, got {tuple(qkv.shape)} {qkv.stride()}, "
                         f"{tuple(raw.shape)} {raw.stride()}")
    if tuple(conv_state.shape) != (S, W - 1, Dc) or not conv_state.is_contiguous() or conv_state.dtype != qkv.dtype:
        raise ValueError(f"conv_state must be contiguous {qkv.dtype} [S, W - 1, Dc]={S, W - 1, Dc}, got "
                         f"{conv_state.dtype} {tuple(conv_state.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous float32 [S, H, K, V], got {state.dtype}")
    if A_log.numel() != H or dt_bias.numel() != H * K or slots.shape != (N,):
        raise ValueError(f"A_log must hold H={H}, dt_bias H*K={H * K} values and slots be [N]={N}, got "
                         f"{A_log.numel()}, {dt_bias.numel()}, {tuple(slots.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound must be < 0, got {lower_bound}")
    if out_gate_proj is not None and (out_norm is None or out_gate_proj.dim() != 2
                                      or out_gate_proj.shape[0] != H * V or out_gate_proj.stride(1) != 1):
        raise ValueError(f"out_gate_proj must be [H*V, VF] with H*V={H * V} and unit column stride, beside out_norm, "
                         f"got {tuple(out_gate_proj.shape)} {out_gate_proj.stride()}")
    if out_norm is not None:
        nw, gate, _ = out_norm
        VG = H * V if out_gate_proj is None else out_gate_proj.shape[1]
        if tuple(nw.shape) != (V,) or tuple(gate.shape) != (N, VG) or gate.stride(1) != 1:
            raise ValueError(f"out_norm's weight must be [V]={V,} and gate [N, {VG}] with unit column "
                             f"stride, got {tuple(nw.shape)}, {tuple(gate.shape)} {gate.stride()}")
    if scale is None:
        scale = K**-0.5
    if qkv.is_cuda:
        from .decode_triton import kda_decode_triton

        return kda_decode_triton(qkv, raw, b, conv_weight, conv_state, A_log.reshape(H), dt_bias.reshape(H * K),
                                 lower_bound, state, slots, float(scale), out_norm, gate_proj, out_gate_proj,
                                 pdl=pdl)
    if gate_proj is not None:
        raw = naive_linear(raw, gate_proj)
    o = naive_kda_decode(qkv, raw, b, conv_weight, conv_state, A_log, dt_bias, lower_bound, state, slots, scale)
    if out_norm is None:
        return o
    nw, gate, eps = out_norm
    if out_gate_proj is not None:
        gate = naive_linear(gate, out_gate_proj)
    return naive_gated_rms_norm(o, nw, gate.reshape(N, H, V), eps, qkv.dtype)


def naive_kda_decode(
    qkv: Tensor, raw: Tensor, b: Tensor, conv_weight: Tensor, conv_state: Tensor, A_log: Tensor, dt_bias: Tensor,
    lower_bound: float | None, state: Tensor, slots: Tensor, scale: float,
) -> Tensor:
    """The twin: the separate ops of a decode step over gathered pool rows, scattered back."""
    N, H = b.shape
    K, V = state.shape[2:]
    idx = slots.long()
    cu = torch.arange(N + 1, device=qkv.device)
    y, new_tail, _ = naive_causal_conv(qkv, conv_weight, conv_state[idx], cu)
    conv_state[idx] = new_tail
    q, k, v = y.split([H * K, H * K, H * V], dim=-1)
    g = naive_kda_gate(raw.reshape(N, H, K), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    # [N, H*K] -> [N, 1, H, K]: one token per sequence
    o, final, _ = naive_recurrent_kda(
        q.reshape(N, 1, H, K), k.reshape(N, 1, H, K), v.reshape(N, 1, H, V), g.unsqueeze(1), beta.unsqueeze(1),
        scale, state[idx], True, None, True,
    )
    assert final is not None
    state[idx] = final
    return o[:, 0]


__all__ = ["kda_decode", "naive_kda_decode"]
