"""Every example runs as is on the built-in model: in process (the script's ``__main__`` run in this process, as
``python examples/X.py`` runs it, without paying a new interpreter's torch import each time), and from a fresh
process against a running server with --url (the same script, the same methods)."""

from __future__ import annotations

import runpy
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from server.server_helpers import ServerThread, start_server

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The examples' model on a disk store, as `kda-sessions serve --model tiny --store disk:...` runs it."""
    srv = start_server(model="tiny", store=f"disk:{tmp_path_factory.mktemp('store')}")
    yield srv
    srv.stop()


def _run(args: list[str], cwd: Path) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()
    return out.stdout


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_in_process(script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]):
    """The script as ``__main__`` with its own argv; it prints, and leaves no thread behind that would keep a
    process from exiting (an engine or a server it did not close)."""
    args = [str(script)]
    if script.name == "resume.py":
        args += ["--store", f"disk:{tmp_path}"]
    monkeypatch.setattr(sys, "argv", args)
    monkeypatch.chdir(tmp_path)
    before = set(threading.enumerate())
    runpy.run_path(str(script), run_name="__main__")
    for t in threading.enumerate():
        if t not in before and not t.daemon:  # (anyio's worker threads end with their event loop)
            t.join(timeout=10)
    assert [t for t in threading.enumerate() if t not in before and not t.daemon] == []
    out = capsys.readouterr().out
    assert out.strip()
    if script.name == "resume.py":
        assert "resumed" in out


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_against_a_server(script: Path, tmp_path: Path, tiny_server: ServerThread):
    before = tiny_server.engine.stats()["completion_tokens"]
    out = _run([str(script), "--url", tiny_server.url], tmp_path)
    if script.name == "resume.py":
        assert "resumed" in out
    assert tiny_server.engine.stats()["completion_tokens"] > before  # the server did the work, not a local engine


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"agent_loop.py", "resume.py", "fork.py", "openai_sdk.py"}
