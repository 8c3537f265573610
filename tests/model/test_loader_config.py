"""Config keys that change the math are honoured or refused with a ConfigError, never ignored."""

from __future__ import annotations

import json

import pytest

from kda_sessions.config import ConfigError, ModelConfig
from kda_sessions.model.loader import BUILTIN_DIR


def tiny_config() -> dict:
    return json.loads((BUILTIN_DIR / "tiny-random.json").read_text())


def test_linear_attn_gate_lower_bound_selects_the_bounded_gate() -> None:
    d = tiny_config()
    assert ModelConfig.from_dict(d).kda_gate_lower_bound is None
    d["linear_attn_config"]["gate_lower_bound"] = -5.0
    cfg = ModelConfig.from_dict(d)
    assert cfg.kda_gate_lower_bound == -5.0
    assert cfg.fingerprint != ModelConfig.from_dict(tiny_config()).fingerprint


def test_gate_lower_bound_agreeing_keys_pass_disagreeing_keys_refused() -> None:
    d = tiny_config()
    d["linear_attn_config"]["gate_lower_bound"] = -5.0
    d["kda_gate_lower_bound"] = -5.0
    assert ModelConfig.from_dict(d).kda_gate_lower_bound == -5.0
    d["kda_gate_lower_bound"] = -3.0
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        ModelConfig.from_dict(d)
    d = tiny_config()
    d["linear_attn_config"]["gate_lower_bound"] = 1.0
    with pytest.raises(ConfigError, match="gate_lower_bound"):
        ModelConfig.from_dict(d)


def test_mla_output_gate_refused_when_on() -> None:
    d = tiny_config()
    d["mla_use_output_gate"] = False
    assert ModelConfig.from_dict(d).model_extra == {"mla_use_output_gate": False}  # kept, as before
    d["mla_use_output_gate"] = True
    with pytest.raises(ConfigError, match="mla_use_output_gate"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("key", ["num_expert_group", "topk_group"])
def test_group_limited_routing_refused(key: str) -> None:
    d = tiny_config()
    d[key] = 1
    assert ModelConfig.from_dict(d).model_extra == {key: 1}  # Kimi-Linear's value: plain top-k
    d[key] = 4
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(d)
