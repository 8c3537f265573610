"""KDA: chunked prefill and fused-recurrent decode. CUDA tensors go to Triton, CPU tensors to the naive twins."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..gate.naive import gate_params, naive_kda_gate
from .chunk_cpu import chunk_kda_cpu
from .naive import naive_chunk_kda, naive_recurrent_kda


def chunk_kda(
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
    *,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens_cpu: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Chunked KDA forward with fla's arguments (q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay;
    beta [B, T, H]; initial_state [N, H, K, V] float32). Returns ``(o [B, T, H, V], final_state [N, H, K, V] |
    None, checkpoint_states [M, H, K, V] | None)``; see :mod:`kda_sessions.kernels.kda.naive` for positions.

    With ``use_gate_in_kernel`` (fla's flag) g holds the raw gate logits [B, T, H, K] and the gate is fused:
    A_log [H], dt_bias [H * K] float32, ``lower_bound`` None for the standard gate, < 0 for the bounded one
    (:mod:`kda_sessions.kernels.gate.naive`). ``cu_seqlens_cpu``: the same offsets as ``cu_seqlens``, on the host:
    a CUDA call then reads no offsets back from the device (which waits for every kernel queued before it)."""
    if q.is_cuda:
        from .chunk import chunk_kda_triton

        return chunk_kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, checkpoint_positions, use_gate_in_kernel, A_log, dt_bias, lower_bound,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
    if use_gate_in_kernel:
        A_log, dt_bias, lower_bound = gate_params(q.shape[2], q.shape[3], A_log, dt_bias, lower_bound)
        g = naive_kda_gate(g, A_log, dt_bias, lower_bound)
    # inference on a CPU: the batched form (in-place ops, no autograd); training keeps the obvious twin
    chunked = chunk_kda_cpu if not torch.is_grad_enabled() else naive_chunk_kda
    return chunked(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel, checkpoint_positions,
    )



def chunk_table(bounds: Sequence[int], device: torch.device) -> Tensor:
    """The device chunk table that CUDA calls of ``chunk_kda`` over sequences of these bounds (no checkpoints) read,
    from their cache: a CUDA graph that captured such a call keeps it alive by holding it."""
    from .chunk import chunk_table as table

    return table(bounds, device)

def fused_recurrent_kda(
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
    """Token-by-token KDA (decode is T = 1) with fla's arguments. With ``state_pool`` [S, H, K, V] float32 and
    ``slot_indices`` [N] the states are read from and written back to the pool in place (``initial_state`` must
    then be None). Returns ``(o [B, T, H, V], final_state [N, H, K, V] | None)``."""
    if (state_pool is None) != (slot_indices is None):
        raise ValueError("state_pool and slot_indices must be given together")
    if state_pool is not None and initial_state is not None:
        raise ValueError("give either initial_state or state_pool + slot_indices, not both")
    if q.is_cuda:
        from .fused_recurrent import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, state_pool, slot_indices,
        )
    if state_pool is not None:
        assert slot_indices is not None
        initial_state = state_pool[slot_indices.long()]
    o, final, _ = naive_recurrent_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state or state_pool is not None, cu_seqlens,
        use_qk_l2norm_in_kernel,
    )
    if state_pool is not None:
        assert slot_indices is not None and final is not None
        state_pool[slot_indices.long()] = final
        if not output_final_state:
            final = None
    return o, final
