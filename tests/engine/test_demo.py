"""`kda-sessions demo` on the embedded defaults: the built-in trained `tiny` model and a disk store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kda_sessions import cli, demo
from kda_sessions.demo import run_demo
from kda_sessions.model.loader import BUILTIN_DIR

pytestmark = pytest.mark.skipif(not (BUILTIN_DIR / "tiny.safetensors").exists(), reason="tiny's weights not installed")


def _project(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text('"""A tiny package."""\n\nfrom .core import add\n')
    (root / "pkg" / "core.py").write_text("def add(a, b):\n    return a + b\n\n\nclass Counter:\n    pass\n")
    return root


def test_cli_demo_runs_on_tiny_and_resumes_without_prefill(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run of the demo through the command line (its defaults: the trained tiny, the disk store), checked by
    what it prints and what ``run_demo`` returns."""
    results: list[dict[str, Any]] = []

    async def recorded(*args: Any, **kwargs: Any) -> dict[str, Any]:
        results.append(await run_demo(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(demo, "run_demo", recorded)
    assert cli.main(["demo", "--dir", str(_project(tmp_path / "proj")), "--store", f"disk:{tmp_path / 'store'}"]) == 0
    (out,) = results
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert "model: tiny " in text
    assert text.count("  tool (") == 3  # three tool rounds, each with a real tool result
    assert "  tool (model) " in text  # tiny makes at least one of the calls itself (all three, at this commit)
    assert out["context_tokens"] > 100
    resumed = next(line for line in lines if line.startswith("new engine resumed"))
    # the resumed turn prefilled only its new message; the whole context before it was reused
    prefilled = int(resumed.split("prefilled ")[1].split()[0])
    reused = int(resumed.split("reused ")[1].split()[0])
    # (the last sampled token is fed with the new message, so it may count as prefilled)
    assert reused >= out["context_tokens"] - 1 and prefilled < 40
    forks = [line for line in lines if line.startswith("  fork ")]
    assert len(forks) == 2 and all("reused" in f for f in forks)
    # the recall answer is checked against the line the search showed, and the verdict printed with it
    recall = next(line for line in lines if line.startswith("  recall, "))
    assert out["recall_right"] in (True, False, None)
    if out["recall_right"] is not None:
        assert recall.endswith(": right)" if out["recall_right"] else ": wrong)")
