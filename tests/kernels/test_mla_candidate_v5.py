"""The MLA decode candidate bench/candidates/paged_decode_v5.py (the shipped "tokens" form with lazy rescaling and
unmasked full tiles) against the float32 twin, under TRITON_INTERPRET=1 at small shapes.

A candidate may replace kernels/mla/paged_decode.py only if these pass and the device run shows it correct and
faster. Tolerances as tests/kernels/test_conv_mla_triton.py: relative RMS error 1e-5 (float32), 1e-3 (float16
inputs, output and partials; bfloat16 is checked on the GPU only, bench/kernels.py --only checkmla)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
import torch

from kda_sessions.kernels.mla.naive import gather_latent, naive_mla_decode_paged

from .kernel_helpers import rel_rms

CANDIDATE = Path(__file__).resolve().parents[2] / "bench" / "candidates" / "paged_decode_v5.py"
TOL = 1e-5
TOL_HALF = 1e-3
SCALE = 0.1
LOG2E = 1.4426950408889634


def load_v5() -> ModuleType:
    """paged_decode_v5.py as a module of ``kda_sessions.kernels.mla`` (as bench/kernels.py ``--mla-cand`` loads
    it), so that its relative import of the shipped module resolves."""
    name = "kda_sessions.kernels.mla._candidate_paged_decode_v5"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CANDIDATE)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _inputs(lens: list[int], P: int, max_pages: int | None = None, dtype: torch.dtype = torch.float32):
    """(q_lat [N, 4, 32], q_pe [N, 4, 16], kv_pages, page_table [N, max_pages], seq_lens [N]) over a shuffled pool
    whose rows past each sequence's end are NaN and whose table entries past a sequence's pages name a page of
    NaN (as the shipped kernel's tests): a read past the end, or an empty split the merge does not ignore, shows."""
    gen = torch.Generator().manual_seed(len(lens) * 100 + P)
    N, H, R, DR = len(lens), 4, 32, 16
    need = [-(-L // P) for L in lens]
    max_pages = max_pages or max(need)
    used = sum(need)
    kv = torch.randn(used + 1, P, R + DR, generator=gen)
    kv[used] = float("nan")
    pages = torch.randperm(used, generator=gen).int()
    pt = torch.full((N, max_pages), used, dtype=torch.int32)
    for n, (L, k) in enumerate(zip(lens, need)):
        pt[n, :k] = pages[sum(need[:n]) : sum(need[:n]) + k]
        kv[pt[n, k - 1], L - (k - 1) * P :] = float("nan")
    ql, qp = torch.randn(N, H, R, generator=gen), torch.randn(N, H, DR, generator=gen)
    return ql.to(dtype), qp.to(dtype), kv.to(dtype), pt, torch.tensor(lens)


def _growing(lens: list[int], P: int, max_pages: int, rates: list[float], BN: int, dtype: torch.dtype):
    """_inputs whose score for head h grows by about rates[h] (log2 units) per BN tokens: latent channel 0 of
    token t is t / BN and q_lat[:, h, 0] is rates[h] / (SCALE log2 e); the other channels add noise of about one
    log2 unit. A head with a negative rate peaks in the first tile."""
    ql, qp, kv, pt, sl = _inputs(lens, P, max_pages)
    for n, L in enumerate(lens):
        t = torch.arange(L)
        kv[pt[n, t // P].long(), t % P, 0] = t.float() / BN
    ql[:, :, 0] = torch.tensor(rates) / (SCALE * LOG2E)
    return ql.to(dtype), qp.to(dtype), kv.to(dtype), pt, sl


class Lazy(NamedTuple):
    rescales: int  # rescaling tiles, each split's first tile included
    tiles: int
    splits: int  # splits holding tokens
    growth: float  # the largest rise of a head's score above its split's first-tile max (log2 units)


def _lazy(ql, qp, kv, pt, sl, num_splits: int, BN: int, tau: float) -> Lazy:
    """What v5's split kernel does on these inputs: per split of the launcher's length, per BN-token tile, a
    rescale when some head's tile max exceeds the running max by more than ``tau``."""
    R = ql.shape[-1]
    tps = math.ceil(pt.shape[1] * kv.shape[1] / num_splits / BN) * BN  # the launcher's split length
    rescales = tiles = splits = 0
    growth = 0.0
    for n, L in enumerate(sl.tolist()):
        lat = gather_latent(kv, pt[n], L).float()  # [L, r + dr]
        s = (ql[n].float() @ lat[:, :R].t() + qp[n].float() @ lat[:, R:].t()) * SCALE * LOG2E  # [H, L], log2
        for start in range(0, L, tps):
            splits += 1
            m = torch.full((s.shape[0],), -1e30)
            for t0 in range(start, min(start + tps, L), BN):
                tiles += 1
                m_t = s[:, t0 : min(t0 + BN, start + tps, L)].max(dim=1).values
                if (m_t - m).max() > tau:
                    rescales += 1
                    m = torch.maximum(m, m_t)
            first = s[:, start : min(start + BN, L)].max(dim=1).values
            growth = max(growth, float((s[:, start : min(start + tps, L)].max(dim=1).values - first).max()))
    return Lazy(rescales, tiles, splits, growth)


# (lens, P, table width, num_splits, launch parameters): the shipped tests' cases (one sequence, three, nine,
# short sequences in a wide table split 16 ways), then lengths at page, tile and split boundaries (256-token
# table in 4 splits of 64 tokens) with tiles across pages (P 16, BN 64), a page per tile (BN = P) and two tiles
# per page (P 64, BN 32)
EDGES_16 = [1, 15, 16, 17, 63, 64, 65, 128, 129, 200]
EDGES_64 = [1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 256]
CASES = {
    "N1-P16": ([300], 16, None, None, {}),
    "N3-P64": ([1, 37, 80], 64, None, None, {}),
    "N3-P16-3splits": ([1, 37, 80], 16, None, 3, {}),
    "N9-P16": ([1, 2, 5, 17, 33, 64, 65, 100, 7], 16, None, None, {}),
    "empty-splits-P16": ([1, 5, 70], 16, 64, 16, {}),
    "empty-splits-P64": ([1, 5, 70], 64, 16, 16, {}),
    "edges-P16-BN64": (EDGES_16, 16, 16, 4, {}),
    "edges-P16-BN16": (EDGES_16, 16, 16, 4, {"BN": 16}),
    "edges-P64-BN64": (EDGES_64, 64, 4, 4, {}),
    "edges-P64-BN32": (EDGES_64, 64, 4, 4, {"BN": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_v5_matches_twin(case):
    lens, P, max_pages, num_splits, cfg = CASES[case]
    ql, qp, kv, pt, sl = _inputs(lens, P, max_pages)
    o = load_v5()._launch(ql, qp, kv, pt, sl, SCALE, num_splits, **cfg)
    assert not o.isnan().any()
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, SCALE)) < TOL


@pytest.mark.parametrize("P", [16, 64])
def test_v5_long_splits_and_defaults(P):
    """Splits of 8 tiles (2 splits of a 1,024-token table), sequences ending inside the first split, in the
    second and at the table's end; the defaults are the shipped ones plus TAU 8."""
    v5 = load_v5()
    ql, qp, kv, pt, sl = _inputs([200, 700, 1024], P, 1024 // P)
    args = (ql, qp, kv, pt, sl, SCALE, 2)
    o = v5._launch(*args)
    assert not o.isnan().any()
    assert rel_rms(o, naive_mla_decode_paged(ql, qp, kv, pt, sl, SCALE)) < TOL
    assert torch.equal(o, v5._launch(*args, BN=64, num_warps=4, num_stages=2, form="tokens", TAU=8.0))


@pytest.mark.parametrize("lens", [[300], [1, 37, 80]], ids=["N1", "N3"])
def test_v5_half(lens):
    """float16 q and cache: float16 partials, and p up to 2^TAU through the float16 operand of acc's product."""
    ql, qp, kv, pt, sl = _inputs(lens, 16, 64, dtype=torch.float16)
    o = load_v5()._launch(ql, qp, kv, pt, sl, SCALE, 8)
    assert o.dtype == torch.float16
    assert rel_rms(o, naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, SCALE)) < TOL_HALF


# (lens, P, table width, num_splits, BN, per-tile growth of each head's score in log2 units, dtype): heads
# growing at different rates, one flat and one peaking in its first tile; one sequence in one split (float32 and
# float16), and two sequences in splits of 352 tokens. In each case some split's scores rise more than 128 above
# its first tile's: a kernel that stopped rescaling would overflow float32 (and float16's operand of the second
# product overflows past 16, so a TAU too large shows there)
GROWTH = {
    "N1-P16-BN16": ([300], 16, 19, 1, 16, [8.0, 1.0, 0.0, -2.0], torch.float32),
    "N1-P16-BN16-fp16": ([300], 16, 19, 1, 16, [8.0, 1.0, 0.0, -2.0], torch.float16),
    "N2-P64-BN16-2splits": ([700, 250], 64, 11, 2, 16, [7.0, -1.0, 2.5, 0.0], torch.float32),
}


@pytest.mark.parametrize("case", list(GROWTH))
def test_v5_lazy_rescale_fires_repeatedly(case):
    """Scores that grow along the sequence: with TAU 8 the rescale fires many times per split but not at every
    tile, with TAU 0 at every tile where a max grows; both match the twin, each other and the shipped kernel
    (which rescales at every tile)."""
    from kda_sessions.kernels.mla.paged_decode import _launch as shipped_launch

    lens, P, max_pages, num_splits, BN, rates, dtype = GROWTH[case]
    ql, qp, kv, pt, sl = _growing(lens, P, max_pages, rates, BN, dtype)
    lazy = _lazy(ql, qp, kv, pt, sl, num_splits, BN, 8.0)
    eager = _lazy(ql, qp, kv, pt, sl, num_splits, BN, 0.0)
    assert 2 * lazy.splits < lazy.rescales < eager.rescales <= lazy.tiles and lazy.growth > 128, (lazy, eager)
    tol = TOL if dtype == torch.float32 else TOL_HALF
    ref = naive_mla_decode_paged(ql.float(), qp.float(), kv.float(), pt, sl, SCALE)
    v5 = load_v5()
    o8 = v5._launch(ql, qp, kv, pt, sl, SCALE, num_splits, BN=BN)
    o0 = v5._launch(ql, qp, kv, pt, sl, SCALE, num_splits, BN=BN, TAU=0.0)
    shipped = shipped_launch(ql, qp, kv, pt, sl, SCALE, num_splits, BN=BN, form="tokens")
    assert rel_rms(o8, ref) < tol and rel_rms(o0, ref) < tol
    assert rel_rms(o8, o0) < tol and rel_rms(o0, shipped) < tol and rel_rms(o8, shipped) < tol


def test_v5_empty_batch_and_bad_parameters():
    v5 = load_v5()
    ql, qp, kv, pt, sl = _inputs([5], 16)
    assert v5._launch(ql[:0], qp[:0], kv, pt[:0], sl[:0], SCALE).shape == (0, 4, 32)
    with pytest.raises(ValueError, match="form must be 'tokens'"):
        v5._launch(ql, qp, kv, pt, sl, SCALE, form="heads")
    with pytest.raises(TypeError, match="unknown launch parameters"):
        v5._launch(ql, qp, kv, pt, sl, SCALE, tau=8.0)
    with pytest.raises(ValueError, match="TAU must be in"):
        v5._launch(ql, qp, kv, pt, sl, SCALE, TAU=-1.0)
    with pytest.raises(ValueError, match="TAU must be in"):  # 2^16 overflows float16
        v5._launch(ql.half(), qp.half(), kv.half(), pt, sl, SCALE, TAU=16.0)
