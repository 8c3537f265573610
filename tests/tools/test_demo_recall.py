"""tools/demo_recall.py: the demo's recall question after each order of its turns (docs/tiny.md, "Late recall facts")."""

from __future__ import annotations

import asyncio

from tools import demo_recall


def test_every_variant_ends_in_the_recall_question_with_the_greps_line(tmp_path):
    """On tiny-random the calls are scripted (it makes none): each variant runs and is judged against the line the
    real grep shows; the demo's order is the first variant."""
    out = asyncio.run(demo_recall.run("tiny-random", max_tokens=4))
    assert out["line"].isdigit()
    assert list(out["variants"]) == list(demo_recall.VARIANTS) and demo_recall.VARIANTS["demo"][-1] == demo_recall.TARGET
    for v in out["variants"].values():
        assert isinstance(v["reply"], str) and v["right"] in (True, False)
        assert v["right"] == (f"line {out['line']}" in v["reply"])
