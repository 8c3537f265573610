"""Weights derived from a layer's parameters for its CPU decode path (projections concatenated into one matmul,
absorbed products), rebuilt whenever a source parameter changes.

A decode step on a CPU is bound by per-op overhead, not arithmetic: one matmul over concatenated weights costs
about what one of its parts does. The derived tensors are a cache, never checkpoint state: they are keyed on
each source parameter's storage, version counter, dtype and device, so loading weights, training steps and
``.to()`` all invalidate them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def weights(module: nn.Module, names: Sequence[str]) -> list[Tensor]:
    """``[getattr(module, n).weight for n in names]`` read from the modules' dicts: a decode step checks its
    sources every layer, and nn.Module's ``__getattr__`` costs more per name than the rest of the check."""
    mods = module._modules
    return [mods[n]._parameters["weight"] for n in names]  # type: ignore[union-attr,misc]


def row_matmul_weight(w: Tensor) -> Tensor:
    """A linear's weight w [out, in] as the [in, out] operand of ``x @ w`` in the layout a CPU's one-row matmul
    reads fastest: the one whose contiguous dimension is the longer (BLAS's gemv runs 2-3.5x faster along long
    rows than along short ones; bench/cpu_paths.py, ``decode_layout``). That is w's own transpose (a view, no
    copy) when ``in >= out``, else a contiguous [in, out] copy."""
    out_f, in_f = w.shape
    return w.t() if in_f >= out_f else w.t().contiguous()


def _key(params: Sequence[Tensor]) -> tuple[tuple[int, int, torch.dtype, torch.device], ...]:
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)


class DerivedWeights:
    """``get()`` returns ``build()``'s tensors (detached, in the layout built), recomputed only when one of
    ``params()`` changed since."""

    def __init__(self, params: Callable[[], Sequence[Tensor]], build: Callable[[], tuple[Tensor, ...]]) -> None:
        self._params = params
        self._build = build
        self._key: tuple[tuple[int, int, torch.dtype, torch.device], ...] | None = None
        self._value: tuple[Tensor, ...] = ()

    def get(self) -> tuple[Tensor, ...]:
        key = _key(self._params())
        if key != self._key:
            with torch.no_grad():
                self._value = tuple(t.detach() for t in self._build())
            self._key = key
        return self._value


__all__ = ["DerivedWeights", "row_matmul_weight", "weights"]
