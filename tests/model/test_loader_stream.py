"""Streaming a sharded Kimi-Linear checkpoint written with plain safetensors (not save_model) into the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kda_sessions.model import CheckpointError, load_model
from kda_sessions.model.ffn import MoE
from kda_sessions.model.loader import BUILTIN_DIR, load_weights

SHARDS = 3


def write_sharded(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json of tiny-random and the tensors in SHARDS shards with an index, as HF tools write them."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text((BUILTIN_DIR / "tiny-random.json").read_text())
    names = list(state)
    weight_map = {}
    for i in range(SHARDS):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {n: state[n].to(dtype).contiguous().clone() for n in names[i::SHARDS]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def reference():
    return load_model("tiny-random")


def test_sharded_bf16_checkpoint_streams_in(tmp_path, reference) -> None:
    write_sharded(tmp_path, reference.state_dict())
    m = load_model(tmp_path, dtype=torch.bfloat16)
    ref = {n: t.to(torch.bfloat16) for n, t in reference.state_dict().items()}
    for n, t in m.state_dict().items():
        want = torch.float32 if n.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else torch.bfloat16
        assert t.dtype == want, n
        assert torch.equal(t.to(torch.bfloat16), ref[n]), n
    moes = [x for x in m.modules() if isinstance(x, MoE)]
    assert moes and all(x._stacked_weights() is not None for x in moes)  # experts loaded into stacked storage
    assert all((f := x._fused_weights()) is not None and f[2] == len(x.experts) for x in moes)  # shared too
    dense = [la.mlp for la in m.model.layers if hasattr(la, "mlp")]
    assert dense and all(d._fused_weights() is not None for d in dense)  # gate and up loaded into stacked storage
    ids = torch.arange(12).view(1, 12)
    assert torch.isfinite(m(ids)).all()


def test_float32_load_equals_the_reference_and_reports_its_rate(tmp_path, reference) -> None:
    write_sharded(tmp_path, reference.state_dict(), dtype=torch.float32)
    ids = torch.arange(20).view(1, 20)
    assert torch.equal(load_model(tmp_path)(ids), reference(ids))
    with torch.device("meta"):
        m = type(reference)(reference.config)
    stats = load_weights(m, sorted(tmp_path.glob("*.safetensors")), "cpu", torch.float32)
    total = sum(t.numel() * 4 for t in reference.state_dict().values())
    assert stats.shards == SHARDS and stats.bytes_read == total and stats.gb_per_s > 0


def test_a_tensor_in_two_shards_or_a_missing_shard_is_refused(tmp_path, reference) -> None:
    state = reference.state_dict()
    write_sharded(tmp_path, state)
    name = next(iter(state))
    save_file({name: state[name].to(torch.bfloat16)}, str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["x"] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="more than one shard"):
        load_model(tmp_path)
    (tmp_path / "extra.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing from"):
        load_model(tmp_path)
