"""Every example runs as is, in a fresh process on the built-in model: in process, and against a running
server with --url (the same script, the same methods)."""

from __future__ import annotations

import subprocess
import sys
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
def test_example_runs_in_process(script: Path, tmp_path: Path):
    args = [str(script)]
    if script.name == "resume.py":
        args += ["--store", f"disk:{tmp_path}"]
    _run(args, tmp_path)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_against_a_server(script: Path, tmp_path: Path, tiny_server: ServerThread):
    before = tiny_server.engine.stats()["completion_tokens"]
    out = _run([str(script), "--url", tiny_server.url], tmp_path)
    if script.name == "resume.py":
        assert "resumed" in out
    assert tiny_server.engine.stats()["completion_tokens"] > before  # the server did the work, not a local engine


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"agent_loop.py", "resume.py", "fork.py", "openai_sdk.py"}
