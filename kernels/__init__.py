"""Kernels: one folder per op, each with a plain-torch twin (``naive.py``). CUDA tensors go to Triton."""

from .conv import causal_conv
from .gate import kda_gate
from .kda import chunk_kda, fused_recurrent_kda
from .mla import mla_decode_paged

__all__ = ["causal_conv", "chunk_kda", "fused_recurrent_kda", "kda_gate", "mla_decode_paged"]
