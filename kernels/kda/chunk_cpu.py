"""Chunked KDA for CPU inference: the WY form of ``naive_chunk_kda`` with every chunk's intra-chunk work done at
once, leaving three small ops per chunk in the sequential part.

On a CPU the per-chunk loop of the twin is bound by per-op overhead (~25 small ops per 16 tokens). Here each
chunk c of C tokens is reduced, in blocks of chunks, to tensors that do not depend on the state S_c it starts
from (KDA.md's notation, per head; G the in-chunk cumulative log-decay, T = I + strictly-lower beta k-decay-k):

    delta_c  = U_c - W_c S_c                     U = T^-1 (beta v),  W = T^-1 (beta k e^G)
    o_c      = Q_c S_c + A_c U_c                 Q = q e^G - A W,    A = (q k-decay) lower with the diagonal
    S_{c+1}  = e^{G_last} S_c + Kd^T delta_c     Kd = k e^{G_last - G}

so the loop over chunks is three ops each (two [C, K] x [K, V]-sized matmuls: cheaper than building a [K, K]
transition per chunk), and the outputs are one batched matmul over the stacked S_c.
The same math as the twin in another order of sums: outputs match it to float32 rounding (tests/kernels).
Shapes as in :mod:`.naive`; float32 throughout, outputs cast back to ``v.dtype``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor

from .naive import run_sequences

_BLOCK = 64
"""Chunks whose state-independent tensors are built together (``tiny``'s 2K prefill on the engine's step thread:
3,600 tok/s at 32, 3,750 at 64: fewer, larger ops)."""
_SUB = 4
"""Tokens of a sub-chunk whose decays are taken exactly (``_decayed_products``)."""
_SERIAL_STATE = 65536
"""States of at most this many elements (H * K * V) run the sequential loop on one torch thread: its ops are a
few microseconds each, and every one that goes parallel costs an OpenMP region. On the engine's step thread while
another thread of the process holds an OpenMP team, libgomp stops spinning between regions (more of its threads
than cores) and each region sleeps and wakes: ``tiny``'s loop (4 heads of 64 x 64) 110 us a chunk on 2 threads
against 23 on one (on the main thread 40 against 25; 4 heads of 128 x 128: 59 against 78 there, 275 against 77
on a thread)."""


def chunk_kda_cpu(
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
    """Same contract as :func:`.naive.naive_chunk_kda` (inference only: no autograd through the in-place ops).
    Returns ``(o [B, T, H, V], final_state [N, H, K, V] | None, checkpoint_states [M, H, K, V] | None)``."""
    return run_sequences(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
        checkpoint_positions, partial(_sequence, C=chunk_size),
    )


def _sequence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, scale: float,
              wanted: list[int], out: Tensor, ckpts: list[Tensor], C: int) -> Tensor:
    """One sequence: q, k, g [T, H, K], v [T, H, V], beta [T, H], S [H, K, V] its starting state. Writes ``out``
    [T, H, V], appends the states after the ``wanted`` positions (1-based) and returns the final state."""
    T = q.shape[0]
    full = T // C * C
    # chunk blocks, then the partial tail chunk (a block of one chunk of T - full tokens)
    spans = [(s, min(s + _BLOCK * C, full), C) for s in range(0, full, _BLOCK * C)]
    if full < T:
        spans.append((full, T, T - full))
    for s, e, c in spans:
        n = (e - s) // c
        # [e - s, H, *] -> [n, H, c, *]: chunks lead, then heads, so matmuls batch over both
        qc, kc, gc, vc = (x[s:e].view(n, c, *x.shape[1:]).transpose(1, 2) for x in (q, k, g, v))
        bc = beta[s:e].view(n, c, -1).transpose(1, 2)  # [n, H, c]
        pre = _intra(qc, kc, vc, gc, bc, scale)
        states = torch.empty(n + 1, *S.shape, dtype=S.dtype, device=S.device)  # [n + 1, H, K, V]: each S_c
        states[0] = S
        U, W, Kd_t, eGl = pre["U"], pre["W"], pre["Kd_t"], pre["eGl"]
        with _one_thread(S.numel() <= _SERIAL_STATE):
            for i in range(n):
                delta = torch.baddbmm(U[i], W[i], states[i], alpha=-1)  # U - W S_c [H, c, V]
                torch.mul(states[i], eGl[i], out=states[i + 1]).baddbmm_(Kd_t[i], delta)
        S = states[n]
        states = states[:n]
        out[s:e] = (pre["Q"] @ states + pre["O"]).transpose(1, 2).reshape(e - s, *out.shape[1:])
        for p in (p for p in wanted if s < p <= e):  # states after p tokens, from the start state of p's chunk
            i, j = (p - 1 - s) // c, (p - 1 - s) % c + 1
            ckpts.append(_state_at(pre, i, kc[i], states[i], j))
    return S


@contextmanager
def _one_thread(on: bool) -> Iterator[None]:
    """torch on one thread inside (``_SERIAL_STATE``); the count set back after. torch's count is the calling
    thread's (OpenMP's and MKL's per-thread settings); threads started meanwhile would inherit 1."""
    threads = torch.get_num_threads()
    if not on or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float) -> dict[str, Tensor]:
    """The state-independent parts of n chunks: q, k, g [n, H, C, K], v [n, H, C, V], beta [n, H, C] ->
    Q [n, H, C, K], O [n, H, C, V], U [n, H, C, V], W [n, H, C, K], Kd_t [n, H, K, C], eGl [n, H, K, 1], G
    (see the module docstring)."""
    C, K = q.shape[2], q.shape[3]
    G = g.cumsum(2)  # inclusive cumulative log-decay within each chunk
    qs = q * scale
    L, A = _decayed_products(qs, k, G, _SUB if C % _SUB == 0 else C)
    L.mul_(beta.unsqueeze(-1))  # [n, H, C, C] strictly lower
    eG = G.exp()
    rhs = torch.cat([v, k * eG], dim=-1).mul_(beta.unsqueeze(-1))  # [n, H, C, V + K]
    UW = _unit_lower_inverse(L) @ rhs
    U, W = UW.split([v.shape[-1], K], dim=-1)
    G_last = G[..., -1:, :]  # [n, H, 1, K]
    Kd_t = (k * (G_last - G).exp()).transpose(-1, -2)  # [n, H, K, C]
    eGl = G_last.transpose(-1, -2).exp()  # [n, H, K, 1]
    return {"Q": qs * eG - A @ W, "O": A @ U, "Kd_t": Kd_t, "eGl": eGl, "U": U, "W": W, "G": G}


def _unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^-1 for L [..., C, C] strictly lower (nilpotent: L^C = 0), by doubling: with M = -L,
    (I + M)(I + M^2)(I + M^4)... summed up to M^(C-1), ceil(log2 C) - 1 pairs of batched matmuls.

    Not ``torch.linalg.solve_triangular``: that is one LAPACK call per [C, C] matrix (n * H of them), each an
    OpenMP region of its own. Off the main thread (the engine's step thread) while another thread of the process
    holds an OpenMP team, libgomp stops spinning between regions (more of its threads than cores) and every region
    sleeps and wakes: 4-5x the solve's time there (``tiny``'s 4K prefill: ~0.3 s of 1.6). Same accuracy here
    (float32 rounding against a float64 solve)."""
    C = L.shape[-1]
    M = L.neg().view(-1, C, C)
    X = M.clone()
    X.diagonal(dim1=-2, dim2=-1).add_(1.0)  # I + M
    P, top = M, 1  # X holds the powers of M up to ``top``
    while top < C - 1:
        P = P @ P  # M^(top + 1)
        X = torch.baddbmm(X, X, P)  # X (I + M^(top + 1)): the powers up to 2 top + 1
        top = 2 * top + 1
    return X.view(L.shape)


def _decayed_products(qs: Tensor, k: Tensor, G: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """L [n, H, C, C] strictly lower, L_ij = k_i . (exp(G_i - G_j) k_j), and A lower with the diagonal, A_ij =
    qs_i . (exp(G_i - G_j) k_j), from q (scaled), k and G [n, H, C, K], by sub-chunks of c tokens.

    Across sub-chunks, exp(G_i - G_j) = exp(G_i - G_b) exp(G_b - G_j) about the first token b of i's sub-chunk,
    so those blocks are plain matmuls; both factors are <= 1 (j < b <= i, G falls), and factors below e^-40 are
    set to 0: the terms dropped are below 5e-18 of a unit-norm q.k, and the matmuls never meet a subnormal
    (which slows a CPU's matmul many times over). Within a sub-chunk the twin's [c, c, K] decayed keys."""
    n, H, C, K = G.shape
    m = C // c
    Gs = G.view(n, H, m, c, K)
    ref = Gs[:, :, :, :1]  # [n, H, m, 1, K]: G at each sub-chunk's first token
    left = Gs - ref  # [n, H, m, c, K]
    left = left.masked_fill_(left < -40.0, float("-inf")).exp_()
    right = ref - G[:, :, None]  # [n, H, m, C, K]: G_b - G_j for every key j
    before = torch.arange(C, device=G.device)[None, :] < torch.arange(0, C, c, device=G.device)[:, None]  # [m, C]
    right = right.masked_fill_(~before[:, :, None] | (right < -40.0), float("-inf")).exp_().mul_(k[:, :, None])
    right = right.transpose(-1, -2)  # [n, H, m, K, C], zero where j is not before the sub-chunk
    A = ((qs.view(n, H, m, c, K) * left) @ right).view(n, H, C, C)
    L = ((k.view(n, H, m, c, K) * left) @ right).view(n, H, C, C)
    # within each sub-chunk: dk[.., i, j, :] = exp(G_i - G_j) k_j for j <= i, else 0 (masked before exp)
    idx = torch.arange(c, device=G.device)
    causal = (idx[:, None] >= idx[None, :])[:, :, None]  # [c, c, 1]
    dk = (Gs[..., :, None, :] - Gs[..., None, :, :]).masked_fill_(~causal, float("-inf")).exp_()
    dk = dk.mul_(k.view(n, H, m, 1, c, K)).transpose(-1, -2)  # [n, H, m, c(i), K, c(j)]
    # the einsum "..ik,..ijk->..ij" as batched matvecs: [.., i, 1, K] @ [.., i, K, j]
    A_d = (qs.view(n, H, m, c, 1, K) @ dk).squeeze(-2)  # [n, H, m, c, c]
    L_d = (k.view(n, H, m, c, 1, K) @ dk).squeeze(-2).tril_(-1)
    # the diagonal blocks, still zero above: [n, H, m, c, m, c] viewed as [n, H, c, c, m] along the block diagonal
    A.view(n, H, m, c, m, c).diagonal(dim1=2, dim2=4).copy_(A_d.permute(0, 1, 3, 4, 2))
    L.view(n, H, m, c, m, c).diagonal(dim1=2, dim2=4).copy_(L_d.permute(0, 1, 3, 4, 2))
    return L, A


def _state_at(pre: dict[str, Tensor], i: int, k: Tensor, S: Tensor, j: int) -> Tensor:
    """The state after the first j tokens of chunk i, which starts from S [H, K, V]; k [H, C, K]."""
    G = pre["G"][i]  # [H, C, K]
    delta = pre["U"][i, :, :j] - pre["W"][i, :, :j] @ S  # [H, j, V]
    Gp = G[:, j - 1 : j]  # [H, 1, K]
    kd = k[:, :j] * (Gp - G[:, :j]).exp()
    return Gp.transpose(1, 2).exp() * S + kd.transpose(1, 2) @ delta


__all__ = ["chunk_kda_cpu"]
