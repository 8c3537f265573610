"""``model/fused.pack``: derived CPU weights copied into one huge-page buffer keep their values and layouts."""

import sys

import pytest
import torch

from kda_sessions.model.fused import PACK_MIN_BYTES, pack, row_matmul_weight


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_pack_keeps_values_and_layouts():
    g = torch.Generator().manual_seed(0)
    w_in = row_matmul_weight(torch.randn(900, 256, generator=g))  # in < out: a contiguous [in, out] copy
    w_out = row_matmul_weight(torch.randn(256, 1024, generator=g))  # in > out: the transposed view
    vec = torch.randn(7, generator=g)
    other = torch.randn(5, dtype=torch.float64, generator=g)  # another dtype: passed through
    got = pack([w_in, w_out, vec, other])
    for a, b in zip(got, [w_in, w_out, vec, other]):
        assert torch.equal(a, b) and a.stride() == b.stride()
    assert got[3] is other
    base = got[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in got[:3])  # one buffer
    assert base != w_in.untyped_storage().data_ptr()
    assert got[0].data_ptr() % (2 << 20) == 0  # it starts on a huge-page boundary


def test_small_tensors_pass_through():
    small = [torch.ones(PACK_MIN_BYTES // 8)]
    assert pack(small)[0] is small[0]
