"""The CPU decode path (fused projections, absorbed MLA, a batched recurrence) against the reference path through
separate linears and the kernels' naive twins: same logits to float rounding, same pooled states, same greedy
tokens."""

import gc
import json
import weakref

import pytest
import torch

from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel, load_model
from kda_sessions.model.ffn import RMSNorm
from kda_sessions.model.fused import reduction_weight, row_matmul
from kda_sessions.model.loader import BUILTIN_DIR
from kda_sessions.model.mla import MLAttention

from .helpers import Runner

TOL = 2e-5  # relative RMS of logits and states, float32: only the order of sums differs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def set_fast(model: HybridModel, on: bool) -> None:
    for m in model.modules():  # attention layers and dense FFNs
        if hasattr(m, "fast_cpu"):
            m.fast_cpu = on


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.mark.parametrize("lengths", [[37], [5, 40, 77]], ids=["one-seq", "three-ragged"])
def test_fast_decode_matches_reference(model, lengths):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    seqs = list(range(len(lengths)))
    runs = {}
    for fast in (False, True):
        set_fast(model, fast)
        r = Runner(model, len(lengths), 120)
        logits, _ = r.feed(seqs, prompts)  # prefill: the same path either way
        steps = [(None, logits)]
        for _ in range(12):  # greedy decode; the tokens are fed back, so a wrong step changes the rest
            nxt = logits.argmax(-1)
            logits, _ = r.feed(seqs, [[t] for t in nxt.tolist()])
            steps.append((nxt, logits))
        runs[fast] = (steps, r.pools)
    set_fast(model, True)
    (ref, ref_pools), (got, got_pools) = runs[False], runs[True]
    for (t_ref, l_ref), (t_got, l_got) in zip(ref, got):
        assert t_ref is None or torch.equal(t_ref, t_got)
        assert rel_err(l_got, l_ref) < TOL
    for a, b in zip(got_pools.kda, ref_pools.kda):
        assert rel_err(a, b) < TOL
    for a, b in zip(got_pools.kv, ref_pools.kv):
        assert rel_err(a, b) < TOL


def test_fast_decode_with_bounded_gate_matches_reference(tmp_path):
    """The bounded KDA gate (``kda_gate_lower_bound``) on the CPU decode path, one sequence and two."""
    from kda_sessions.model import save_model

    save_model(load_model("tiny"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["kda_gate_lower_bound"] = -5.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path)
    for seqs in ([0], [0, 1]):
        runs = {}
        for fast in (False, True):
            set_fast(m, fast)
            r = Runner(m, len(seqs), 60)
            logits, _ = r.feed(seqs, [list(range(10 + 7 * s, 40)) for s in seqs])
            for _ in range(6):
                logits, _ = r.feed(seqs, [[t] for t in logits.argmax(-1).tolist()])
            runs[fast] = (logits, r.pools.kda)
        assert rel_err(runs[True][0], runs[False][0]) < TOL
        for a, b in zip(runs[True][1], runs[False][1]):
            assert rel_err(a, b) < TOL


def _scale_weights(m: HybridModel, factor: float) -> None:
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.o_proj.weight.mul_(factor)  # absorbed into MLA's fused output weight
            if hasattr(attn, "k_proj"):
                attn.k_proj.weight.mul_(factor)  # part of KDA's fused input weight
            if hasattr(layer, "mlp"):
                layer.mlp.up_proj.weight.mul_(factor)  # part of the FFN's fused gate | up weight


def test_fast_decode_sees_new_weights():
    """The fused weights are a cache of the parameters: an in-place change is picked up on the next step."""
    m = load_model("tiny")
    out = {}
    for fast, factor in ((True, 1.0), (True, 0.5), (False, 0.5)):
        set_fast(m, fast)
        r = Runner(m, 1, 40)
        r.feed([0], [list(range(30))])  # prefill with the original weights (and fused copies of them)
        _scale_weights(m, factor)
        out[fast, factor], _ = r.feed([0], [[30]])
        _scale_weights(m, 1 / factor)
    assert rel_err(out[True, 0.5], out[False, 0.5]) < TOL
    assert rel_err(out[True, 0.5], out[True, 1.0]) > 1e-3  # the change mattered


def test_fast_decode_sees_replaced_parameters():
    """A parameter replaced by a new object (as ``load_state_dict(assign=True)`` and the loader do) after decode
    steps ran is read by the next step, in a derived weight (KDA's k_proj), a norm and the head."""
    m = load_model("tiny")
    out = {}
    for fast in (True, False):
        set_fast(m, fast)
        r = Runner(m, 1, 40)
        r.feed([0], [list(range(30))])
        r.feed([0], [[30]])  # a decode step with the original parameters
        saved = {}
        for mod, name in ((m.model.layers[0].self_attn.k_proj, "weight"), (m.model.layers[1].input_layernorm, "weight"),
                          (m.lm_head, "weight")):
            saved[mod, name] = getattr(mod, name)
            setattr(mod, name, torch.nn.Parameter(getattr(mod, name).detach() * 0.5))
        out[fast], _ = r.feed([0], [[31]])
        for (mod, name), p in saved.items():
            setattr(mod, name, p)
    set_fast(m, True)
    assert rel_err(out[True], out[False]) < TOL
    r = Runner(m, 1, 40)
    r.feed([0], [list(range(30))])
    r.feed([0], [[30]])
    unchanged, _ = r.feed([0], [[31]])
    assert rel_err(out[True], unchanged) > 1e-3  # the change mattered


def test_autograd_goes_through_the_parameters():
    """With autograd on, the layers use their own parameters (the fused copies are detached)."""
    m = load_model("tiny")
    pools = m.allocate_pools(2, 2, 16)
    pools.kda[0].normal_()  # a nonzero state, so that the decay (f_b_proj) matters
    layer = m.model.layers[0].self_attn
    x = torch.randn(2, m.config.hidden_size)
    y = layer.decode(x, torch.arange(2), torch.arange(3), pools.kda[0], pools.conv[0])
    y.sum().backward()
    for p in (layer.q_proj.weight, layer.f_b_proj.weight, layer.g_b_proj.weight, layer.b_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("seqs", [3, 1], ids=["three-ragged", "one-seq"])
def test_mla_decode_with_q_lora_matches_reference(seqs):
    """The absorbed query also holds with a low-rank query (q_a_proj -> norm -> q_b_proj), N ragged sequences, and
    one (``decode_one``)."""
    cfg = ModelConfig.from_dict({**json.loads((BUILTIN_DIR / "tiny.json").read_text()), "q_lora_rank": 48})
    torch.manual_seed(0)
    layer = MLAttention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    P, lens = 16, [20, 23, 40][:seqs]
    pages = torch.zeros(8, P, cfg.latent_dim)
    pages.normal_()
    # pages out of order, and the first two sequences sharing their first, full page (as forks do: a fork copies
    # the partial page it writes to)
    table = torch.tensor([[0, 3, 2, 1], [0, 1, 2, 3], [6, 7, 4, 5]][:seqs], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    rows = torch.stack([table[n, (s - 1) // P].long() * P + (s - 1) % P for n, s in enumerate(lens)])
    x = torch.randn(seqs, cfg.hidden_size)
    out = {}
    with torch.inference_mode():
        for fast in (False, True):
            layer.fast_cpu = fast
            kv = pages.clone()
            out[fast] = (layer.decode(x, table, seq_lens, rows, kv), kv)
    assert rel_err(out[True][0], out[False][0]) < TOL
    assert rel_err(out[True][1], out[False][1]) < TOL


@pytest.mark.parametrize("rows", [1, 3, 64], ids=["1-row", "3-rows", "64-rows"])
def test_norm_rows_equal_the_module(rows):
    """``RMSNorm.rows``, the decode step's norm in fewer ops, gives ``F.rms_norm``'s values bit for bit (float32)."""
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(256, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    for scale in (1e-3, 1.0, 50.0):
        x = torch.randn(rows, 256, generator=g) * scale
        with torch.inference_mode():
            assert torch.equal(norm.rows(x), norm(x))


@pytest.mark.parametrize("seqs", [[0, 1], [1, 0]], ids=["consecutive-slots", "gathered-slots"])
def test_decode_step_in_fewer_ops_keeps_the_logits(monkeypatch, seqs):
    """The eager CPU step of whole-model ops (``_decode_cpu``: residual adds inside the matmuls; KDA states as
    views for consecutive slots, else gathered) against the per-layer step (the layers' own ``decode``,
    ``_fast_cpu_decode`` off) over 12 greedy tokens of two sequences: the same tokens, logits and states to float
    rounding."""
    m = load_model("tiny")
    prompts = [list(range(40, 90)), list(range(7, 30))]
    lean_steps = []
    lean_step = HybridModel._decode_cpu
    monkeypatch.setattr(HybridModel, "_decode_cpu", lambda self, *a: lean_steps.append(1) or lean_step(self, *a))
    runs = {}
    for lean in (False, True):
        if not lean:
            monkeypatch.setattr(HybridModel, "_fast_cpu_decode", lambda self, ids: False)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(HybridModel, "_decode_cpu", lambda self, *a: lean_steps.append(1) or lean_step(self, *a))
        r = Runner(m, 2, 120)
        logits, _ = r.feed(seqs, prompts)
        steps = []
        for _ in range(12):
            nxt = logits.argmax(-1)
            logits, _ = r.feed(seqs, [[t] for t in nxt.tolist()])
            steps.append((nxt, logits))
        runs[lean] = (steps, r.pools)
        assert len(lean_steps) == (12 if lean else 0)
    (ref, ref_pools), (got, got_pools) = runs[False], runs[True]
    for (t_ref, l_ref), (t_got, l_got) in zip(ref, got):
        assert torch.equal(t_ref, t_got)
        assert rel_err(l_got, l_ref) < TOL
    for a, b in zip(got_pools.kda + got_pools.conv + got_pools.kv, ref_pools.kda + ref_pools.conv + ref_pools.kv):
        assert rel_err(a, b) < TOL


def test_decode_step_slot_views_follow_the_pools_and_slots():
    """One-sequence steps of two sequences in turn, each in its own slot, from two pools objects in turn (the slot
    views ``_CpuDecodePlan.pool_rows`` keeps change every step): logits bit-identical to each sequence's steps alone;
    the views do not keep a dropped pools object's tensors alive."""
    m = load_model("tiny")
    prompts = [list(range(40, 90)), list(range(7, 30))]
    alone = {}
    for s in (0, 1):
        r = Runner(m, 2, 80)
        logits, _ = r.feed([s], [prompts[s]])
        alone[s] = []
        for _ in range(6):
            logits, _ = r.feed([s], [[int(logits.argmax(-1))]])
            alone[s].append(logits)
    runners = [Runner(m, 2, 80), Runner(m, 2, 80)]
    nxt = {}
    for i, r in enumerate(runners):
        for s in (0, 1):
            nxt[i, s] = int(r.feed([s], [prompts[s]])[0].argmax(-1))
    for step in range(6):
        for s in (0, 1):
            for i, r in enumerate(runners):
                logits, _ = r.feed([s], [[nxt[i, s]]])
                assert torch.equal(logits, alone[s][step]), (step, s, i)
                nxt[i, s] = int(logits.argmax(-1))
    held = weakref.ref(runners[1].pools.kda[0])  # the pools of the last step
    del runners, r
    gc.collect()
    assert held() is None


def test_row_matmul_is_a_matmul_of_the_reduction_layout():
    """``reduction_weight`` keeps the values as the [in, out] transpose of a contiguous [out, in] copy (each output's
    sum along contiguous memory), in the dtype asked for; eagerly ``row_matmul`` is the plain matmul."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 32, generator=g)  # [out, in]
    x = torch.randn(2, 32, generator=g)
    r = reduction_weight(w)
    assert r.shape == (32, 48) and r.t().is_contiguous() and torch.equal(r, w.t())
    assert torch.equal(row_matmul(x, r), x @ w.t())
    b = reduction_weight(w, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b.t().is_contiguous() and torch.equal(b.float(), w.bfloat16().float().t())


@pytest.mark.slow
@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16], ids=["model-dtype", "bf16-weights"])
def test_compiled_decode_matches_eager(weight_dtype):
    """``compile_cpu_decode``: one sequence's decode steps through torch.compile (20-60 s to compile on 2 cores)
    give the eager path's greedy tokens, logits and states to float rounding with the model's weights (within
    bfloat16's rounding of the weights with those, fed the eager tokens); the context grows every step on one
    graph."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m = load_model("tiny")
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for compiled in (False, True):
        if compiled:
            assert m.compile_cpu_decode(weight_dtype)
        r = Runner(m, 2, 120)
        logits, _ = r.feed([1], [prompt])
        steps = []
        for i in range(12):
            nxt = logits.argmax(-1)
            if compiled and weight_dtype is not None:
                nxt = runs[False][0][i][0]  # a near tie may pick another token at bfloat16's rounding
            logits, _ = r.feed([1], [nxt.tolist()])
            steps.append((nxt, logits))
        runs[compiled] = (steps, r.pools)
    m.decode_eagerly()
    (ref, ref_pools), (got, got_pools) = runs[False], runs[True]
    tol = TOL if weight_dtype is None else 5e-3
    for (t_ref, l_ref), (t_got, l_got) in zip(ref, got):
        assert torch.equal(t_ref, t_got)
        assert rel_err(l_got, l_ref) < tol
    for a, b in zip(got_pools.kda + got_pools.conv + got_pools.kv, ref_pools.kda + ref_pools.conv + ref_pools.kv):
        assert rel_err(a, b) < tol
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
async def test_engine_cpu_compile_gives_the_eager_tokens():
    """``EngineConfig.cpu_compile``: the step thread compiles before its first step, once (a session whose pages
    are not consecutive, gathered, runs on the warm-up's graph), and a session's greedy tokens are the eager
    engine's."""
    import torch._dynamo

    import kda_sessions as ks

    prompt = [(i * 37) % 250 for i in range(120)]
    tokens = {}
    for compile_ in (False, True):
        torch._dynamo.utils.counters.clear()
        async with await ks.Engine.open(model="tiny", store="memory:", device="cpu", cpu_compile=compile_) as eng:
            s = await eng.create_session()
            await s.append(prompt)  # pages 0 and 1
            other = await eng.create_session()
            await other.append(prompt[:70])  # pages 2 and 3: s's third page comes after them
            tokens[compile_] = (await s.generate(max_tokens=16, ignore_eos=True)).token_ids
            assert eng.core.runner.compiled == compile_
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == int(compile_)
    assert len(tokens[True]) == 16 and tokens[True] == tokens[False]
