"""The static-buffer decode step that CUDA graphs capture (``DecodeGraphs``), run eagerly on the CPU, against
``HybridModel.step``; and, opt-in on a GPU (``-m gpu``), graph replay against eager.

On a CPU a matmul's result for one row depends on how many rows it is given (BLAS blocking), so padding a batch
from 3 to 4 rows changes the last bits of every row, as any change of batch composition does in the eager step.
Bit identity is therefore checked where the rows are the same: batches that fill their bucket, and padded
batches against the eager step over the same padded rows (the dummies spelled out as sequences on the scratch
slot and page); the padded and unpadded steps are compared with a tolerance and by argmax.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kda_sessions.model import ForwardBatch, HybridModel, StatePools, load_model
from kda_sessions.model.graphs import DecodeGraphs, batch_buckets

if not torch.cuda.is_available():  # Triton reads it when first imported (torch imports it lazily, later)
    os.environ.setdefault("TRITON_INTERPRET", "1")

P = 16


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return load_model("tiny-random")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).double().norm() / b.double().norm().clamp_min(1e-30)).item()


class Sessions:
    """Sequences with growing page lists (appended in place, as the engine's are) over one set of pools."""

    def __init__(self, model: HybridModel, num_slots: int, num_pages: int) -> None:
        self.model = model
        self.pools: StatePools = model.allocate_pools(num_slots, num_pages, P)
        self.pages: list[list[int]] = [[] for _ in range(num_slots)]
        self.lengths = [0] * num_slots
        self.next_page = num_pages - 1  # hand pages out from the top, so tables are not the identity

    def clone(self) -> Sessions:
        """The same sessions over copied pools (the model is shared, not copied)."""
        other = copy.copy(self)
        other.pools = copy.deepcopy(self.pools)
        other.pages = [list(p) for p in self.pages]
        other.lengths = list(self.lengths)
        return other

    def grow(self, s: int, total: int) -> None:
        while len(self.pages[s]) * P < total:
            self.pages[s].append(self.next_page)
            self.next_page -= 1

    def prefill(self, s: int, ids: list[int]) -> None:
        self.grow(s, self.lengths[s] + len(ids))
        dev = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), num_new=[len(ids)], start=[self.lengths[s]],
            slots=torch.tensor([s], device=dev), page_table=torch.tensor([self.pages[s]], dtype=torch.int32, device=dev),
        )
        self.model.step(batch, self.pools)
        self.lengths[s] += len(ids)

    def eager_decode(self, seqs: list[int], ids: list[int], dummies: int = 0, width: int | None = None) -> torch.Tensor:
        """``HybridModel.step`` on one token each; ``dummies`` extra rows spelled out on the scratch slot and
        page (start 0), as DecodeGraphs pads. The page table is ``width`` pages wide (rows padded with the scratch
        page), by default the most pages any of the sequences holds."""
        for s in seqs:
            self.grow(s, self.lengths[s] + 1)
        width = width or max(len(self.pages[s]) for s in seqs)
        scratch_slot, scratch_page = self.pools.scratch_slot, self.pools.scratch_page
        assert scratch_slot is not None and scratch_page is not None
        rows = [self.pages[s] + [scratch_page] * (width - len(self.pages[s])) for s in seqs]
        rows += [[scratch_page] * width] * dummies
        dev = self.model.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids + [0] * dummies, device=dev),
            num_new=[1] * (len(seqs) + dummies),
            start=[self.lengths[s] for s in seqs] + [0] * dummies,
            slots=torch.tensor(seqs + [scratch_slot] * dummies, device=dev),
            page_table=torch.tensor(rows, dtype=torch.int32, device=dev),
        )
        logits, _ = self.model.step(batch, self.pools)
        for s in seqs:
            self.lengths[s] += 1
        return logits[: len(seqs)]

    def static_decode(self, graphs: DecodeGraphs, seqs: list[int], ids: list[int]) -> torch.Tensor:
        for s in seqs:
            self.grow(s, self.lengths[s] + 1)
        logits = graphs.run(ids, seqs, [self.lengths[s] + 1 for s in seqs], [self.pages[s] for s in seqs])
        for s in seqs:
            self.lengths[s] += 1
        return logits.clone()


def pools_equal(a: StatePools, b: StatePools) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.kda + a.conv + a.kv, b.kda + b.conv + b.kv))


def twins(model: HybridModel, contexts: list[int], seed: int) -> tuple[Sessions, Sessions]:
    """Two identical sets of sessions, prefilled to ``contexts``."""
    g = torch.Generator().manual_seed(seed)
    a = Sessions(model, len(contexts), 64)
    for s, n in enumerate(contexts):
        a.prefill(s, torch.randint(0, 272, (n,), generator=g).tolist())
    return a, a.clone()


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(1) == [1]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]


# contexts chosen so decode steps write the last row of a page and the first row of the next (P = 16)
@pytest.mark.parametrize("contexts", [[14], [13, 30], [3, 14, 15, 45]], ids=lambda c: f"ctx{c}")
def test_full_bucket_is_bit_identical_to_step(model, contexts):
    eager, static = twins(model, contexts, seed=len(contexts))
    graphs = DecodeGraphs(model, static.pools, enabled=False)
    seqs = list(range(len(contexts)))
    g = torch.Generator().manual_seed(7)
    for _ in range(4):  # crosses a page boundary for every sequence of context 13..15 and 30
        ids = torch.randint(0, 272, (len(seqs),), generator=g).tolist()
        a = eager.eager_decode(seqs, ids)
        b = static.static_decode(graphs, seqs, ids)
        assert torch.equal(a, b)
        assert pools_equal(eager.pools, static.pools)
    assert graphs.eager_runs == 4 and graphs.replays == 0
    assert static.pages == eager.pages and any(len(p) > -(-c // P) for p, c in zip(static.pages, contexts))


@pytest.mark.parametrize("contexts,active", [([5, 14, 31, 40], [0, 2, 3]), ([2, 15, 17, 33, 50, 6], [1, 3, 5, 0, 4])],
                         ids=["3of4-bucket4", "5of6-bucket8"])
def test_padded_rows_write_only_scratch(model, contexts, active):
    eager, static = twins(model, contexts, seed=11)
    unpadded = eager.clone()
    graphs = DecodeGraphs(model, static.pools, enabled=False)
    dummies = graphs.bucket(len(active)) - len(active)
    assert dummies > 0
    before = copy.deepcopy(static.pools)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        ids = torch.randint(0, 272, (len(active),), generator=g).tolist()
        a = eager.eager_decode(active, ids, dummies=dummies)
        b = static.static_decode(graphs, active, ids)
        c = unpadded.eager_decode(active, ids)
        # the same rows as the eager step over the padded batch: bit for bit, pools included (scratch too)
        assert torch.equal(a, b)
        assert pools_equal(eager.pools, static.pools)
        # against the unpadded step only BLAS blocking differs
        assert rel_err(b, c) < 1e-5
        assert torch.equal(b.argmax(-1), c.argmax(-1))
    # nothing but the active slots, their new rows and the scratch slot / page moved
    sp, ss = static.pools.scratch_page, static.pools.scratch_slot
    written = {static.pages[s][p // P] * P + p % P for s in active for p in range(static.lengths[s] - 3, static.lengths[s])}
    for x, y in zip(before.kda + before.conv, static.pools.kda + static.pools.conv):
        for slot in range(x.shape[0]):
            assert torch.equal(x[slot], y[slot]) == (slot not in active and slot != ss), slot
    for x, y in zip(before.kv, static.pools.kv):
        x, y = x.view(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for row in range(x.shape[0]):
            if row not in written and row // P != sp:
                assert torch.equal(x[row], y[row]), row
        assert all(not torch.equal(x[row], y[row]) for row in written)


def test_too_few_pages_is_a_typed_error(model):
    """The new token's cache row is computed on the host from the page list: a list too short for the context is
    refused before anything runs (no row of another page is written)."""
    _, static = twins(model, [20], seed=3)
    graphs = DecodeGraphs(model, static.pools, enabled=False)
    before = copy.deepcopy(static.pools)
    with pytest.raises(ValueError, match="needs 2 pages of 16, got 1"):
        graphs.run([1], [0], [P + 1], [static.pages[0][:1]])
    assert pools_equal(before, static.pools) and graphs.eager_runs == 0


def test_width_growth_and_bucket_change(model):
    """A page list growing past the table width moves to the next width; batch sizes move between buckets."""
    eager, static = twins(model, [12, 40, 9], seed=3)
    graphs = DecodeGraphs(model, static.pools, enabled=False, min_width=2)
    g = torch.Generator().manual_seed(9)
    plan = [[0], [0, 1], [0, 1, 2], [1], [2, 0], [0, 1, 2]] * 3
    for seqs in plan:
        ids = torch.randint(0, 272, (len(seqs),), generator=g).tolist()
        dummies = graphs.bucket(len(seqs)) - len(seqs)
        a = eager.eager_decode(seqs, ids, dummies=dummies)
        b = static.static_decode(graphs, seqs, ids)
        assert torch.equal(a, b)
    assert pools_equal(eager.pools, static.pools)
    widths = {w for _, w in graphs._static}
    assert len(widths) >= 2 and {bs for bs, _ in graphs._static} == {1, 2, 4}


def use_triton_paged_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the model's MLA decode through ``mla_decode_paged_triton`` (the function ``mla_decode_paged`` hands
    CUDA tensors to) under Triton's interpreter, so the split schedule follows the table width as on a GPU."""
    tl = pytest.importorskip("triton.language")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    from kda_sessions.kernels.mla import paged_decode

    monkeypatch.setattr("kda_sessions.model.mla.mla_decode_paged", paged_decode.mla_decode_paged_triton)


# (MLA backend, contexts spanning 1..34 pages, the decoding sequences); P = 16, every table bucketed to 64 pages
WIDE = {
    "naive-8of8": ("naive", [3, 17, 31, 47, 64, 90, 111, 140], [0, 1, 2, 3, 4, 5, 6, 7]),
    "naive-5of8": ("naive", [15, 47, 2, 111, 200, 33], [4, 1, 3, 0, 5]),
    "triton-3of4": ("triton", [30, 530, 95, 62], [3, 1, 0]),
    "triton-4of4": ("triton", [15, 47, 111, 200], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("backend,contexts,active", WIDE.values(), ids=list(WIDE))
def test_wide_page_table_matches_step(model, monkeypatch, backend, contexts, active):
    """Batches of 3..8 sequences of different lengths, the page-table width bucketed well above the pages any
    of them holds (the GPU bench's batch 8 at 128K: 2049 pages in a 4096-wide table). The static step equals
    ``HybridModel.step`` over the same rows and width bit for bit, and the step over the unpadded table (what
    the bench compared) up to rounding: with Triton the width sets the split schedule (here 2 splits of 512
    tokens against 1, or 2 of 320), so only the order of the float sums differs."""
    if backend == "triton":
        use_triton_paged_decode(monkeypatch)
    same, static = twins(model, contexts, seed=len(active))
    exact = same.clone()
    graphs = DecodeGraphs(model, static.pools, enabled=False, min_width=64)
    dummies = graphs.bucket(len(active)) - len(active)
    g = torch.Generator().manual_seed(10)
    for _ in range(3):  # the sequences of context 15, 47, 111 cross a page boundary
        ids = torch.randint(0, 272, (len(active),), generator=g).tolist()
        for s in active:
            same.grow(s, same.lengths[s] + 1)
        needed = max(len(same.pages[s]) for s in active)
        width = graphs.width(needed)
        assert width == 64 > needed
        a = same.eager_decode(active, ids, dummies=dummies, width=width)
        b = static.static_decode(graphs, active, ids)
        c = exact.eager_decode(active, ids)
        assert torch.equal(a, b)
        assert pools_equal(same.pools, static.pools)
        assert rel_err(b, c) < 1e-5
        assert torch.equal(b.argmax(-1), c.argmax(-1))
    assert graphs.eager_runs == 3 and list(graphs._static) == [(graphs.bucket(len(active)), 64)]


def test_runner_uses_the_static_path(model):
    """The engine runner's decode through DecodeGraphs (forced eager on the CPU) gives the eager tokens."""
    import anyio

    import kda_sessions as ks

    async def generate(static: bool) -> list[list[int]]:
        async with await ks.Engine.open(model="tiny-random", store="memory:", device="cpu") as eng:
            if static:
                r = eng.runner
                r.graphs = DecodeGraphs(r.model, r.pools.tensors, enabled=False, capture_lock=r.pools.mutex)
            sessions = [await eng.create_session(system="s") for _ in range(3)]
            for i, s in enumerate(sessions):
                await s.append("x" * (5 + 13 * i))
            async with anyio.create_task_group() as tg:
                out: list[list[int]] = [[] for _ in sessions]

                async def one(i: int) -> None:
                    r = await sessions[i].generate(max_tokens=20, temperature=0.0)
                    out[i] = r.token_ids

                for i in range(len(sessions)):
                    tg.start_soon(one, i)
            if static:
                assert eng.runner.graphs is not None and eng.runner.graphs.eager_runs > 0
            return out

    assert anyio.run(generate, True) == anyio.run(generate, False)


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = load_model("tiny-random", device="cuda", dtype=torch.float32)
    contexts = [3, 14, 15, 45, 70]
    replay, eager = twins(model, contexts, seed=5)
    static = eager.clone()
    graphs = DecodeGraphs(model, replay.pools)
    plain = DecodeGraphs(model, static.pools, enabled=False)
    assert graphs.use_graphs
    g = torch.Generator().manual_seed(6)
    for step in range(6):
        seqs = [0, 1, 2, 3, 4] if step % 2 else [4, 1, 0]
        ids = torch.randint(0, 272, (len(seqs),), generator=g).tolist()
        a = replay.static_decode(graphs, seqs, ids)
        b = static.static_decode(plain, seqs, ids)
        c = eager.eager_decode(seqs, ids)
        assert rel_err(a, b) < 1e-6, step  # the same kernels, replayed
        assert rel_err(a, c) < 1e-4, step  # vs the eager step (other batch shapes)
        assert torch.equal(a.argmax(-1), c.argmax(-1))
    torch.cuda.synchronize()
    assert graphs.replays == 6 and graphs.captures == 2 and graphs.eager_runs == 0
    for x, y in zip(replay.pools.kda + replay.pools.kv, static.pools.kda + static.pools.kv):
        n = x.shape[0] - 1  # scratch excluded: its padded rows race by design
        assert rel_err(x[:n], y[:n]) < 1e-5


STEP_OPTIONS = ["dense", "uv", "shared", "all"]


@pytest.mark.gpu
@pytest.mark.parametrize("option", STEP_OPTIONS)
def test_one_token_step_options_on_cuda(monkeypatch, option):
    """One sequence (the batch the step's options change), graph replays, each option of the step (on by default)
    against the step without them, from the same states: the dense FFN as a one-expert MoE (``ffn.DENSE_DIRECT``),
    W_uv on 4 rows a program with the MLA merge letting it start early (``matvec_triton.HEAD_ROWS``,
    ``paged_decode.COMBINE_EARLY_TRIGGER``), the MoE up kernel reading the shared expert's rows before its wait
    (``triton_moe.FIXED_FIRST``). Logits within 1e-4 (float32; other sum orders) and the same argmax, step after step; the states after them within 1e-5."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.kernels.linear import matvec_triton
    from kda_sessions.kernels.mla import paged_decode
    from kda_sessions.kernels.moe import triton_moe
    from kda_sessions.model import ffn

    options = {  # option -> (module, name, off, on)
        "dense": [(ffn, "DENSE_DIRECT", False, True)],
        "uv": [(matvec_triton, "HEAD_ROWS", 1, 4), (paged_decode, "COMBINE_EARLY_TRIGGER", False, True)],
        "shared": [(triton_moe, "FIXED_FIRST", False, True)],
    }
    model = load_model("tiny-random", device="cuda", dtype=torch.float32)
    on, off = twins(model, [40], seed=12)
    for mod, name, value, _ in (x for xs in options.values() for x in xs):
        monkeypatch.setattr(mod, name, value)
    plain = DecodeGraphs(model, off.pools)
    for mod, name, _, value in (x for k in (options if option == "all" else [option]) for x in options[k]):
        monkeypatch.setattr(mod, name, value)
    graphs = DecodeGraphs(model, on.pools)
    g = torch.Generator().manual_seed(13)
    for step in range(6):
        ids = torch.randint(0, 272, (1,), generator=g).tolist()
        a = on.static_decode(graphs, [0], ids)
        b = off.static_decode(plain, [0], ids)
        assert rel_err(a, b) < 1e-4, step
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert graphs.replays == 6 and plain.replays == 6
    for x, y in zip(on.pools.kda + on.pools.kv, off.pools.kda + off.pools.kv):
        assert rel_err(x[:-1], y[:-1]) < 1e-5


class PinnedRoutes:
    """``moe_route`` that records the CPU model's experts, call by call, and hands the same ones to the GPU
    model's calls in the same order. A near-tie between two experts resolves by the order of the float32 sums
    (``moe_route``'s docstring), and one flipped expert moves a token's logits by ~10% (tiny-random: 5e-2 relative
    RMS over 80 tokens, unpinned): pinned, the comparison measures the GPU path's arithmetic rather than which
    near-ties flipped. ``flips`` counts the GPU rows whose own choice differed."""

    def __init__(self, route, add_norm_route) -> None:
        self.route = route
        self._add_norm_route = add_norm_route
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.flips = 0

    def __call__(self, x, gate, bias, top_k, renormalize, scale, always_on=None):
        chosen, weights = self.route(x, gate, bias, top_k, renormalize, scale, always_on)
        if not x.is_cuda:
            self.recorded.append((chosen, weights))
            return chosen, weights
        return self._pin(chosen, weights, top_k)

    def add_norm_route(self, x, res, norm_weight, eps, gate, bias, top_k, renormalize, scale, always_on=None):
        """``add_norm_route`` (the GPU decode's norm and router in one launch), its experts pinned likewise."""
        s, h, chosen, weights = self._add_norm_route(x, res, norm_weight, eps, gate, bias, top_k, renormalize,
                                                     scale, always_on)
        assert x.is_cuda
        return (s, h, *self._pin(chosen, weights, top_k))

    def _pin(self, chosen, weights, top_k):
        c, w = self.recorded.pop(0)
        c = c.to(chosen.device)
        self.flips += int((c.sort(-1).values != chosen[:, :top_k].sort(-1).values).any(-1).sum())
        chosen, weights = chosen.clone(), weights.clone()
        chosen[:, :top_k] = c  # the shared expert, when stacked, stays the last column
        weights[:, :top_k] = w.to(weights.device, weights.dtype)
        return chosen, weights


@pytest.mark.gpu
def test_cuda_model_matches_the_cpu_model(monkeypatch):
    """float32: the GPU path (fused MoE with the shared expert stacked in, fused residual norms, KDA's fused
    output norm, merged decode projections and fused decode step) against the CPU path (expert loop, separate
    shared expert, torch norms, the CPU decode), the experts pinned to the CPU's choice (``PinnedRoutes``):
    prefill and decode logits within 1e-3, Triton's float32 dots at their CUDA default (tf32 inputs)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.model import ffn

    routes = PinnedRoutes(ffn.moe_route, ffn.add_norm_route)
    monkeypatch.setattr(ffn, "moe_route", routes)
    monkeypatch.setattr(ffn, "add_norm_route", routes.add_norm_route)
    cpu = load_model("tiny-random")
    gpu = load_model("tiny-random", device="cuda", dtype=torch.float32)
    ids = torch.randint(0, 272, (2, 40), generator=torch.Generator().manual_seed(7))
    b = cpu(ids)
    a = gpu(ids.cuda()).cpu()
    err = rel_err(a, b)
    assert err < 1e-3 and bool((a.argmax(-1) == b.argmax(-1)).all()), (err, routes.flips)
    on_cpu = twins(cpu, [5, 33, 70], seed=8)[0]
    on_gpu = twins(gpu, [5, 33, 70], seed=8)[0]
    for step in range(3):
        tokens = [step + 1, step + 20, step + 40]
        y = on_cpu.eager_decode([0, 1, 2], tokens)
        x = on_gpu.eager_decode([0, 1, 2], tokens).cpu()
        assert rel_err(x, y) < 1e-3, (step, rel_err(x, y), routes.flips)
    assert not routes.recorded  # every CPU call had its GPU twin


@pytest.mark.slow  # ~2.5 min on a 2-core VM: the decode steps' kernels run in Triton's interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (a CPU run)")
@pytest.mark.parametrize("options", [False, True], ids=["default", "options"])
def test_gpu_decode_branches_match_the_cpu_path(model, monkeypatch, options):
    """The decode step's GPU branches (KDA's decode with its output norm, the MoE block's adds and norms in the
    router's and the down kernel's launches, at one token and at three) run on a CPU through the interpreter,
    whose float32 dots are exact: the logits equal the CPU path's to 1e-5. The MLA decode takes its Triton split
    kernel (the Gluon one and the SM count need a real device). ``options``: with the dense FFN in the direct MoE
    kernels (``ffn.DENSE_DIRECT``) and the shared expert's up rows read first (``triton_moe.FIXED_FIRST``)."""
    import types

    from kda_sessions.kernels.mla import paged_decode
    from kda_sessions.kernels.moe import triton_moe
    from kda_sessions.model import ffn

    monkeypatch.setattr(ffn, "DENSE_DIRECT", options)
    monkeypatch.setattr(triton_moe, "FIXED_FIRST", options)

    monkeypatch.setattr(paged_decode, "gluon_split_ok", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(multi_processor_count=4))
    m = copy.deepcopy(model)
    m.stack_experts()
    on_cpu, on_gpu = twins(m, [20, 9, 33], seed=11)
    for seqs, ids in (([0], [5]), ([0, 1, 2], [7, 8, 9])):
        ref = on_cpu.eager_decode(seqs, ids)
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            out = on_gpu.eager_decode(seqs, ids)
        assert rel_err(out, ref) < 1e-5, (seqs, rel_err(out, ref))
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_merged_decode_projections_equal_the_separate_ones(model):
    """The GPU decode's two matvecs over merged weights give the eight projections' outputs (run here on a CPU)."""
    from kda_sessions.model.kda import KDAAttention

    attn = next(m for m in model.modules() if isinstance(m, KDAAttention))
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        for merged, separate in zip(attn._projections_merged(x), attn._projections(x)):
            assert merged.shape == separate.shape and rel_err(merged, separate) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on a CPU; compiled on a GPU machine: "
                    "tests/kernels/test_kda_decode.py")
def test_fused_kda_decode_equals_the_separate_kernels(model, monkeypatch):
    """A KDA layer's GPU decode (``kda_decode``: two launches) against its separate conv, gate and recurrence
    twins, run here on a CPU through Triton's interpreter: output, states and conv tails at the slots."""
    from kda_sessions.model.kda import KDAAttention

    attn = next(m for m in model.modules() if isinstance(m, KDAAttention))
    pools = model.allocate_pools(4, 4, P)
    g = torch.Generator().manual_seed(10)
    for t in pools.kda[:1] + pools.conv[:1]:
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    x = torch.randn(3, model.config.hidden_size, generator=g)
    slots, cu = torch.tensor([3, 0, 1]), torch.arange(4)
    state, conv = pools.kda[0].clone(), pools.conv[0].clone()
    with torch.no_grad():
        attn.fast_cpu = False
        try:
            ref = attn.decode(x, slots, cu, pools.kda[0], pools.conv[0])
        finally:
            attn.fast_cpu = True
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        out = attn.decode(x, slots, cu, state, conv)
        monkeypatch.undo()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(state, pools.kda[0]) < 1e-6
    assert rel_err(conv, pools.conv[0]) < 1e-6  # the new rows: merged vs separate projections, last bits
    assert torch.equal(conv[2], pools.conv[0][2])  # a slot outside the batch is untouched
