"""MLA prefill of a short chunk with kv_b_proj absorbed (``mla_prefill_absorbed``: the cached rows through the paged
decode kernel, the T queries as T x H heads of one sequence, the new rows causal in torch, merged by log-sum-exps)
against the dense twin ``naive_mla_prefill`` over a shuffled page table, under TRITON_INTERPRET=1 on a CPU;
relative RMS error 1e-5 in float32. On a GPU (gpu-marked) at Kimi-Linear's shape in bf16 against the decompressed
flash kernel's twin, 2e-2."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels import mla
from kda_sessions.kernels.mla.absorbed import (
    absorbed_splits,
    mla_prefill_absorbed,
    mla_prefill_absorbed_padded,
    served_head_block,
)
from kda_sessions.kernels.mla.naive import naive_mla_prefill_paged

from .kernel_helpers import rel_rms
from .test_mla_prefill import _case, _dense


@pytest.mark.parametrize("T,start", [(1, 9), (5, 70), (12, 0), (7, 130), (3, 1)], ids=lambda x: str(x))
def test_absorbed_matches_dense(T: int, start: int):
    dn, dv = 16, 16
    q, kv, pages, w, scale = _case(T, start, H=2, dn=dn, dr=16, dv=dv, r=32, P=8, seed=T + start)
    ref = _dense(q, kv, pages, start, w, dn, dv, scale)
    out = mla_prefill_absorbed(q, kv, pages, start, w, dv, scale)
    assert out.shape == (T, 2, dv) and out.dtype == q.dtype
    assert rel_rms(out, ref) < 1e-5


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_padded_chunks_match_each_sequence_alone(kernel: bool):
    """``mla_prefill_absorbed_padded``: three sequences' chunks (5, 2 and 8 tokens after 9, 1 and 20 cached) padded to
    8 tokens each, the page table wider than any needs; each real query's output as ``mla_prefill_absorbed`` of its
    sequence alone gives it (1e-5); through the paged decode kernel (interpreter) or its torch twin."""
    H, dn, dr, dv, r, P = 2, 16, 16, 16, 32, 8
    gen = torch.Generator().manual_seed(11)
    starts, lens, Tb, width = [9, 1, 20], [5, 2, 8], 8, 5
    kv = torch.randn(16, P, r + dr, generator=gen)
    tables = torch.randperm(15, generator=gen)[: 3 * width].view(3, width).int()
    w = torch.randn(H * (dn + dv), r, generator=gen) / r**0.5
    q = torch.randn(3, Tb, H, dn + dr, generator=gen)
    new = torch.randn(3, Tb, r + dr, generator=gen)
    for n in range(3):  # the real rows in the pages too, as the model writes them before attending
        for j in range(lens[n]):
            pos = starts[n] + j
            kv[tables[n, pos // P].long(), pos % P] = new[n, j]
    out = mla_prefill_absorbed_padded(q, new, kv, tables, torch.tensor(starts, dtype=torch.int32), w, dv, 0.2,
                                      absorbed_splits(Tb, H, width * P, 4), kernel=kernel)
    assert out.shape == (3, Tb, H, dv)
    for n in range(3):
        ref = mla_prefill_absorbed(q[n, : lens[n]].contiguous(), kv, tables[n], starts[n], w, dv, 0.2)
        assert rel_rms(out[n, : lens[n]], ref) < 1e-5
    with pytest.raises(ValueError, match="new must be"):
        mla_prefill_absorbed_padded(q, new[:2], kv, tables, torch.tensor(starts, dtype=torch.int32), w, dv, 0.2, 1)


def test_splits_are_sized_for_the_head_block_that_runs(monkeypatch: pytest.MonkeyPatch):
    """Where the Gluon kernel does not serve (here: a CPU cache; on a GPU: not sm_90, not bf16, not r 512) the
    Triton kernel takes at most ``TRITON_HEAD_BLOCK`` query rows a program, and the splits are sized for that many
    blocks, not for ``HEAD_BLOCK``'s."""
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert mla.HEAD_BLOCK > mla.TRITON_HEAD_BLOCK
    assert served_head_block(kv, 512) == mla.TRITON_HEAD_BLOCK
    assert served_head_block(kv, 512, 16) == 16
    monkeypatch.setattr(mla, "HEAD_BLOCK", 16)  # read at the call
    assert served_head_block(kv, 512) == 16
    # 64 tokens of 32 heads: 64 blocks of 32 rows or 32 of 64; two waves of 132 multiprocessors
    assert absorbed_splits(64, 32, 1 << 20, 132, served_head_block(kv, 512, 64)) == 4
    assert absorbed_splits(64, 32, 1 << 20, 132, 64) == 8


def test_the_decode_kernel_gives_each_heads_log_sum_exp():
    """``_launch``'s ``lse_out``: the base-2 log-sum-exp of each head's scaled scores over its sequence's rows."""
    from kda_sessions.kernels.mla.paged_decode import _LOG2E, _launch

    gen = torch.Generator().manual_seed(4)
    N, H, r, dr, P = 2, 3, 32, 16, 8
    kv = torch.randn(9, P, r + dr, generator=gen)
    table = torch.randperm(9, generator=gen)[:8].view(2, 4).int()
    lens = torch.tensor([13, 30], dtype=torch.int32)
    q_lat, q_pe = torch.randn(N, H, r, generator=gen), torch.randn(N, H, dr, generator=gen)
    lse = torch.empty(N, H)
    _launch(q_lat, q_pe, kv, table, lens, 0.3, num_splits=3, form="tokens", lse_out=lse)
    for n in range(N):
        rows = kv[table[n].long()].reshape(-1, r + dr)[: int(lens[n])]
        s = (q_lat[n] @ rows[:, :r].T + q_pe[n] @ rows[:, r:].T) * 0.3
        torch.testing.assert_close(lse[n], torch.logsumexp(s, -1) * _LOG2E, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="lse_out"):
        _launch(q_lat, q_pe, kv, table, lens, 0.3, form="heads", lse_out=lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("T,start", [(1, 5000), (16, 131072 - 16), (64, 40000), (128, 3000), (16, 0)],
                         ids=lambda x: str(x))
def test_absorbed_bf16_kimi_shape(T: int, start: int):
    """Kimi-Linear's MLA shape (H 32, r 512, dn 128, dr 64, dv 128, P 64) in bf16: the Gluon split kernel on sm_90."""
    dn, dv = 128, 128
    q, kv, pages, w, scale = _case(T, start, H=32, dn=dn, dr=64, dv=dv, r=512, P=64, device="cuda",
                                   dtype=torch.bfloat16)
    out = mla_prefill_absorbed(q, kv, pages, start, w, dv, scale)
    ref = naive_mla_prefill_paged(q, kv, pages, start, w, dv, scale, tile=4096)
    assert rel_rms(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_models_short_chunk_gives_the_same_logits_absorbed(monkeypatch: pytest.MonkeyPatch):
    """``MLAttention`` on ``tiny-random``: a 9-token chunk after 300 cached tokens, absorbed and decompressed."""
    from kda_sessions.model import ForwardBatch, load_model
    from kda_sessions.model import mla as mla_module

    model = load_model("tiny-random", device="cuda", dtype=torch.bfloat16)
    P = 16
    pages = list(range(24))
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(0, 272, (300,), generator=gen)
    tail = torch.randint(0, 272, (9,), generator=gen)

    def run(min_context: int) -> torch.Tensor:
        monkeypatch.setattr(mla_module, "ABSORBED_MIN_CONTEXT", min_context)
        pools = model.allocate_pools(2, 32, P)
        logits = None
        for start, ids in ((0, head), (300, tail)):
            rows = ForwardBatch.rows_for([pages], [start], [len(ids)], P)
            batch = ForwardBatch(input_ids=ids.cuda(), num_new=[len(ids)], start=[start],
                                 slots=torch.zeros(1, dtype=torch.long, device="cuda"),
                                 page_table=torch.tensor([pages], dtype=torch.int32, device="cuda"),
                                 kv_rows=torch.tensor(rows, device="cuda"), all_logits=True)
            logits, _ = model.step(batch, pools)
        assert logits is not None
        return logits.float()

    absorbed, decompressed = run(0), run(1 << 30)
    assert rel_rms(absorbed, decompressed) < 2e-2
    assert (absorbed.argmax(-1) == decompressed.argmax(-1)).float().mean() > 0.8
