"""Plain-torch twins of the KDA kernels: the token-by-token recurrence (the reference) and the chunked WY form.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay (<= 0); beta [B, T, H];
states [N, H, K, V] float32. With ``cu_seqlens`` (int [N + 1]) B must be 1 and the N sequences are packed
along T. All arithmetic is float32; outputs are cast back to ``v.dtype``.

Checkpoint extension: ``checkpoint_positions`` lists, per sequence, positions p (1 <= p <= T_n, ascending) at
which the state after the first p tokens of that call is returned, flattened in sequence order into
``[M, H, K, V]`` float32. Requesting them never changes ``o`` or the final state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _split(
    q: Tensor, cu_seqlens: Tensor | None
) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, checkpoint_positions):
    """Validate the arguments of the twins (and of ``chunk_cpu``); returns float32 q, k (l2-normed when asked), v,
    g, beta, the scale and every sequence's (batch index, start, end)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k and g must match q [B, T, H, K]={tuple(q.shape)}, got k {tuple(k.shape)}, g {tuple(g.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H={B, T, H}, got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]={B, T, H}, got {tuple(beta.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1, got B={B}")
    seqs = _split(q, cu_seqlens)
    if initial_state is not None and tuple(initial_state.shape) != (len(seqs), H, K, V):
        raise ValueError(
            f"initial_state must be [N, H, K, V]={(len(seqs), H, K, V)}, got {tuple(initial_state.shape)}"
        )
    if checkpoint_positions is not None:
        if len(checkpoint_positions) != len(seqs):
            raise ValueError(f"checkpoint_positions needs one list per sequence ({len(seqs)}), got {len(checkpoint_positions)}")
        for n, ((_, bos, eos), ps) in enumerate(zip(seqs, checkpoint_positions)):
            if list(ps) != sorted(set(ps)) or any(p < 1 or p > eos - bos for p in ps):
                raise ValueError(f"checkpoint_positions[{n}] must be ascending in [1, {eos - bos}], got {list(ps)}")
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q.float(), k.float(), v.float(), g.float(), beta.float(), scale, seqs


SequenceRun = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, list[int], Tensor, list[Tensor]], Tensor]
"""One sequence's KDA: ``(q, k, v, g, beta, S, scale, wanted, out, ckpts) -> final S``, with q, k, g [T, H, K],
v [T, H, V], beta [T, H] float32, S [H, K, V] its starting state, ``wanted`` the checkpoint positions (tokens
after the sequence's start), ``out`` [T, H, V] the output rows to write, ``ckpts`` the list to append states to."""


def run_sequences(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, initial_state: Tensor | None,
    output_final_state: bool, cu_seqlens: Tensor | None, use_qk_l2norm_in_kernel: bool,
    checkpoint_positions: Sequence[Sequence[int]] | None, run: SequenceRun,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The driver every CPU path of KDA shares: :func:`prepare`, then ``run`` once per sequence; returns
    ``(o [B, T, H, V], final_state [N, H, K, V] | None, checkpoint_states [M, H, K, V] | None)``."""
    out_dtype = v.dtype
    q, k, v, g, beta, scale, seqs = prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, checkpoint_positions
    )
    _, _, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros_like(v)
    finals: list[Tensor] = []
    ckpts: list[Tensor] = []
    for n, (b, bos, eos) in enumerate(seqs):
        S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device)
        if initial_state is not None:
            S = initial_state[n].float().clone()
        wanted = list(checkpoint_positions[n]) if checkpoint_positions is not None else []
        sl = slice(bos, eos)
        finals.append(run(q[b, sl], k[b, sl], v[b, sl], g[b, sl], beta[b, sl], S, scale, wanted, o[b, sl], ckpts))
    final = torch.stack(finals) if output_final_state else None
    ck = None
    if checkpoint_positions is not None:
        ck = torch.stack(ckpts) if ckpts else q.new_zeros(0, H, K, V)
    return o.to(out_dtype), final, ck


def naive_recurrent_kda(
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
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The KDA recurrence one token at a time: decay, delta update, read (KDA.md). Returns
    ``(o [B, T, H, V], final_state [N, H, K, V] | None, checkpoint_states [M, H, K, V] | None)``."""
    return run_sequences(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         use_qk_l2norm_in_kernel, checkpoint_positions, _recurrent)


def _recurrent(q, k, v, g, beta, S, scale: float, wanted: list[int], out: Tensor, ckpts: list[Tensor]) -> Tensor:
    """One sequence token by token (a :data:`SequenceRun`)."""
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, :, None]
        pred = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - pred)[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, S)
        if t + 1 in wanted:
            ckpts.append(S.clone())
    return S


def _chunk(q, k, v, g, beta, S, scale: float, wanted: list[int], out: Tensor, ckpts: list[Tensor]) -> Tensor:
    """One chunk of C tokens for all H heads; q, k, g [C, H, K], v [C, H, V], beta [C, H], S [H, K, V].
    Writes ``out`` [C, H, V]; appends states after token p (1-based within the chunk) for p in ``wanted``."""
    C = q.shape[0]
    # [H, C, *]: heads lead so that batched matmuls run per head
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))
    G = g.cumsum(1)  # [H, C, K] inclusive cumulative log-decay
    idx = torch.arange(C, device=q.device)
    causal = (idx[:, None] >= idx[None, :])[None, :, :, None]
    # dk[h, i, j, k] = exp(G_i - G_j) k_j for j <= i, else 0: masked before exp so that j > i (positive exponents)
    # never overflow; one [H, C, C, K] tensor serves both products below
    diff = G[:, :, None, :] - G[:, None, :, :]
    if torch.is_grad_enabled() and (k.requires_grad or g.requires_grad):  # training on a CPU: autograd keeps exp's output
        dk = diff.masked_fill(~causal, float("-inf")).exp() * k[:, None, :, :]
    else:  # inference: in place (a third faster at Kimi shapes than with the temporaries)
        dk = diff.masked_fill_(~causal, float("-inf")).exp_().mul_(k[:, None, :, :])
    qs = q * scale
    L = beta[:, :, None] * torch.einsum("hik,hijk->hij", k, dk).tril(-1)  # [H, C, C], strictly lower
    A_qk = torch.einsum("hik,hijk->hij", qs, dk)  # [H, C, C], lower with the diagonal
    eye = torch.eye(C, device=q.device, dtype=q.dtype).expand(q.shape[0], C, C)
    eG = G.exp()
    rhs = beta[:, :, None] * (v - (k * eG) @ S)  # [H, C, V]
    delta = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)  # v' of KDA.md
    out.copy_(((qs * eG) @ S + A_qk @ delta).transpose(0, 1))
    for p in wanted:  # the state after p tokens, from the chunk-start state: no change to the main path
        Gp = G[:, p - 1 : p, :]  # [H, 1, K]
        kd = k[:, :p] * (Gp - G[:, :p]).exp()
        ckpts.append(Gp.transpose(1, 2).exp() * S + kd.transpose(1, 2) @ delta[:, :p])
    G_last = G[:, -1:, :]  # [H, 1, K]
    return G_last.transpose(1, 2).exp() * S + (k * (G_last - G).exp()).transpose(1, 2) @ delta


def naive_chunk_kda(
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
    checkpoint_positions: Sequence[Sequence[int]] | None = None,
    chunk_size: int = 16,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """KDA in the chunked WY form of KDA.md (the CPU prefill path); same contract as
    :func:`naive_recurrent_kda`. Chunks start at each sequence's first token of this call. ``chunk_size`` 16: on a
    CPU the intra-chunk decay tensor [H, C, C, K] costs more than the per-chunk overhead saves (the Triton kernel
    uses 64; docs/benchmarks.md, "CPU prefill")."""
    return run_sequences(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
        checkpoint_positions, partial(_chunks, chunk_size=chunk_size),
    )


def _chunks(q, k, v, g, beta, S, scale: float, wanted: list[int], out: Tensor, ckpts: list[Tensor],
            chunk_size: int) -> Tensor:
    """One sequence chunk by chunk (a :data:`SequenceRun` once ``chunk_size`` is bound)."""
    T = q.shape[0]
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        here = [p - s for p in wanted if s < p <= e]
        S = _chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S, scale, here, out[s:e], ckpts)
    return S
