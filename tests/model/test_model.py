import itertools
import json

import pytest
import torch

from kda_sessions.config import ConfigError, ModelConfig
from kda_sessions.kernels.moe.naive import naive_fused_moe
from kda_sessions.model import CheckpointError, load_model, save_model
from kda_sessions.model.ffn import MoE, SwiGLU
from kda_sessions.model.loader import BUILTIN_DIR

from .helpers import Runner


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random")


def test_tiny_random_is_seeded_identically(model):
    again = load_model("tiny-random")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    # a fixed value pins the generator across machines and torch versions
    w = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert w.shape == (256, 256)
    assert abs(w.double().std().item() - 1 / 16) < 2e-3


def test_prefill_then_decode_equals_one_prefill(model):
    ids = torch.randint(0, 272, (1, 70), generator=torch.Generator().manual_seed(1))
    full = model(ids)[0]  # [70, vocab]
    r = Runner(model, 1, 80)
    logits, _ = r.feed([0], [ids[0, :60].tolist()])
    assert rel_err(logits[0], full[59]) < 1e-4
    for t in range(60, 70):  # decode path: fused recurrent + absorbed paged MLA
        logits, _ = r.feed([0], [[ids[0, t].item()]])
        assert rel_err(logits[0], full[t]) < 1e-4


@pytest.mark.parametrize("cuts", [[1], [17, 33], [5, 6, 64, 65]], ids=str)
def test_split_prefill_equals_one_prefill(model, cuts):
    ids = torch.randint(0, 272, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    full = model(torch.tensor([ids]))[0]
    r = Runner(model, 1, 96)
    bounds = [0, *cuts, 90]
    for a, b in itertools.pairwise(bounds):
        logits, _ = r.feed([0], [ids[a:b]])
        assert rel_err(logits[0], full[b - 1]) < 1e-4


def test_varlen_batch_equals_one_at_a_time(model):
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 272, (n,), generator=g).tolist() for n in (5, 40, 77)]
    together = Runner(model, 3, 80)
    logits, _ = together.feed([0, 1, 2], seqs, all_logits=True)
    offset = 0
    for s in seqs:
        alone = model(torch.tensor([s]))[0]
        assert rel_err(logits[offset : offset + len(s)], alone) < 1e-4
        offset += len(s)


def test_checkpoint_states_resume_like_the_original(model):
    ids = torch.randint(0, 272, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    r = Runner(model, 2, 64)
    _, ck = r.feed([0], [ids], checkpoints=[[20, 50]])
    assert ck is not None and ck.kda.shape[:2] == (2, 6) and ck.conv.shape[:2] == (2, 6)
    # the state at 50 equals the pooled final state
    assert torch.allclose(ck.kda[1], torch.stack([s[0] for s in r.pools.kda]), atol=1e-5)
    # seed slot 1 with the state at 20 and the first 20 tokens' pages, then continue: same logits as slot 0
    for i, (s, c) in enumerate(zip(r.pools.kda, r.pools.conv)):
        s[1], c[1] = ck.kda[0, i], ck.conv[0, i]
    for kv in r.pools.kv:
        kv[r.table[1].long()] = kv[r.table[0].long()]
    r.lengths[1] = 20
    logits, _ = r.feed([1], [ids[20:]])
    logits0, _ = Runner(model, 1, 64).feed([0], [ids])
    assert rel_err(logits[0], logits0[0]) < 1e-4


def test_save_load_round_trip(tmp_path, model):
    save_model(model, tmp_path / "one")
    save_model(model, tmp_path / "sharded", max_shard_bytes=4 << 20)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = torch.arange(30).view(1, 30)
    want = model(ids)
    for d in ("one", "sharded"):
        m = load_model(tmp_path / d)
        assert torch.equal(m(ids), want)


def _tiny_config() -> dict:
    return json.loads((BUILTIN_DIR / "tiny-random.json").read_text())


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6]), "neither"),
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c["linear_attn_config"].update(full_attn_layers=[4, 8, 9]), "exceed"),
        (lambda c: c.update(num_experts_per_token=9), "num_experts_per_token"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
    ],
    ids=["layer-in-no-list", "model-type", "layer-out-of-range", "top-k", "missing-field"],
)
def test_bad_config_names_the_field(mutate, field):
    cfg = _tiny_config()
    mutate(cfg)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(cfg)


def test_bad_checkpoint_lists_the_names(tmp_path, model):
    from safetensors.torch import load_file, save_file

    save_model(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.norm.weight"]
    state["model.bogus"] = torch.zeros(1)
    state["lm_head.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "model.norm.weight" in msg and "model.bogus" in msg and "lm_head.weight" in msg
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(tmp_path)
    with pytest.raises(CheckpointError, match="neither a built-in"):
        load_model(tmp_path / "nope")


def test_bounded_gate_model_runs(tmp_path, model):
    save_model(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["kda_gate_lower_bound"] = -5.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path)
    out = m(torch.arange(20).view(1, 20))
    assert torch.isfinite(out).all() and not torch.allclose(out, model(torch.arange(20).view(1, 20)))


@pytest.mark.parametrize("T", [1, 2, 16], ids=lambda t: f"T{t}")
def test_moe_stacked_experts_match_the_sparse_loop(T: int) -> None:
    """stack_experts keeps the weights (the experts view the stacked tensors), and the fused MoE's twin on the
    stacked weights equals the layer's per-expert loop."""
    model = load_model("tiny-random")
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    before = {n: t.clone() for n, t in moe.state_dict().items()}
    x = torch.randn(T, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    sparse = moe(x)
    moe.stack_experts()
    after = moe.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    stacked = moe._stacked_weights()
    assert stacked is not None
    scores = torch.sigmoid(x @ moe.gate.weight.t())
    _, chosen = torch.topk(scores + moe.gate.e_score_correction_bias, moe.top_k, dim=-1)
    w = scores.gather(-1, chosen)
    w = w / w.sum(-1, keepdim=True) * moe.scale
    routed = naive_fused_moe(x, *stacked, chosen, w)
    assert moe.shared_experts is not None
    assert torch.allclose(routed + moe.shared_experts(x), sparse, rtol=1e-5, atol=1e-5)
    assert torch.equal(moe(x), sparse)  # the CPU path is the loop, unchanged
    model.to(torch.float64)  # breaks the views: the stacked path turns itself off
    assert moe._stacked_weights() is None


def test_dense_ffn_stack_keeps_weights_and_the_one_expert_twin_equals_it() -> None:
    """SwiGLU.stack: gate and up view one [1, 2F, D] tensor (memory-neutral, names and values unchanged), and
    the MoE twin over it with one expert of weight 1 equals the FFN; residual_block on a CPU is the unfused
    path; ``.to()`` breaks the views and the stacked path turns itself off."""
    model = load_model("tiny-random")
    layer = next(la for la in model.model.layers if hasattr(la, "mlp"))
    mlp = layer.mlp
    assert isinstance(mlp, SwiGLU)
    before = {n: t.clone() for n, t in mlp.state_dict().items()}
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    dense = mlp(x)
    model.stack_experts()
    fused = mlp._fused_weights()
    assert fused is not None
    w13, w2 = fused
    F_ = mlp.gate_proj.weight.shape[0]
    assert w13.shape == (1, 2 * F_, x.shape[1]) and mlp.gate_proj.weight.data_ptr() == w13.data_ptr()
    after = mlp.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    one = torch.zeros(3, 1, dtype=torch.int64)
    assert torch.allclose(naive_fused_moe(x, w13, w2, one, torch.ones(3, 1)), dense, rtol=1e-5, atol=1e-6)
    a = torch.randn_like(x)
    s, h = mlp.residual_block(x, a, layer.post_attention_layernorm, model.model.norm)
    s1, h1 = layer.post_attention_layernorm.residual(x, a)
    s2, h2 = model.model.norm.residual(s1, mlp(h1))
    assert torch.equal(s, s2) and torch.equal(h, h2)  # a CPU: the module's call between the two norms
    model.to(torch.float64)
    assert mlp._fused_weights() is None
