"""The Triton matvec (``kernels.linear``) against its twin, a float32 matmul rounded once: under TRITON_INTERPRET=1
at small shapes on a CPU, at the 48B model's decode shapes with ``-m gpu``.

Tolerance: relative RMS 1e-6 for float32 (sums in another order); 8e-3 for bfloat16, where both round the same
float32 sum and only outputs within a sum-order error of a rounding boundary differ, by one ulp (2^-8)."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.linear import head_linear, linear, naive_head_linear, naive_linear

from .kernel_helpers import rel_rms


def _check(N: int, O: int, I: int, dtype: torch.dtype, device: str, config=None) -> None:
    from kda_sessions.kernels.linear.matvec_triton import matvec_triton

    gen = torch.Generator().manual_seed(N * 7 + O)
    y = torch.randn(N, I + 5, generator=gen).to(device, dtype)
    x = y[:, 5:]  # a column slice of a larger output, as the layers hand over their rows
    w = (torch.randn(O, I, generator=gen) * I**-0.5).to(device, dtype)
    out = matvec_triton(x, w, config)
    ref = naive_linear(x.cpu(), w.cpu())
    assert out.shape == (N, O) and out.dtype == dtype
    assert rel_rms(out.cpu(), ref) < (1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matvec_matches_the_twin(N, dtype):
    _check(N, 37, 300, dtype, "cpu")  # O not a multiple of the row block, I not of the column tile


def test_linear_checks_shapes_and_falls_back_on_a_cpu():
    x, w = torch.randn(2, 16), torch.randn(5, 16)
    assert torch.allclose(linear(x, w), naive_linear(x, w), atol=1e-6)
    with pytest.raises(ValueError, match="same I"):
        linear(x, w[:, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(2304, 4096), (12576, 2304), (6720, 2304), (100, 70)],
                         ids=["o_proj", "kda_in", "mla_in", "odd"])
def test_matvec_matches_the_twin_on_cuda(N, shape):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check(N, *shape, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_stamped_matvec_gives_the_same_bits_and_ordered_clocks(monkeypatch):
    """``kernels.stamps.ROWS`` (bench/decode_48b.py --stamps): the matvec built with clock stamps gives the shipped
    launch's bits, and every program's row is filled in order; the launch is in ``stamps.LAUNCHES``."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels import stamps
    from kda_sessions.kernels.linear.matvec_triton import matvec_triton

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 2304, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(12576, 2304, device="cuda", generator=gen) * 0.02).bfloat16()
    plain = matvec_triton(x, w)
    monkeypatch.setattr(stamps, "ROWS", {})
    monkeypatch.setattr(stamps, "LAUNCHES", [])
    stamped = matvec_triton(x, w)
    assert torch.equal(plain, stamped)
    (r,) = stamps.ROWS["matvec"]
    assert [n for n, _ in stamps.LAUNCHES] == ["matvec"] and r.shape[0] == 12576
    r = r.cpu()
    assert (r[:, 1] > r[:, 0]).all()
    c = r[:, 2:5]
    assert (c[:, 1:] >= c[:, :-1]).all() and (c[:, -1] > c[:, 0]).all()


@pytest.mark.gpu
def test_matvec_chain_with_pdl_waits_for_the_launch_before():
    """A chain of matvecs, each reading the one before's output (on Hopper PDL launches that load their weight
    before they wait), eagerly and as CUDA-graph replays, against the chain with PDL off: the same values (a
    matvec reading x before the launch before wrote it would not)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels.moe import pdl

    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [(torch.randn(n, m, device="cuda", generator=gen) * m**-0.5).bfloat16()
          for n, m in [(4096, 2304), (2304, 4096)] * 6]
    x0 = torch.randn(1, 2304, device="cuda", generator=gen).bfloat16()

    def chain(x):
        for w in ws:
            x = linear(x, w)
        return x

    pdl.ENABLED = False
    try:
        ref = chain(x0)
    finally:
        pdl.ENABLED = True
    eager = chain(x0)
    inp = x0.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(inp)
    g.replay()
    torch.cuda.synchronize()
    assert rel_rms(eager.float(), ref.float()) < 1e-3
    assert rel_rms(out.float(), ref.float()) < 1e-3
    inp.copy_(torch.randn(1, 2304, device="cuda", generator=gen).bfloat16())
    g.replay()
    torch.cuda.synchronize()
    assert rel_rms(out.float(), ref.float()) > 0.1  # a new input, a new output


def _check_heads(N: int, H: int, O: int, I: int, dtype: torch.dtype, device: str) -> None:
    """``head_matvec_triton`` on W_uv as the MLA layer hands it over: each head's last O rows of a [H, dn + O, I]
    weight (head stride != O * row stride), x a strided [N, H, I] view."""
    from kda_sessions.kernels.linear.matvec_triton import head_matvec_triton

    gen = torch.Generator().manual_seed(N * 11 + H)
    dn = 5
    w = (torch.randn(H, dn + O, I, generator=gen) * I**-0.5).to(device, dtype)[:, dn:]
    x = torch.randn(N, H, I + 3, generator=gen).to(device, dtype)[:, :, 3:]
    out = head_matvec_triton(x, w)
    ref = naive_head_linear(x.cpu(), w.cpu())
    assert out.shape == (N, H, O) and out.dtype == dtype
    assert rel_rms(out.cpu(), ref) < (1e-6 if dtype == torch.float32 else 8e-3)
    # each head its own weight: the same x rows against another head's weight give other values
    assert rel_rms(out.cpu()[:, 1:], ref[:, :-1]) > 0.1


@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 4], ids=["row", "4rows"])
def test_head_matvec_matches_the_twin(N, dtype, rows, monkeypatch):
    """``rows``: the rows a program (``matvec_triton.HEAD_ROWS``); 4 divides the 12 rows of a head."""
    from kda_sessions.kernels.linear import matvec_triton

    monkeypatch.setattr(matvec_triton, "HEAD_ROWS", rows)
    _check_heads(N, 3, 12, 40, dtype, "cpu")


def test_head_linear_checks_shapes_and_falls_back_on_a_cpu():
    x, w = torch.randn(2, 3, 16), torch.randn(3, 5, 16)
    assert torch.allclose(head_linear(x, w), naive_head_linear(x, w), atol=1e-6)
    with pytest.raises(ValueError, match="same H and I"):
        head_linear(x, w[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("rows", [1, 4], ids=["row", "4rows"])
def test_head_matvec_matches_the_twin_on_cuda(N, rows, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels.linear import matvec_triton

    monkeypatch.setattr(matvec_triton, "HEAD_ROWS", rows)
    _check_heads(N, 32, 128, 512, torch.bfloat16, "cuda")  # MLA's W_uv at the 48B shape
