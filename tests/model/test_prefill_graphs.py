"""The padded short-prefill step that CUDA graphs capture (``PrefillGraphs``, ``HybridModel.prefill_padded``), run
eagerly on the CPU against ``HybridModel.step`` of the real tokens; opt-in on a GPU (``-m gpu``), graph replay
against the eager step.

The padded step is not the same arithmetic as ``step``: its chunks are padded (the KDA kernels see Tb tokens, the
padding's gate and beta zeroed), MLA attends absorbed at every context, and a matmul's rows are blocked differently.
So logits and states are compared within float32 tolerances and by argmax; the pools' rows no real token touches
must not move at all, and the padding must leave only the scratch slot and page changed.
"""

from __future__ import annotations

import os

import pytest
import torch

from kda_sessions.model import HybridModel, load_model
from kda_sessions.model.prefill_graphs import PrefillGraphs

from .test_cuda_graph_decode import Sessions, rel_err, twins

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return load_model("tiny-random")


def eager_chunks(sess: Sessions, seqs: list[int], chunks: list[list[int]]) -> torch.Tensor:
    """``HybridModel.step`` over the chunks (one batch), each sequence's last token's logits."""
    from kda_sessions.model import ForwardBatch

    dev = sess.model.device
    for s, c in zip(seqs, chunks):
        sess.grow(s, sess.lengths[s] + len(c))
    width = max(len(sess.pages[s]) for s in seqs)
    batch = ForwardBatch(
        input_ids=torch.tensor([t for c in chunks for t in c], device=dev), num_new=[len(c) for c in chunks],
        start=[sess.lengths[s] for s in seqs], slots=torch.tensor(seqs, device=dev),
        page_table=torch.tensor([sess.pages[s] + [0] * (width - len(sess.pages[s])) for s in seqs], dtype=torch.int32,
                                device=dev),
    )
    logits, _ = sess.model.step(batch, sess.pools)
    for s, c in zip(seqs, chunks):
        sess.lengths[s] += len(c)
    return logits


def padded_chunks(sess: Sessions, graphs: PrefillGraphs, seqs: list[int], chunks: list[list[int]]) -> torch.Tensor:
    for s, c in zip(seqs, chunks):
        sess.grow(s, sess.lengths[s] + len(c))
    logits = graphs.run([t for c in chunks for t in c], [len(c) for c in chunks], seqs,
                        [sess.lengths[s] for s in seqs], [sess.pages[s] for s in seqs])[0].clone()
    for s, c in zip(seqs, chunks):
        sess.lengths[s] += len(c)
    return logits


def assert_pools_close(a: Sessions, b: Sessions, seqs: list[int]) -> None:
    """The sequences' states, conv tails and cached rows within float tolerance; every other slot and page (but the
    scratch ones) the same bits."""
    pa, pb = a.pools, b.pools
    assert pa.scratch_slot is not None and pa.scratch_page is not None
    others = [s for s in range(pa.num_slots) if s not in seqs and s != pa.scratch_slot]
    for x, y in zip(pa.kda + pa.conv, pb.kda + pb.conv):
        assert rel_err(y[seqs], x[seqs]) < 1e-4
        assert torch.equal(x[others], y[others])
    for s in seqs:
        rows = torch.tensor(a.pages[s])
        for x, y in zip(pa.kv, pb.kv):
            # rows past the sequence's length are untouched (zeros) in both
            assert rel_err(y[rows].flatten(0, 1)[: a.lengths[s]], x[rows].flatten(0, 1)[: a.lengths[s]]) < 1e-4
            assert torch.equal(x[rows].flatten(0, 1)[a.lengths[s] :], y[rows].flatten(0, 1)[a.lengths[s] :])
    owned = {p for s in range(len(a.pages)) for p in a.pages[s]}
    free = [p for p in range(pa.num_pages) if p not in owned and p != pa.scratch_page]
    for x, y in zip(pa.kv, pb.kv):
        assert torch.equal(x[free], y[free])


@pytest.mark.parametrize("contexts,seqs,lengths", [
    ([20], [0], [5]),  # one sequence, a chunk padded from 5 to 16
    ([20], [0], [16]),  # a full bucket
    ([33, 9, 47], [2, 0], [19, 3]),  # two of three sequences, chunk bucket 32, crossing pages
    ([1, 30, 17], [0, 1, 2], [64, 2, 40]),  # three (bucket 4: one dummy), bucket 64, after a single cached token
], ids=["1x5", "1x16", "2of3", "3x64"])
def test_padded_step_matches_step(model, contexts, seqs, lengths):
    eager, padded = twins(model, contexts, seed=sum(contexts))
    graphs = PrefillGraphs(model, padded.pools, enabled=False)
    g = torch.Generator().manual_seed(len(seqs))
    for _ in range(2):  # twice: the second chunk reads the first one's states, tails and rows
        chunks = [torch.randint(0, 272, (t,), generator=g).tolist() for t in lengths]
        a = eager_chunks(eager, seqs, chunks)
        b = padded_chunks(padded, graphs, seqs, chunks)
        assert rel_err(b, a) < 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert_pools_close(eager, padded, seqs)
    assert graphs.eager_runs == 2 and graphs.replays == 0
    # a decode step after it reads the same states
    ids = [1] * len(seqs)
    a = eager_chunks(eager, seqs, [[i] for i in ids])
    b = eager_chunks(padded, seqs, [[i] for i in ids])
    assert rel_err(b, a) < 1e-4


def test_padded_step_returns_the_states_at_checkpoints(model):
    """``checkpoint_at``: the states after p tokens of each chunk (inside one, at the end of the other) as ``step``'s
    kernels give them at the same checkpoint positions (1e-4), beside the same logits and final states."""
    from kda_sessions.model import ForwardBatch

    eager, padded = twins(model, [33, 9, 47], seed=4)
    graphs = PrefillGraphs(model, padded.pools, enabled=False)
    seqs, chunks, at = [2, 0], [list(range(3, 22)), [5, 6, 7]], [7, 3]
    for s, c in zip(seqs, chunks):
        eager.grow(s, eager.lengths[s] + len(c))
        padded.grow(s, padded.lengths[s] + len(c))
    width = max(len(eager.pages[s]) for s in seqs)
    batch = ForwardBatch(
        input_ids=torch.tensor([t for c in chunks for t in c]), num_new=[len(c) for c in chunks],
        start=[eager.lengths[s] for s in seqs], slots=torch.tensor(seqs),
        page_table=torch.tensor([eager.pages[s] + [0] * (width - len(eager.pages[s])) for s in seqs], dtype=torch.int32),
        checkpoint_positions=[[p] for p in at],
    )
    a, want = model.step(batch, eager.pools)
    b, got = graphs.run([t for c in chunks for t in c], [len(c) for c in chunks], seqs,
                        [padded.lengths[s] for s in seqs], [padded.pages[s] for s in seqs], checkpoint_at=at)
    assert want is not None and got is not None
    assert got.kda.shape == want.kda.shape and got.conv.shape == want.conv.shape
    assert rel_err(got.kda, want.kda) < 1e-4 and rel_err(got.conv, want.conv) < 1e-4
    assert rel_err(b, a) < 1e-4
    for x, y in zip(eager.pools.kda, padded.pools.kda):
        assert rel_err(y[seqs], x[seqs]) < 1e-4
    # a step of another key writes the same outputs (a graph's own would stay allocated per key)
    padded.grow(1, padded.lengths[1] + 2)
    c, again = graphs.run([1, 2], [2], [1], [padded.lengths[1]], [padded.pages[1]], checkpoint_at=[1])
    assert again is not None and graphs.key([2], len(padded.pages[1]), True) != graphs.key([19, 3], width, True)
    assert again.kda.data_ptr() == got.kda.data_ptr() and c.data_ptr() == b.data_ptr()
    with pytest.raises(ValueError, match="checkpoint_at"):
        graphs.run([1] * 4, [4], [1], [9], [padded.pages[1]], checkpoint_at=[5])


def test_buckets_and_limits(model):
    s = Sessions(model, 2, 64)
    graphs = PrefillGraphs(model, s.pools, enabled=False, max_batch=8, max_tokens=64)
    assert graphs.chunk_buckets == [16, 32, 64]
    assert graphs.key([5], 3) == (1, 16, 16, False)
    assert graphs.key([17, 1, 1], 20, True) == (4, 32, 32, True)
    assert graphs.accepts([64] * 8, [1] * 8)
    assert not graphs.accepts([65], [10])  # too long
    assert not graphs.accepts([4], [0])  # nothing cached: the eager step
    assert not graphs.accepts([1] * 9, [5] * 9)  # too many
    assert not graphs.accepts([], [])


def test_bad_input_is_a_typed_error(model):
    s = Sessions(model, 2, 64)
    s.prefill(0, [1, 2, 3])
    graphs = PrefillGraphs(model, s.pools, enabled=False)
    with pytest.raises(ValueError, match="pages"):
        graphs.run([1] * 20, [20], [0], [3], [s.pages[0]])  # 23 tokens need 2 pages of 16
    with pytest.raises(ValueError, match="input_ids"):
        graphs.run([1, 2], [3], [0], [3], [s.pages[0]])
    with pytest.raises(ValueError, match="cached"):
        graphs.run([1, 2], [2], [0], [0], [s.pages[0]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replay_matches_eager_on_cuda(dtype: torch.dtype):
    """On a GPU: replays of captured padded prefills against the same padded step run eagerly (the same kernels:
    logits and states within 1e-3), and against ``step`` of the same chunks (other arithmetic: MLA decompressed
    there, absorbed here; other tiles): in float32 within 1e-2 (the KDA kernels' tf32 dots), with the same argmax; in
    bf16 (where tiny-random's eight layers amplify rounding differences) the logits within 5e-2."""
    torch.manual_seed(0)
    m = load_model("tiny-random").to("cuda", dtype)
    eager, graphed = twins(m, [40, 130, 7], seed=3)
    padded = graphed.clone()
    graphs = PrefillGraphs(m, graphed.pools)
    no_graphs = PrefillGraphs(m, padded.pools, enabled=False)
    g = torch.Generator().manual_seed(5)
    seqs = [0, 1, 2]
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    for lengths in ([5, 17, 1], [64, 2, 30], [3, 3, 3]):
        chunks = [torch.randint(0, 272, (t,), generator=g).tolist() for t in lengths]
        a = eager_chunks(eager, seqs, chunks)
        b = padded_chunks(graphed, graphs, seqs, chunks)
        c = padded_chunks(padded, no_graphs, seqs, chunks)
        assert rel_err(b, c) < 1e-3
        assert rel_err(b, a) < tol
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for x, y, z in zip(eager.pools.kda, graphed.pools.kda, padded.pools.kda):
            assert rel_err(y[seqs], z[seqs]) < 1e-3
            if dtype == torch.float32:
                assert rel_err(y[seqs], x[seqs]) < tol
    assert graphs.replays == 3 and graphs.captures == 3, graphs.capture_error  # chunk buckets 32, 64, 16
    # with states inside the chunks: a graph of its own, its static outputs against the eager padded step's
    chunks = [torch.randint(0, 272, (t,), generator=g).tolist() for t in (4, 9, 2)]
    outs = []
    for sess, pg in ((graphed, graphs), (padded, no_graphs)):
        for s, c in zip(seqs, chunks):
            sess.grow(s, sess.lengths[s] + len(c))
        outs.append(pg.run([t for c in chunks for t in c], [len(c) for c in chunks], seqs,
                           [sess.lengths[s] for s in seqs], [sess.pages[s] for s in seqs], checkpoint_at=[2, 9, 1]))
    (lb, sb), (lc, sc) = outs
    assert sb is not None and sc is not None and rel_err(lb, lc) < 1e-3
    assert rel_err(sb.kda, sc.kda) < 1e-3 and rel_err(sb.conv.float(), sc.conv.float()) < 1e-3
    assert graphs.captures == 4, graphs.capture_error
