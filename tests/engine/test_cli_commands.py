"""The command line as a person uses it: engine flags anywhere, store-only commands without a model, help on
every flag, chat's local /commands, tools and resume hint, bench's table, serve's start-up summary."""

from __future__ import annotations

import argparse
import builtins
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import kda_sessions as ks
from kda_sessions import api as engine_module
from kda_sessions import bench_cli, cli


def _all_parsers(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in a.choices.values():
                yield from _all_parsers(child)


@pytest.mark.parametrize("argv", [
    ["sessions", "ls", "--store", "disk:/x"],
    ["sessions", "--store", "disk:/x", "ls"],
    ["--store", "disk:/x", "sessions", "ls"],
    ["chat", "--store", "disk:/x"],
    ["--store", "disk:/x", "chat"],
], ids=["after-action", "after-sessions", "before-command", "after-command", "before-chat"])
def test_store_flag_is_accepted_anywhere(argv):
    args = cli.parse_args(argv)
    assert args.store == "disk:/x" and args.model == "tiny"


def test_every_flag_has_help_and_defaults_are_shown(capsys):
    for p in _all_parsers(cli._parser()):
        for a in p._actions:
            if a.option_strings:
                assert a.help, f"{p.prog} {a.option_strings} has no help"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for shown in ("(default: tiny)", "(default: cpu)", "(default: 127.0.0.1)", "(default: 8000)", "(default: 120.0)"):
        assert shown in out


@pytest.fixture
async def stored(tmp_path: Path) -> tuple[str, list[str]]:
    url = f"disk:{tmp_path / 'store'}"
    async with await ks.Engine.open(model="tiny-random", store=url) as eng:
        ids = []
        for text in ("first", "second", "third"):
            s = await eng.create_session(system="sys")
            await s.send(text, max_tokens=2)
            await s.save()
            ids.append(s.id)
    return url, ids


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a store-only command loaded a model")

    monkeypatch.setattr(engine_module, "load_model", refuse)


async def test_sessions_ls_show_rm_gc_read_the_store_without_a_model(stored, no_model, capsys):
    url, ids = stored
    await anyio_main(["sessions", "ls", "--store", url])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["SESSION", "TOKENS", "CHECKPOINTS", "SAVED", "PARENT"]
    assert all(i in out for i in ids)
    await anyio_main(["sessions", "show", ids[0], "--store", url])
    shown = json.loads(capsys.readouterr().out)
    assert shown["session_id"] == ids[0] and [m["content"] for m in shown["messages"]][:2] == ["sys", "first"]
    await anyio_main(["sessions", "rm", ids[0], "--store", url])
    assert f"removed {ids[0]}" in capsys.readouterr().out
    await anyio_main(["sessions", "gc", "--older-than", "0", "--grace", "0", "--store", url])
    out = capsys.readouterr().out
    assert f"removed {ids[1]}" in out and f"removed {ids[2]}" in out and "unreferenced blobs" in out
    await anyio_main(["sessions", "ls", "--store", url])
    assert "no sessions" in capsys.readouterr().out


async def test_rm_needs_ids_or_all(stored, no_model, capsys):
    url, ids = stored
    assert await anyio_main(["sessions", "rm", "--store", url], expect=1) == 1
    assert "--all" in capsys.readouterr().err
    await anyio_main(["sessions", "rm", "--all", "--store", url])
    out = capsys.readouterr().out
    assert all(f"removed {i}" in out for i in ids)


async def anyio_main(argv: list[str], expect: int = 0) -> int:
    """cli.main runs its own event loop: run it in a worker thread of this test's loop."""
    import anyio

    rc = await anyio.to_thread.run_sync(cli.main, argv)
    assert rc == expect
    return rc


def _typed(monkeypatch, lines: list[str]) -> None:
    feed = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


def test_chat_keeps_commands_local_and_the_resume_hint_keeps_the_store(tmp_path, monkeypatch, capsys):
    url = f"disk:{tmp_path / 'store'}"
    _typed(monkeypatch, ["/help", "/bogus", "hello", "/save"])
    assert cli.main(["chat", "--model", "tiny-random", "--store", url, "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "commands: /help" in err and "unknown command '/bogus'" in err
    hint = err.split("resume with: ")[1].strip()
    assert f"--store {url}" in hint and "--model tiny-random" in hint
    sid = hint.split("--session ")[1].split()[0]
    cli.main(["sessions", "show", sid, "--store", url])
    messages = json.loads(capsys.readouterr().out)["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello"]  # no /command reached the model


def test_chat_runs_the_models_tool_calls_in_the_tools_dir(tmp_path, monkeypatch, capsys):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "alpha.py").write_text("def main():\n    return 1\n")
    (proj / "beta.py").write_text("x = 2\n")
    _typed(monkeypatch, ["What is the first entry of the project root?"])
    assert cli.main(["chat", "--store", f"disk:{tmp_path / 'store'}", "--tools-dir", str(proj),
                     "--max-tokens", "160"]) == 0
    captured = capsys.readouterr()
    assert '[tool call] list_dir({"path": "."})' in captured.out  # the built-in tiny makes the call ...
    assert "[tool output] alpha.py (+1 lines)" in captured.err  # ... and the chat runs it in the folder


def test_run_tool_reports_errors_as_output(tmp_path):
    from kda_sessions.tokenizer import FunctionCall, ToolCall
    from kda_sessions.tools import Tools

    tools = Tools(tmp_path)
    (tmp_path / "a.py").write_text("print(1)\n")
    call = ToolCall(id="functions.read_file:0", function=FunctionCall(name="read_file", arguments='{"path": "a.py"}'))
    assert cli.run_tool(tools, call) == "     1\tprint(1)"
    outside = call.model_copy(update={"function": FunctionCall(name="read_file", arguments='{"path": "../x"}')})
    assert cli.run_tool(tools, outside).startswith("error: ")
    bad_json = call.model_copy(update={"function": FunctionCall(name="grep", arguments="{not json")})
    assert cli.run_tool(tools, bad_json).startswith("error: ")


def test_bench_prints_a_table(capsys, monkeypatch):
    # a small machine floor (its figures are not checked here): 64-cubed matmuls and 1 MiB copies
    monkeypatch.setattr(bench_cli, "MATMUL_N", 64)
    monkeypatch.setattr(bench_cli, "COPY_BYTES", 1 << 20)
    assert cli.main(["bench", "--model", "tiny-random", "--context", "64", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kda-sessions bench: model tiny-random, 64 context tokens, device cpu")
    rows = {line.split("  ")[0].strip(): line for line in out.split("\n\n")[1].splitlines()[2:]}
    assert set(rows) == {"prefill", "decode (batch of 1)", "first token, resumed from the store",
                         "first token, context prefilled again", "resume speedup", "matmul (float32, 64 cubed)",
                         "memory copy (1 MiB, read + write)"}
    assert rows["prefill"].endswith("%") and "tokens/s" in rows["prefill"] and rows["resume speedup"].endswith("x")
    assert cli.main(["bench", "--model", "tiny-random", "--context", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 64


def test_serve_summary_names_model_store_device_and_pools():
    args = cli.parse_args(["serve", "--store", "memory:", "--num-pages", "128", "--model-alias", "kimi",
                           "--chat-session-retention", "0"])
    settings = cli._serve_settings(args)
    assert settings.served_model_aliases == ["kimi"] and settings.chat_session_retention_s == 0
    text = cli.startup_summary(settings)
    for part in ("model tiny", "on cpu", "store         memory:", "http://127.0.0.1:8000/v1", "128 KV pages",
                 "64 session slots", "kept until deleted", "sampling      greedy"):  # tiny's generation config
        assert part in text, part
