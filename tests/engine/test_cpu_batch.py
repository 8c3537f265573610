"""``CpuDecodeBatches``: the reused decode batch holds what a fresh one for the same sequences would, step after step,
as batches grow, sequences gain pages and rows change hands."""

import pytest
import torch

from kda_sessions.engine.cpu_batch import CpuDecodeBatches
from kda_sessions.engine.sequence import Sequence
from kda_sessions.model import ForwardBatch

P = 2


def fresh(seqs: list[Sequence], ids: list[int]) -> ForwardBatch:
    width = max(len(s.pages) for s in seqs)
    start = [s.num_cached for s in seqs]
    return ForwardBatch(
        input_ids=torch.tensor(ids), num_new=[1] * len(seqs), start=start, slots=torch.tensor([s.slot for s in seqs]),
        page_table=torch.tensor([s.pages + [0] * (width - len(s.pages)) for s in seqs], dtype=torch.int32),
        kv_rows=torch.tensor(ForwardBatch.rows_for([s.pages for s in seqs], start, [1] * len(seqs), P)))


def same(a: ForwardBatch, b: ForwardBatch) -> None:
    assert a.start == b.start and a.num_new == b.num_new
    for name in ("input_ids", "slots", "page_table", "kv_rows", "cu_seqlens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.kv_rows is not None


def seq(i: int, pages: list[int], cached: int) -> Sequence:
    return Sequence(id=str(i), tokens=list(range(cached + 1)), num_cached=cached, slot=i, pages=pages)


@pytest.mark.parametrize("steps", [40], ids=["40-steps"])
def test_reused_batches_match_fresh_ones(steps):
    b = CpuDecodeBatches(P)
    seqs = [seq(0, [7], 0)]
    free = list(range(8, 200))
    for t in range(steps):
        if t == 10:
            seqs.append(seq(1, [3, 5], 5))  # a second row
        if t == 20:
            seqs = [seq(2, [1, 2], 6), *seqs]  # rows change hands: row 0 now holds another sequence
        if t == 30:
            seqs = seqs[1:]  # and the batch shrinks again
        for s in seqs:  # each row's new token needs a page for its position
            while s.num_cached // P >= len(s.pages):
                s.pages.append(free.pop(0))
        ids = [(t * 7 + i) % 250 for i in range(len(seqs))]
        same(b.batch(seqs, ids), fresh(seqs, ids))
        for s in seqs:
            s.num_cached += 1
    assert len(seqs[0].pages) > 16  # the page table outgrew its first buffer
