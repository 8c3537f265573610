"""kda_sessions/generation_config.py: a model's suggested sampling, as the server's defaults for requests that
name none (issue 31: `tiny` sampled at OpenAI's temperature 1 writes noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kda_sessions.errors import ConfigError
from kda_sessions.generation_config import GenerationDefaults, generation_defaults, parse_generation_config
from kda_sessions.server.chat import sampling_args
from kda_sessions.server.schemas import ChatCompletionRequest
from kda_sessions.server.settings import ServerSettings


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], **fields)


def test_tiny_is_greedy_by_default_and_a_request_still_decides():
    assert generation_defaults("tiny") == GenerationDefaults(temperature=0.0, top_p=1.0, max_tokens=256)
    settings = ServerSettings(model="tiny")
    args = sampling_args(_request(), settings)
    assert (args["temperature"], args["top_p"], args["max_tokens"]) == (0.0, 1.0, 256)
    args = sampling_args(_request(temperature=0.7, max_tokens=9), settings)
    assert (args["temperature"], args["max_tokens"]) == (0.7, 9)
    assert sampling_args(_request(), ServerSettings(model="tiny", default_max_tokens=40))["max_tokens"] == 40


def test_a_model_without_a_generation_config_keeps_openais_defaults():
    args = sampling_args(_request(), ServerSettings(model="tiny-random"))
    assert (args["temperature"], args["top_p"], args["max_tokens"]) == (1.0, 1.0, 512)


def test_a_checkpoint_folders_generation_config(tmp_path: Path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    assert generation_defaults(str(tmp_path)) == GenerationDefaults(temperature=0.6, top_p=0.9)
    assert parse_generation_config({"do_sample": False, "temperature": 0.8}).temperature == 0.0
    with pytest.raises(ConfigError, match="generation config"):
        parse_generation_config({"max_new_tokens": "many"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        generation_defaults(str(bad))
