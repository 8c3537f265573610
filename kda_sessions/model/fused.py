"""Weights derived from a layer's parameters for its CPU decode path (projections concatenated into one matmul,
absorbed products), rebuilt whenever a source parameter changes.

A decode step on a CPU is bound by per-op overhead, not arithmetic: one matmul over concatenated weights costs
about what one of its parts does. The derived tensors are a cache, never checkpoint state: they are keyed on
each source parameter's storage and version counter and the first one's dtype and device, so loading weights,
training steps and ``.to()`` all invalidate them. On a CPU they are packed into huge pages (``pack``).
"""

from __future__ import annotations

import functools
import mmap
import operator
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from ..errors import ConfigError

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 Linux."""
PACK_MIN_BYTES = HUGE_PAGE // 2
"""Derived weights at least this large are packed into huge pages (``pack``); smaller ones would waste most of one."""


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


def reduction_weight(w: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A linear's weight w [out, in] as the [in, out] operand of ``row_matmul`` under ``torch.compile``: the
    transposed view of a contiguous [out, in] copy in ``dtype``, so every output's sum runs along contiguous memory.

    ``dtype`` None: ``lossless_dtype(w)``, bfloat16 where that holds w exactly (a bfloat16 checkpoint loaded in
    float32, as the built-in ``tiny``): ``row_matmul`` sums in x's float32 either way, so every product and every
    sum is the same, from half the bytes."""
    return w.to(dtype or lossless_dtype(w)).contiguous().t()


def lossless_dtype(w: Tensor) -> torch.dtype:
    """torch.bfloat16 where w is float32 and every value of it is exactly a bfloat16, else w's dtype."""
    if w.dtype != torch.float32 or w.numel() == 0:
        return w.dtype
    return torch.bfloat16 if torch.equal(w.to(torch.bfloat16).float(), w) else w.dtype


def row_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [N, in] @ w [in, out] -> [N, out]. Eagerly ``row_mm``; while ``torch.compile`` traces, a product and a
    sum over ``in``, which inductor's C++ turns into one vectorized loop that reads each weight once (w from
    ``reduction_weight``; a bfloat16 w is summed in x's float32): for a few rows faster than BLAS's one-row matmul,
    which reads weights at well below the memory's rate (bench/cpu_paths.py, ``reduction``)."""
    if torch.compiler.is_compiling():
        return (x[:, None, :] * w.t()).sum(-1)
    return row_mm(x, w)


HALF_ROW_WEIGHTS = True
"""``row_mm`` and ``residual_matmul`` read a float32 weight as packed float16 (FBGEMM's float16-weight GEMM: float32
activations, products and sums, the weight widened in registers) where FBGEMM is there (x86) and float16 holds the
weight to within ``HALF_MAX_ERROR``: a one-row matmul streams half the bytes, and FBGEMM's kernel reads them near
a core's read rate where the BLAS's float32 one-row matmul runs at half of it (2-core EPYC VM, one thread, weights
beyond the caches: 24-31 GB/s of float16 against 16-22 of float32; a 256 x 2048 matmul 33 us against 124)."""
HALF_MAX_ERROR = 6e-8
"""The largest change of a weight float16 may make for ``HALF_ROW_WEIGHTS``: below float32's rounding of any sum
the weight enters. ``tiny`` (a bfloat16 checkpoint): 825 of its 9.0 M weights change, each by at most 3e-8 (all of
magnitude below 6e-8, under float16's normal range); its logits move by ~1e-6 relative, as float32 summation order."""

HALF_MAX_ROWS = 8
"""Rows of x up to which ``HALF_ROW_WEIGHTS`` applies (decode steps); prefill's many rows stay on the BLAS."""

_HALF_HERE: ContextVar[bool | None] = ContextVar("half_row_weights", default=None)
"""``half_row_weights``'s setting in this thread or task (None: none set)."""


@contextmanager
def half_row_weights(enabled: bool) -> Iterator[None]:
    """The float16 packs (``HALF_ROW_WEIGHTS``, which stays the switch for the whole process) on or off for the calls
    inside, in this thread or task only: an engine's step thread runs its model under its ``cpu_half_weights``. Off,
    no weight is packed (no memory beside the float32 weights) and the one-row matmuls are the BLAS's, as
    prefill's."""
    token = _HALF_HERE.set(enabled)
    try:
        yield
    finally:
        _HALF_HERE.reset(token)


_HALF: dict[int, tuple[weakref.ref[Tensor], int, Tensor | None, Tensor]] = {}
"""id of a float32 row-matmul weight -> (a weak reference to it, its version then, its FBGEMM float16 pack or None,
a zero bias)."""


def _half_pack(w: Tensor) -> tuple[Tensor | None, Tensor]:
    """The FBGEMM float16 pack of w [in, out] (a float32 CPU tensor) and a zero bias [out], made on first use and
    kept while w lives unchanged (a rebuilt derived weight is a new tensor; one changed in place is packed again);
    None where float16 cannot hold w within ``HALF_MAX_ERROR`` or FBGEMM is not in this build of torch."""
    hit = _HALF.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == _version(w):
        return hit[2], hit[3]
    packed = None
    zero = torch.zeros(w.shape[1], dtype=torch.float32)
    if _fbgemm_fp16() and w.dim() == 2 and w.numel():
        half = w.to(torch.float16)
        if bool((half.float() - w).abs().max() <= HALF_MAX_ERROR):
            with warnings.catch_warnings():  # torch marks the FBGEMM float16 ops deprecated (they still ship)
                warnings.simplefilter("ignore")
                packed = torch.fbgemm_pack_gemm_matrix_fp16(w.t().contiguous())
                torch.fbgemm_linear_fp16_weight(torch.zeros(1, w.shape[0]), packed, zero)  # its warning, once
    for key in [k for k, v in _HALF.items() if v[0]() is None]:  # the packs of weights gone
        del _HALF[key]
    _HALF[id(w)] = (weakref.ref(w), _version(w), packed, zero)
    return packed, zero


def _version(w: Tensor) -> int:
    """w's version counter; -1 for an inference tensor, which has none (nothing changes one in place but
    inference-mode code)."""
    return -1 if w.is_inference() else w._version


@functools.cache
def _fbgemm_fp16() -> bool:
    return hasattr(torch, "fbgemm_linear_fp16_weight") and "fbgemm" in torch.backends.quantized.supported_engines


def _half(x: Tensor, w: Tensor) -> bool:
    """Whether ``row_mm`` may run x @ w on FBGEMM's float16 pack of w."""
    return HALF_ROW_WEIGHTS and _HALF_HERE.get() is not False and x.shape[0] <= HALF_MAX_ROWS \
        and w.dtype == torch.float32 == x.dtype \
        and w.device.type == "cpu" and not w.requires_grad


def row_mm(x: Tensor, w: Tensor) -> Tensor:
    """x [N, in] @ w [in, out] on a CPU's eager decode path: ``torch.mm``, or with ``HALF_ROW_WEIGHTS`` (a float32 x
    of up to ``HALF_MAX_ROWS`` rows and w) FBGEMM's float16-weight GEMM (``_half_pack``)."""
    if _half(x, w):
        packed, zero = _half_pack(w)
        if packed is not None:
            return torch.fbgemm_linear_fp16_weight(x, packed, zero)
    return torch.mm(x, w)


def residual_matmul(residual: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """residual [N, out] + x [N, in] @ w [in, out], eagerly. float32: one ``torch.addmm`` (the add inside the
    matmul's call, one op fewer; the same values as the separate add on tiny's layouts, else within float32's
    rounding), or with ``HALF_ROW_WEIGHTS`` (``row_mm``) FBGEMM's float16-weight GEMM with the one row's residual
    as its bias. Other dtypes: the separate matmul and add, as a half-precision addmm would round the sum once where
    the separate ops round the product first."""
    if residual.dtype == torch.float32:
        if _half(x, w):
            packed, zero = _half_pack(w)
            if packed is not None:
                if residual.shape[0] == 1:
                    return torch.fbgemm_linear_fp16_weight(x, packed, residual.reshape(-1))
                return residual + torch.fbgemm_linear_fp16_weight(x, packed, zero)
        return torch.addmm(residual, x, w)
    return residual + torch.mm(x, w)


def pack(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``tensors`` with those of the first one's dtype copied into one buffer whose pages Linux is asked to back
    with transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured where THP is ``madvise`` or ``always``).

    A CPU decode step streams every weight once; through 2 MiB pages instead of 4 KiB ones (fewer TLB misses) its
    one-row matmuls run ~15% faster and tiny's whole step ~10% (bench/cpu_paths.py, ``decode_layout``). Values and
    layouts are unchanged (each packed tensor is contiguous or a transposed contiguous matrix, as before); the
    rest pass through, as do all of them off Linux, on a GPU, or below ``PACK_MIN_BYTES``."""
    if not sys.platform.startswith("linux") or not tensors or tensors[0].device.type != "cpu":
        return tuple(tensors)
    dtype, size = tensors[0].dtype, tensors[0].element_size()
    offsets: list[int | None] = []
    n = 0
    for t in tensors:
        dense = t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())
        if t.dtype != dtype or t.device.type != "cpu" or not dense:
            offsets.append(None)
            continue
        offsets.append(n)
        n += -(-t.numel() * size // 64) * 64 // size  # each tensor on its own cache lines
    if n * size < PACK_MIN_BYTES:
        return tuple(tensors)
    buf = huge_page_zeros(n, dtype)
    out = []
    for t, o in zip(tensors, offsets):
        if o is None:
            out.append(t)
            continue
        region = buf[o : o + t.numel()]
        view = region.view(t.shape) if t.is_contiguous() else region.view(t.shape[1], t.shape[0]).t()
        out.append(view.copy_(t))
    return tuple(out)


def huge_page_zeros(numel: int, dtype: torch.dtype) -> Tensor:
    """A zeroed 1-d CPU tensor of ``numel`` elements on a fresh private anonymous mapping, starting on a huge-page
    boundary and advised for transparent huge pages before its first write (memory from the allocator may have been
    touched already, as 4 KiB pages). The kernel's zero pages cost nothing until written: a pool of which a step
    touches little neither waits for a memset nor holds memory it never used. Linux only (``mmap.MAP_PRIVATE``).

    The tensor starts at the mapping's second huge-page boundary, never at its first byte: its views (a slot's rows)
    have a storage offset of at least one huge page, so a ``torch.compile``d step that takes them specializes no
    graph on offset 0 (the untouched page costs no memory)."""
    size = torch.empty(0, dtype=dtype).element_size()
    span = -(-numel * size // HUGE_PAGE) * HUGE_PAGE
    area = mmap.mmap(-1, span + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=dtype)  # keeps ``area`` alive as long as a view of it lives
    start = ((-raw.data_ptr()) % HUGE_PAGE + HUGE_PAGE) // size  # the second huge-page boundary in the mapping
    return raw[start : start + numel]


def _key(params: Sequence[Tensor]) -> tuple[object, ...]:
    # checked once per layer per decode step: each attribute read costs a tenth of a microsecond, so the dtype
    # and device once (a module moves all of its parameters, each to new storage), storage and version of each
    if not params:
        return ()
    return (params[0].dtype, params[0].device, *[p.data_ptr() for p in params], *[p._version for p in params])


class DerivedWeights:
    """``get()`` returns ``build()``'s tensors (detached, in the layout built), recomputed only when one of
    ``params()`` changed since."""

    def __init__(self, params: Callable[[], Sequence[Tensor]], build: Callable[[], tuple[Tensor, ...]]) -> None:
        self._params = params
        self._build = build
        self._key: tuple[object, ...] | None = None
        self._value: tuple[Tensor, ...] = ()

    def get(self) -> tuple[Tensor, ...]:
        key = _key(self._params())
        if key != self._key:
            with torch.no_grad():
                self._value = pack([t.detach() for t in self._build()])
            self._key = key
        return self._value


class ParamWatch:
    """``changed()``: whether any parameter of ``modules`` was replaced, moved or modified in place since the last
    call (True on the first): the parameters' identities, storages and version counters, the key of
    ``DerivedWeights``, read for all of them in one pass.

    A decode step on a CPU streams more weights than the caches hold, so every parameter object a check touches is
    a cache miss: one pass over the step's ~140 parameters costs a third of what 17 ``DerivedWeights.get`` calls
    cost, each resolving its sources through the module tree. The modules themselves are fixed at construction: a
    submodule swapped for another is not seen (the caller rebuilds the watch when its modules change)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        refs = [(m, n) for m in modules for n, p in m._parameters.items() if p is not None]
        self._dicts = [m._parameters for m, _ in refs]
        self._names = [n for _, n in refs]
        self._owners = [type(m).__name__ for m, _ in refs]
        self._held: list[Tensor] = []  # the last parameters seen, kept alive so that no new one reuses their ids
        self._key: tuple[int, ...] = ()

    def changed(self) -> bool:
        """Raises ConfigError when a watched parameter was deleted or set to None (the model cannot run without it)."""
        try:
            params: list[Tensor] = list(map(operator.getitem, self._dicts, self._names))  # type: ignore[arg-type]
            key = (*map(id, params), *map(Tensor.data_ptr, params), *map(_VERSION, params))
        except (KeyError, TypeError):
            gone = [f"{o}.{n}" for d, n, o in zip(self._dicts, self._names, self._owners) if d.get(n) is None]
            raise ConfigError(f"the model's parameter {', '.join(gone)} was deleted or set to None; a model runs "
                              "with every parameter it was built with") from None
        if key == self._key:
            return False
        self._held, self._key = params, key
        return True


_VERSION = operator.attrgetter("_version")


__all__ = ["HALF_ROW_WEIGHTS", "DerivedWeights", "ParamWatch", "half_row_weights", "huge_page_zeros", "lossless_dtype",
           "pack", "reduction_weight", "residual_matmul", "row_matmul", "row_matmul_weight", "row_mm", "weights"]
