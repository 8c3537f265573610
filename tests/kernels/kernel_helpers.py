"""Shared helpers for the kernel tests: relative RMS error, KDA inputs with either gate, and a Gluon kernel
compiled for sm_90 without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kda_sessions.kernels.gate.naive import naive_kda_gate


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kda_inputs(B: int, T: int, H: int, K: int, V: int, bounded: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    raw = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 - 2.0
    g = naive_kda_gate(raw, A_log, dt_bias, -5.0 if bounded else None)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def packed_or_batched(varlen: bool, H: int, K: int, V: int, bounded: bool):
    """(q, k, v, g, beta, cu_seqlens) of two sequences: packed (21 and 70 tokens: one partial chunk, and a whole
    chunk then a partial one) when ``varlen``, else a batch of two of 70 tokens (cu_seqlens None)."""
    if varlen:
        return (*kda_inputs(1, 91, H, K, V, bounded, seed=1), torch.tensor([0, 21, 91]))
    return (*kda_inputs(2, 70, H, K, V, bounded, seed=2), None)


def gate_case(H: int, K: int, V: int):
    """(q, k, v, beta, raw gate logits, A_log, dt_bias, cu_seqlens, checkpoints): two packed sequences of 30 and
    45 tokens with checkpoints, for the kernels' fused gate."""
    q, k, v, _, beta = kda_inputs(1, 75, H, K, V, False, seed=9)
    gen = torch.Generator().manual_seed(10)
    raw = torch.randn(1, 75, H, K, generator=gen) * 3
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen) - 1.0
    return q, k, v, beta, raw, A_log, dt_bias, torch.tensor([0, 30, 75]), [[7, 30], [45]]


_GLUON_HEAD = """
import inspect, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
"""

_GLUON_TAIL = """
params = list(inspect.signature(fn.fn).parameters)
sig = {p: "constexpr" if p in const else types[p] for p in params}
src = GluonASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in const.items()},
                     attrs={(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p][0] == "*"})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
print(json.dumps({"shared": k.metadata.shared, "ptx": k.asm["ptx"]}))
"""


def compile_gluon_sm90(setup: str, *args: str, num_warps: int = 4) -> dict:
    """A Gluon kernel compiled for sm_90 on ``num_warps`` warps by the installed Triton (its bundled ptxas; no GPU needed), in a
    process of its own: the kernel folder's conftest turns the interpreter on without a GPU, and Gluon's library
    functions decorated under it cannot be compiled. ``setup`` (run with ``args`` as sys.argv[1:], after the
    imports of torch, triton, json, sys, inspect and ``mangle_type``) sets ``fn`` (the kernel), ``types`` (each
    argument's Triton type) and ``const`` (each constexpr's value). Returns {"shared": bytes, "ptx": text}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _GLUON_HEAD + f"NUM_WARPS = {int(num_warps)}\n" + setup + _GLUON_TAIL
    res = subprocess.run([sys.executable, "-c", code, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
