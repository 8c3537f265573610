"""MLA prefill attention: the tiled twin and the Triton flash kernel (under TRITON_INTERPRET=1 on a CPU) against the
dense twin ``naive_mla_prefill``, and so does the CPU path (torch's flash kernel per tile), over a shuffled page table, with and without a cached prefix, in one block or
several. Tolerance: relative RMS error 1e-5 (float32 everywhere); 2e-2 for bf16 on a GPU (gpu-marked)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.mla import mla_prefill_paged
from kda_sessions.kernels.mla.naive import gather_latent, naive_mla_prefill, naive_mla_prefill_paged

from .kernel_helpers import rel_rms

TOL = 1e-5


def _case(T: int, start: int, H: int, dn: int, dr: int, dv: int, r: int, P: int, seed: int = 0,
          device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    L = start + T
    n_pages = -(-L // P)
    kv_pages = torch.randn(n_pages + 3, P, r + dr, generator=gen)
    pages = torch.randperm(n_pages + 3, generator=gen)[:n_pages].int()
    q = torch.randn(T, H, dn + dr, generator=gen)
    w = torch.randn(H * (dn + dv), r, generator=gen) / r**0.5
    to = dict(device=device, dtype=dtype)
    return q.to(**to), kv_pages.to(**to), pages.to(device), w.to(**to), (dn + dr) ** -0.5


def _dense(q, kv_pages, pages, start, w, dn, dv, scale):
    lat = gather_latent(kv_pages, pages, start + q.shape[0]).float()
    return naive_mla_prefill(q.float(), lat, w.float(), dn, dv, scale, start)


@pytest.mark.parametrize("T,start,tile", [(37, 0, 1024), (37, 0, 8), (20, 45, 16), (5, 70, 32), (1, 9, 4)],
                         ids=lambda x: str(x))
def test_tiled_twin_matches_dense(T, start, tile):
    dn, dv = 12, 10
    q, kv, pages, w, scale = _case(T, start, H=3, dn=dn, dr=6, dv=dv, r=16, P=8)
    ref = _dense(q, kv, pages, start, w, dn, dv, scale)
    out = naive_mla_prefill_paged(q, kv, pages, start, w, dv, scale, tile=tile)
    assert out.shape == (T, 3, dv) and rel_rms(out, ref) < TOL


@pytest.mark.parametrize("T,start,block,splits", [(40, 0, 1024, 1), (23, 50, 1024, 1), (40, 30, 16, 1),
                                                  (17, 100, 32, 1), (23, 50, 1024, 3), (17, 100, 32, 2),
                                                  (5, 120, 48, 4), (40, 30, 16, 2)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_triton_matches_dense(T, start, block, splits, tma, monkeypatch):
    """Each block's keys folded by one program a (query tile, head), or shared by ``splits`` programs whose
    partials ``_merge_kernel`` folds (some splits past the diagonal of some tiles, a short last block with fewer);
    key tiles by pointer loads and through TMA descriptors (``prefill.TMA``: a tile past the block's end reads
    zeros)."""
    from kda_sessions.kernels.mla import prefill
    from kda_sessions.kernels.mla.prefill import mla_prefill_triton

    monkeypatch.setattr(prefill, "TMA", tma)

    dn, dv = 16, 16
    q, kv, pages, w, scale = _case(T, start, H=2, dn=dn, dr=16, dv=dv, r=32, P=8, seed=1)
    ref = _dense(q, kv, pages, start, w, dn, dv, scale)
    out = mla_prefill_triton(q, kv, pages, start, w, dv, scale, block_tokens=block, splits=splits)
    assert out.shape == (T, 2, dv) and rel_rms(out, ref) < TOL


@pytest.mark.parametrize("T,H,block,sms,want", [(128, 32, 16384, 132, 9), (8192, 32, 16384, 132, 1),
                                                (256, 32, 16384, 132, 5), (512, 32, 16384, 132, 1), (128, 32, 512, 132, 2),
                                                (100, 2, 16, 1, 1)])
def test_key_splits(T, H, block, sms, want):
    """Splits only where the chunk's programs leave multiprocessors idle, never under SPLIT_MIN_TILES tiles."""
    from kda_sessions.kernels.mla.prefill import key_splits

    assert key_splits(T, H, block, sms) == want


@pytest.mark.parametrize("T,start,tile", [(37, 0, 4096), (37, 0, 8), (20, 45, 16), (5, 70, 32), (1, 9, 4), (30, 3, 8)],
                         ids=lambda x: str(x))
def test_cpu_flash_path_matches_dense(T, start, tile):
    from kda_sessions.kernels.mla.prefill_cpu import mla_prefill_cpu

    dn, dv = 12, 10
    q, kv, pages, w, scale = _case(T, start, H=3, dn=dn, dr=6, dv=dv, r=16, P=8, seed=3)
    ref = _dense(q, kv, pages, start, w, dn, dv, scale)
    out = mla_prefill_cpu(q, kv, pages, start, w, dv, scale, tile=tile)
    assert out.shape == (T, 3, dv) and rel_rms(out, ref) < TOL


def test_public_function_validates():
    q, kv, pages, w, scale = _case(8, 0, H=2, dn=8, dr=4, dv=8, r=16, P=4)
    with pytest.raises(ValueError, match="w_kv_b"):
        mla_prefill_paged(q, kv, pages, 0, w[:-1], 8, scale)
    with pytest.raises(ValueError, match="pages must cover"):
        mla_prefill_paged(q, kv, pages[:1], 0, w, 8, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("T,start", [(8192, 0), (2048, 20000), (300, 40000), (150, 70000)], ids=lambda x: str(x))
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_triton_bf16_kimi_shape(T, start, tma, monkeypatch):
    """Kimi-Linear's MLA shape (H 32, r 512, dn 128, dr 64, dv 128, P 64) in bf16, several blocks; key tiles by
    pointer loads and through TMA descriptors."""
    from kda_sessions.kernels.mla import prefill
    from kda_sessions.kernels.mla.prefill import mla_prefill_triton

    monkeypatch.setattr(prefill, "TMA", tma)

    dn, dv = 128, 128
    q, kv, pages, w, scale = _case(T, start, H=32, dn=dn, dr=64, dv=dv, r=512, P=64, device="cuda",
                                   dtype=torch.bfloat16)
    out = mla_prefill_triton(q, kv, pages, start, w, dv, scale, block_tokens=16384)
    ref = naive_mla_prefill_paged(q, kv, pages, start, w, dv, scale, tile=2048)
    assert rel_rms(out, ref) < 2e-2


def test_kernels_compile_once_per_shape():
    """Per-call lengths (the split's keys, the chunk, the block) are runtime arguments, not constexprs: a constexpr
    split length would compile a kernel for every length of a context's last block (~1.3 s a 256-token turn)."""
    import inspect

    from kda_sessions.kernels.mla import prefill

    def constexprs(kernel) -> set[str]:
        fn = getattr(kernel, "fn", kernel)
        return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}

    assert constexprs(prefill._prefill_kernel) == {"H", "DN", "DR", "DV", "R", "BM", "BN", "FIRST", "LAST", "SPLIT",
                                                   "TMA"}
    assert constexprs(prefill._merge_kernel) == {"DV", "BR", "FIRST", "LAST"}
