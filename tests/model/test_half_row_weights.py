"""``model/fused.row_mm``: a CPU decode step's one-row matmuls on FBGEMM's float16 pack of a float32 weight (the
activations, products and sums stay float32), where float16 holds the weight to within ``HALF_MAX_ERROR``."""

import pytest
import torch

import kda_sessions as ks
from kda_sessions.model import fused
from kda_sessions.model.fused import residual_matmul, row_mm

needs_fbgemm = pytest.mark.skipif(not fused._fbgemm_fp16(), reason="FBGEMM's float16 GEMM is x86 only")


def weight(i: int, o: int, seed: int = 0) -> torch.Tensor:
    """A float32 [i, o] weight of bfloat16 values, as the built-in tiny's (float16 holds them but for the tiniest)."""
    return (torch.randn(i, o, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16().float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@needs_fbgemm
def test_one_row_matmul_reads_the_float16_pack():
    w, x = weight(256, 1024), torch.randn(1, 256)
    got = row_mm(x, w)
    assert got.dtype == torch.float32 and got.shape == (1, 1024)
    assert 0 < rel(got, torch.mm(x, w)) < 1e-6  # float32 sums in another order, not the BLAS's bits
    assert fused._HALF[id(w)][2] is not None  # packed once, kept for the next step
    assert torch.equal(row_mm(x, w), got)


@needs_fbgemm
def test_the_residual_rides_in_the_bias_for_one_row_and_is_added_for_more():
    w = weight(1024, 256, seed=1)
    for rows in (1, 3):
        x, res = torch.randn(rows, 1024), torch.randn(rows, 256)
        assert rel(residual_matmul(res, x, w), res + torch.mm(x, w)) < 1e-6


def test_weights_float16_cannot_hold_prefill_rows_and_the_switch_take_the_blas(monkeypatch):
    x = torch.randn(1, 64)
    big = weight(64, 32, seed=2)
    big[3, 5] = 7e4  # beyond float16's range
    assert torch.equal(row_mm(x, big), torch.mm(x, big))
    rows = torch.randn(fused.HALF_MAX_ROWS + 1, 64)
    w = weight(64, 32, seed=3)
    assert torch.equal(row_mm(rows, w), torch.mm(rows, w))  # prefill's many rows
    monkeypatch.setattr(fused, "HALF_ROW_WEIGHTS", False)
    assert torch.equal(row_mm(x, w), torch.mm(x, w))
    res = torch.randn(1, 32)
    assert torch.equal(residual_matmul(res, x, w), torch.addmm(res, x, w))


@needs_fbgemm
def test_a_weight_changed_in_place_is_packed_again():
    w, x = weight(128, 256, seed=4), torch.randn(1, 128)
    before = row_mm(x, w)
    w.mul_(2)
    assert rel(row_mm(x, w), 2 * before) < 1e-6


def _live_packs() -> int:
    return sum(1 for ref, _, packed, _ in fused._HALF.values() if ref() is not None and packed is not None)


async def test_tiny_generates_the_same_tokens_with_and_without_the_float16_packs(monkeypatch):
    """Greedy decoding of the built-in model: the same 48 tokens either way (its logits move by float32 rounding);
    the engine option ``cpu_half_weights=False`` packs no weight (nor does the module switch off), the default does."""
    prompt = list(b"def main():\n    for i in range(10):\n        print(i)\n" * 8)
    tokens = {}
    for name, half, option in (("default", True, True), ("option off", True, False), ("switch off", False, True)):
        monkeypatch.setattr(fused, "HALF_ROW_WEIGHTS", half)
        fused._HALF.clear()
        async with await ks.Engine.open(model="tiny", store="memory:", cpu_decode_threads=1,
                                        cpu_half_weights=option) as eng:
            s = await eng.create_session()
            await s.append(prompt)
            tokens[name] = (await s.generate(max_tokens=48, ignore_eos=True)).token_ids
            packs = _live_packs()
        assert (packs > 0) == (half and option and fused._fbgemm_fp16()), (name, packs)
    assert len(tokens["default"]) == 48 and tokens["default"] == tokens["option off"] == tokens["switch off"]
