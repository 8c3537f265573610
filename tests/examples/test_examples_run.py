"""Every example runs as is (a fresh process, the built-in model)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, tmp_path: Path):
    args = [sys.executable, str(script)]
    if script.name == "resume.py":
        args += ["--store", f"disk:{tmp_path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"agent_loop.py", "resume.py", "fork.py", "openai_sdk.py"}
