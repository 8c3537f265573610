"""The CLI's engine flags reach EngineConfig, and a bad value is a one-line typed error naming the field."""

from __future__ import annotations

import pytest

from kda_sessions import cli


def test_engine_flags_build_the_config():
    args = cli._parser().parse_args([
        "serve", "--lease-ttl", "2.5", "--enforce-eager", "--page-size", "16", "--num-pages", "128",
        "--max-active-sessions", "3", "--ram-tier-mib", "5", "--no-decode-ahead",
    ])
    c = cli._engine_config(args)
    assert (c.lease_ttl_s, c.cuda_graphs, c.page_size, c.num_pages, c.max_active_sessions) == (2.5, False, 16, 128, 3)
    assert c.decode_ahead is False and cli._engine_config(cli._parser().parse_args(["serve"])).decode_ahead is True
    assert c.ram_tier_bytes == 5 << 20
    c = cli._engine_config(cli._parser().parse_args(["bench", "--cpu-threads", "3", "--cpu-decode-threads", "2"]))
    assert (c.cpu_threads, c.cpu_decode_threads) == (3, 2)
    with pytest.raises(Exception, match="cpu_decode_threads"):  # pydantic's ValidationError names the field
        cli._engine_config(cli._parser().parse_args(["chat", "--cpu-decode-threads", "0"]))
    c = cli._engine_config(cli._parser().parse_args(["serve", "--cpu-decode-threads", "auto"]))
    assert c.cpu_decode_threads == "auto"


def test_a_thread_count_that_is_neither_a_number_nor_auto_is_refused(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["chat", "--cpu-decode-threads", "fast"])
    err = capsys.readouterr().err
    assert "--cpu-decode-threads" in err and "not a thread count or 'auto': 'fast'" in err


def test_no_flags_keep_the_defaults():
    from kda_sessions.engine.config import EngineConfig

    assert cli._engine_config(cli._parser().parse_args(["chat"])) == EngineConfig()


def test_a_bad_flag_value_names_the_field(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["bench", "--context", "8", "--page-size", "0"]) == 1
    err = capsys.readouterr().err
    assert "ValidationError" in err and "page_size" in err


def test_bench_runs_with_engine_flags(capsys: pytest.CaptureFixture[str]):
    assert cli.main(["bench", "--context", "80", "--page-size", "16", "--max-active-sessions", "4"]) == 0
    assert "resume speedup" in capsys.readouterr().out
