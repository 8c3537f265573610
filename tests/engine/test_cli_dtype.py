"""``--dtype`` and ``--page-wait`` reach the engine: the weights load in the dtype asked for, ``auto`` follows
the device, and a bad name is a one-line ConfigError naming the choices."""

from __future__ import annotations

import pytest
import torch

from kda_sessions import cli
from kda_sessions.dtypes import resolve_dtype
from kda_sessions.errors import ConfigError
from kda_sessions.server.settings import ServerSettings


def test_auto_is_bfloat16_on_cuda_and_float32_on_the_cpu():
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("float16", "cpu") is torch.float16


def test_flags_reach_the_engine_and_the_server_settings():
    args = cli.parse_args(["serve", "--dtype", "bfloat16", "--page-wait", "2.5"])
    assert cli._dtype(args) is torch.bfloat16
    assert cli._engine_config(args).page_wait_s == 2.5
    assert cli._serve_settings(args).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServerSettings(dtype="fp8")


def test_a_bad_dtype_is_a_one_line_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(ConfigError, match="got 'int8'"):
        resolve_dtype("int8", "cpu")
    assert cli.main(["bench", "--context", "8", "--dtype", "int8"]) == 1
    assert "ConfigError: dtype must be one of" in capsys.readouterr().err


async def test_the_engine_loads_the_weights_in_the_dtype_asked_for():
    from kda_sessions.api import Engine

    args = cli.parse_args(["chat", "--model", "tiny-random", "--dtype", "bfloat16"])
    async with await Engine.open(model=args.model, store="memory:", device=args.device, dtype=cli._dtype(args),
                                 config=cli._engine_config(args)) as engine:
        assert engine.fingerprint.dtype == "bfloat16" and engine.model.dtype is torch.bfloat16
        s = await engine.create_session()
        reply = await s.send("hi", max_tokens=2, temperature=0.0)
        assert reply.usage.completion_tokens >= 1
