"""The decode feed's Triton program against its twin under TRITON_INTERPRET=1 (integers: equal), and its checks."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.kernels.feed import feed_decode_rows
from kda_sessions.kernels.feed.naive import naive_feed_decode_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted without one


def case(M: int, K: int, W: int, stops: list[int], seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 40, (K,), generator=g)
    tokens[: len(stops)] = torch.tensor(stops)  # some rows draw a stop token
    rows = torch.randperm(K, generator=g)[:M].to(torch.int32)
    can_stop = torch.randint(0, 2, (M,), generator=g, dtype=torch.int32)
    ids, slots, lens = (torch.randint(0, 99, (M,), generator=g, dtype=torch.int32) for _ in range(3))
    kv_rows = torch.randint(0, 9999, (M,), generator=g)
    table = torch.randint(0, 50, (M, W + 3), generator=g, dtype=torch.int32).to(DEV)[:, :W]  # rows strided
    return (*(t.to(DEV) for t in (tokens, rows, can_stop, torch.tensor(stops or [-1]), ids, slots, lens, kv_rows)),
            table)


@pytest.mark.parametrize("M,K,W,stops", [(1, 1, 1, [7]), (5, 9, 4, [3, 11]), (37, 40, 16, [0, 1, 2, 5]),
                                          (8, 8, 2, [])], ids=["1-row", "5-rows", "37-rows", "no-stops"])
def test_feed_matches_the_twin(M, K, W, stops):
    from kda_sessions.kernels.feed.triton_feed import feed_decode_rows_triton

    args = case(M, K, W, stops, seed=M)
    ref = [a.clone() for a in args]
    feed_decode_rows_triton(*args, 5, 6, 16)
    naive_feed_decode_rows(*ref, 5, 6, 16)
    for got, want in zip(args[4:], ref[4:]):
        assert torch.equal(got, want)
    stop = (ref[0][ref[1].long()][:, None] == ref[3][None, :]).any(1) & (ref[2] != 0)
    if stops:
        assert bool(stop.any())  # the case exercises both kinds of row
    assert torch.equal(ref[5][stop], torch.full_like(ref[5][stop], 5)) and torch.equal(ref[4], ref[0][ref[1].long()].int())


def test_a_row_without_a_draw_runs_as_a_dummy_on_both_paths():
    """A negative token (the sampler found no distribution in that row) feeds id 0 and makes the row a dummy,
    whether or not it could stop: its request fails, its state and cache must not move."""
    from kda_sessions.kernels.feed.triton_feed import feed_decode_rows_triton

    args = case(6, 8, 3, [4], seed=3)
    args[0][args[1][1:4].long()] = -1  # rows 1..3 drew nothing
    args[2][1] = 0  # one of them cannot stop
    ref = [a.clone() for a in args]
    feed_decode_rows_triton(*args, 5, 6, 16)
    naive_feed_decode_rows(*ref, 5, 6, 16)
    for got, want in zip(args[4:], ref[4:]):
        assert torch.equal(got, want)
    ids, slots, lens, kv_rows, table = ref[4:]
    assert ids[1:4].tolist() == [0, 0, 0] and slots[1:4].tolist() == [5, 5, 5] and lens[1:4].tolist() == [1, 1, 1]
    assert kv_rows[1:4].tolist() == [6 * 16] * 3 and table[1:4, 0].tolist() == [6, 6, 6]
    fed = args[0][args[1].long()]
    assert bool((fed[[0, 4, 5]] >= 0).all()) and bool((ids[[0, 4, 5]] == fed[[0, 4, 5]]).all())


def test_feed_names_a_bad_shape():
    args = list(case(4, 6, 3, [1], seed=1))
    args[5] = args[5][:3]
    with pytest.raises(ValueError, match="slots"):
        feed_decode_rows(*args, 5, 6, 16)
