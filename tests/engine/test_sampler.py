"""The batched sampler (``engine.sampler.draw_rows``): every row's setting at once, the same tokens as each row
alone and, for a seeded row, as ``torch.multinomial`` with its generator; top-k and top-p keep what they promise,
ties at their edge whole; a row without a distribution fails alone; and on a GPU nothing in a draw waits for the
device."""

from __future__ import annotations

import pytest
import torch

from kda_sessions.engine.sampler import (
    NoDistribution,
    draw_rows,
    sample,
    sample_batch,
    sample_batch_async,
    token_logprobs,
    top_logprobs,
)
from kda_sessions.types import SamplingParams

V = 300
SETTINGS = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(), SamplingParams(temperature=1.3, top_k=7),
            SamplingParams(temperature=0.5, top_k=40, top_p=0.5), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.9, top_k=V + 5), SamplingParams(temperature=2.0, top_p=1e-9)]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(n: int, base: int = 10) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


def reference_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """A row's distribution written out the plain way (sorted top-p set by boolean indexing)."""
    scaled = (x.float() - x.max()) / p.temperature
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, V)).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if p.top_p < 1:
        sp, order = torch.sort(probs, descending=True)
        keep = sp.cumsum(-1) - sp < p.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sp[keep])
    return probs


def test_a_batch_draws_each_row_as_alone_and_a_seeded_row_as_multinomial_does():
    x = logits_for(len(SETTINGS))
    for step in range(5):  # the generators move on: five draws each
        together = draw_rows(x, SETTINGS, seeded(len(SETTINGS), 10 + step))
        alone = [int(draw_rows(x[i : i + 1], [p], [g])[0])
                 for i, (p, g) in enumerate(zip(SETTINGS, seeded(len(SETTINGS), 10 + step)))]
        assert together.tolist() == alone
        want = [int(torch.argmax(x[i])) if p.greedy else
                int(torch.multinomial(reference_probs(x[i], p), 1, generator=g)[0])
                for i, (p, g) in enumerate(zip(SETTINGS, seeded(len(SETTINGS), 10 + step)))]
        assert together.tolist() == want


def test_top_k_and_top_p_keep_only_their_tokens_and_draw_in_proportion():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None].repeat(4000, 1)
    V4 = x.shape[1]
    for p, allowed, share in [(SamplingParams(temperature=1.0, top_p=0.79), {0, 1}, 0.5 / 0.8),
                              (SamplingParams(temperature=1.0, top_p=0.81), {0, 1, 2}, 0.5 / 0.95),
                              (SamplingParams(temperature=1.0, top_k=2), {0, 1}, 0.5 / 0.8),
                              (SamplingParams(temperature=1.0, top_k=V4, top_p=1.0), {0, 1, 2, 3}, 0.5)]:
        got = draw_rows(x, [p] * len(x), [None] * len(x))
        assert set(got.tolist()) == allowed, p
        assert abs(float((got == 0).float().mean()) - share) < 0.04, p  # ~5 standard errors


def test_token_logprobs_are_log_softmax_read_at_the_token():
    x = logits_for(4, seed=6) * 5
    x[2, :200] = float("-inf")
    toks = torch.tensor([3, 299, 250, -1])
    want = torch.log_softmax(x, -1).gather(1, toks.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(token_logprobs(x, toks), want, rtol=0, atol=2e-6)
    assert token_logprobs(x.bfloat16(), toks).dtype == torch.float32


def test_top_logprobs_are_log_softmax_s_largest_and_come_with_each_row_s_draw():
    x = logits_for(4, seed=7) * 5
    x[1, :250] = float("-inf")
    ids, lps = top_logprobs(x, 6)
    want = torch.topk(torch.log_softmax(x, -1), 6)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(lps, want.values, rtol=0, atol=2e-6)
    params = [SamplingParams(logprobs=True, top_logprobs=k) for k in (2, 0, 6, 1)]
    got = sample_batch_async(x, params, [None] * 4).result_with_top()
    for i, (res, k) in enumerate(zip(got, (2, 0, 6, 1))):
        assert not isinstance(res, Exception)
        tok, lp, top = res
        assert lp == pytest.approx(float(want.values[i, 0]), abs=2e-6)  # the greedy token: the most likely
        assert tok == int(x[i].argmax()) and [t for t, _ in top] == want.indices[i, :k].tolist()
        assert [p for _, p in top] == pytest.approx(want.values[i, :k].tolist(), abs=2e-6)
    assert sample_batch(x, params, [None] * 4) == [r[:2] for r in got]  # type: ignore[index]


def test_a_tie_at_the_edge_of_the_nucleus_or_the_top_k_is_kept_whole():
    """bf16 logits tie often: the tokens as likely as the least likely kept one are all kept, whatever order the sort
    left them in (top-p 0.5 over 0.4, 0.2, 0.2, 0.2 needs one 0.2; top-k 2 reaches the first 0.2)."""
    x = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))[None].repeat(3000, 1)
    for p in (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=2)):
        got = draw_rows(x, [p] * len(x), [None] * len(x))
        assert set(got.tolist()) == {0, 1, 2, 3}, p
        assert abs(float((got == 0).float().mean()) - 0.4) < 0.05, p


def test_a_row_without_a_distribution_fails_alone_and_a_greedy_one_still_argmaxes():
    x = logits_for(5, seed=2)
    x[1] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0,
              top_p=0.9, logprobs=True), SamplingParams(), SamplingParams(top_k=3, temperature=0.6)]
    got = sample_batch(x, params, [torch.Generator().manual_seed(1), None, None, None, None])
    assert isinstance(got[1], NoDistribution) and isinstance(got[2], NoDistribution)
    assert got[3][0] == int(torch.argmax(x[3]))  # type: ignore[index]  # greedy: as an all-greedy batch takes it
    assert got[0] == sample(x[0], params[0], torch.Generator().manual_seed(1))
    tok, lp = got[4]  # type: ignore[misc]
    assert tok in torch.topk(x[4], 3).indices.tolist()
    assert lp == pytest.approx(float(torch.log_softmax(x[4], -1)[tok]))  # a row asked: every row has one
    with pytest.raises(NoDistribution, match="no distribution"):
        sample(x[1], params[1], None)


def test_a_row_without_a_distribution_leaves_the_nucleus_of_the_rows_after_it_alone():
    """The top-p scan runs over the whole batch at once: a nan row ahead of a nucleus row must not reach it."""
    x = logits_for(3, seed=8)
    x[0] = float("nan")
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 3
    for seed in range(20):
        got = draw_rows(x, params, [None, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)])
        assert int(got[0]) == -1
        for i in (1, 2):
            alone = draw_rows(x[i : i + 1], params[:1], [torch.Generator().manual_seed(seed + i - 1)])
            assert int(got[i]) == int(alone[0]), (seed, i)


def test_a_row_the_batch_cannot_draw_fails_alone():
    x = logits_for(3, seed=4)
    params = [SamplingParams(temperature=0.8)] * 3
    bad = object()  # not a generator: the batched draw raises, then each row is drawn alone, the generators
    # as they were before the batch (the first row's had drawn there)
    got = sample_batch(x, params, [torch.Generator().manual_seed(5), bad, None])  # type: ignore[list-item]
    assert isinstance(got[1], Exception) and not isinstance(got[1], NoDistribution)
    assert got[0][0] == sample(x[0], params[0], torch.Generator().manual_seed(5))[0]  # type: ignore[index]
    assert isinstance(got[2], tuple) and 0 <= got[2][0] < V


@pytest.mark.gpu
def test_a_sampled_batch_on_cuda_never_waits_for_the_device():
    """Queued behind a long matmul: nucleus, top-k, seeded and greedy rows, with logprobs, make no synchronizing
    call (``torch.cuda.set_sync_debug_mode("error")``) and draw what the CPU draws from the same noise."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = logits_for(len(SETTINGS)).cuda()
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, logprobs=True)
              for p in SETTINGS]
    gens = [torch.Generator(device="cuda").manual_seed(i) if i % 2 else None for i in range(len(SETTINGS))]
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            a = a @ a / 64  # the device is busy while the draw is queued
        pending = sample_batch_async(x, params, gens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = pending.result()
    for i, (p, r) in enumerate(zip(params, got)):
        assert isinstance(r, tuple), (i, r)
        assert r[1] == pytest.approx(float(torch.log_softmax(x[i].float(), -1)[r[0]]), abs=1e-5)
        if p.greedy:
            assert r[0] == int(torch.argmax(x[i])), (i, p)
        else:
            assert float(reference_probs(x[i].cpu(), p)[r[0]]) > 0, (i, p)


@pytest.mark.parametrize("trials", [pytest.param(150, id="short"), pytest.param(5000, id="long", marks=pytest.mark.slow)])
def test_random_batches_draw_each_row_within_its_setting_and_as_alone(trials):
    """Random batches: vocabularies, scales, ties, -inf, nan and inf rows, extreme temperatures, top-p and top-k
    (past the vocabulary too), seeded and unseeded rows. Greedy rows take the argmax, a row without a distribution
    -1, any other a token inside its top-k, and a seeded row the token it draws alone."""
    import random

    rng = random.Random(0)
    for trial in range(trials):
        v, n = rng.choice([7, 97, 300]), rng.randint(1, 6)
        x = torch.randn(n, v, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.01, 1, 10, 1e4])
        if rng.random() < 0.2:
            x[:, rng.randrange(v)] = float("-inf")
        if rng.random() < 0.15:
            x[rng.randrange(n)] = float("nan")
        if rng.random() < 0.1:
            x[rng.randrange(n), rng.randrange(v)] = float("inf")
        if rng.random() < 0.2:
            x = x.round()  # ties
        params = [SamplingParams(temperature=rng.choice([0.0, 1e-5, 0.3, 1.0, 5.0, 1e6]),
                                 top_p=rng.choice([1.0, 0.9, 1e-30, 0.5]), top_k=rng.choice([0, 1, 5, v, v + 10]))
                  for _ in range(n)]
        seeds = [rng.randrange(100) if rng.random() < 0.6 else None for _ in range(n)]
        got = draw_rows(x, params, [None if s is None else torch.Generator().manual_seed(s) for s in seeds])
        for i, (p, s) in enumerate(zip(params, seeds)):
            t = int(got[i])
            if p.greedy:
                assert t == int(torch.argmax(x[i])), (trial, i)
            elif not torch.isfinite(x[i].max()):
                assert t == -1, (trial, i, t)
            else:
                assert 0 <= t < v and x[i, t] > float("-inf"), (trial, i, t)
                if p.top_k:
                    assert x[i, t] >= torch.topk(x[i], min(p.top_k, v)).values[-1], (trial, i, t)
                if s is not None:
                    alone = draw_rows(x[i : i + 1], [p], [torch.Generator().manual_seed(s)])
                    assert int(alone[0]) == t, (trial, i, p)
