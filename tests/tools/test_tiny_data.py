"""tools/tiny_data.py (training rows and held-out tasks for `tiny`) and tools/eval_tiny.py on tiny-random."""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tools` is not installed

from kda_sessions import Engine
from kda_sessions.tokenizer import encode_chat, parse_assistant_output, validate_arguments
from kda_sessions.tools import TOOL_SCHEMAS
from tools import eval_tiny
from tools.tiny_data import (
    GEN_IDS,
    KINDS,
    SYSTEM,
    TOK,
    RenamedCorpus,
    corpus,
    eval_tasks,
    fact_in,
    header_ids,
    make_row,
    render,
    split_of,
)

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
END = TOK.special_ids["<|im_end|>"]


def _assistant_spans(ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every assistant turn's own tokens: after the generation prompt, through <|im_end|>."""
    spans, i, g = [], 0, len(GEN_IDS)
    while i < len(ids):
        if ids[i : i + g] == GEN_IDS:
            j = i + g
            while j < len(ids) and ids[j] != END:
                j += 1
            spans.append((i + g, min(j + 1, len(ids))))
            i = j
        i += 1
    return spans


def _rows(seed: int, n: int, max_len: int, split: str = "train") -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [make_row(rng, split, max_len) for _ in range(n)]


def _is_plain(ids: list[int]) -> bool:
    return ids[: len(header_ids())] != list(header_ids())


def test_rows_are_deterministic_in_the_seed():
    assert _rows(1, 6, 4096) == _rows(1, 6, 4096)
    assert _rows(1, 6, 4096) != _rows(2, 6, 4096)
    assert [asdict(t) for t in eval_tasks(0, 8)] == [asdict(t) for t in eval_tasks(0, 8)]


def test_split_is_stable_and_disjoint():
    c = corpus()
    assert not set(c.files["train"]) & set(c.files["heldout"])
    assert not set(c.dirs["train"]) & set(c.dirs["heldout"])
    assert c.files["heldout"] and c.dirs["heldout"]
    assert 0.05 < len(c.files["heldout"]) / len(c.texts) < 0.15
    # sha256 of the relative path: the same on every machine
    assert [split_of(p) for p in ("json/decoder.py", "os.py", "asyncio/tasks.py")] == [
        split_of(p) for p in ("json/decoder.py", "os.py", "asyncio/tasks.py")
    ]
    assert split_of("zoneinfo/") == "heldout" and split_of("json/") == "train"
    for t in eval_tasks(3, 24):
        paths = [t.arguments["path"]] if t.tool else []
        paths += [json.loads(call["function"]["arguments"])["path"]
                  for m in t.messages for call in m.get("tool_calls", [])]
        for p in paths:
            assert p in c.files["heldout"] or p in c.dirs["heldout"], p


def test_training_rows_touch_train_files_only():
    c = corpus()
    renamed = 0
    for ids, _ in _rows(4, 20, 4096):
        if _is_plain(ids):
            continue
        for start, end in _assistant_spans(ids):
            for call in parse_assistant_output(ids[start:end], TOK).tool_calls:
                p = json.loads(call.function.arguments)["path"]
                assert p not in c.files["heldout"] and p not in c.dirs["heldout"], p
                renamed += not (p in c.files["train"] or p in c.dirs["train"])
    assert renamed > 0  # RenamedCorpus rows are in the mix


def test_renamed_corpus_serves_real_train_files_under_new_names():
    base = corpus()
    rc = RenamedCorpus(random.Random(3), base)
    assert rc.files["train"] and rc.dirs["train"] and not rc.files["heldout"]
    for alias in rc.files["train"]:
        real = rc.real[alias]
        assert real in base.files["train"] and alias != real
        assert rc.call("read_file", path=alias) == base.call("read_file", path=real)
    for alias in rc.dirs["train"]:
        real = rc.real[alias]
        assert real in base.dirs["train"]
        assert rc.entries(alias) == base.entries(real)
    # a second project in the same process starts from an empty folder
    rc2 = RenamedCorpus(random.Random(4), base)
    assert set(rc2.files["train"]).isdisjoint(rc.files["train"]) or rc2.files["train"] != rc.files["train"]
    assert not (rc2.root / rc.files["train"][0]).exists() or rc.files["train"][0] in rc2.files["train"]


@pytest.mark.parametrize("max_len", [2048, 4096, 8192], ids=lambda n: f"len{n}")
def test_masks_cover_exactly_the_assistant_tokens(max_len: int):
    for ids, mask in _rows(max_len, 12, max_len):
        assert len(ids) == len(mask) <= max_len
        if _is_plain(ids):
            assert set(mask) == {1}
            continue
        expected = [0] * len(ids)
        for start, end in _assistant_spans(ids):
            expected[start:end] = [1] * (end - start)
        assert mask == expected


def test_rows_are_full_and_about_half_recall():
    rows = _rows(7, 120, 8192)
    conv = [ids for ids, _ in rows if not _is_plain(ids)]
    assert sum(len(ids) for ids in conv) / (len(conv) * 8192) > 0.9
    asked = [len(re.findall("Earlier you|did I give you|Remind me", TOK.decode(ids))) for ids in conv]
    recall = [n for n in asked if n]
    assert 0.35 < len(recall) / len(rows) < 0.75
    assert sum(recall) / len(recall) > 1.3  # 1-3 questions per recall row


def test_every_tool_call_validates_against_its_schema():
    calls = 0
    for ids, _ in _rows(9, 20, 8192):
        if _is_plain(ids):
            continue
        for start, end in _assistant_spans(ids):
            parsed = parse_assistant_output(ids[start:end], TOK)
            assert not parsed.errors
            for call in parsed.tool_calls:
                assert not validate_arguments(call.function.arguments, SCHEMAS[call.function.name])
                calls += 1
    assert calls > 50


def test_facts_come_from_the_tool_output():
    for t in eval_tasks(5, 24):
        assert t.kind in KINDS and t.fact
        if t.kind != "recall":
            assert t.tool == t.kind and all(v in t.messages[-1]["content"] for v in t.arguments.values())
        else:
            assert t.tool is None and t.distance >= 2000
    assert fact_in("it is on line 12.", "line 12") and not fact_in("it is on line 123.", "line 12")


async def test_rendered_ids_equal_the_engines():
    task = next(t for t in eval_tasks(11, 8) if len(t.messages) > 3)  # a history with tool calls and results
    history, question = task.messages[:-1], task.messages[-1]
    ids, _ = render(history[1:])
    expected = list(header_ids()) + ids + render([question])[0] + GEN_IDS
    assert expected == encode_chat(TOK, task.messages, TOOL_SCHEMAS, add_generation_prompt=True)
    async with await Engine.open(model="tiny-random", store="memory:") as engine:
        s = await engine.create_session(system=SYSTEM, tools=TOOL_SCHEMAS)
        assert s.state.tokens == list(header_ids())  # no BOS
        s = await engine.create_session_from_messages(history, tools=TOOL_SCHEMAS)
        await s.send(question["content"], max_tokens=1)
        assert s.state.tokens[: len(expected)] == expected
        assert len(s.state.tokens) == len(expected) + 1


def test_eval_runs_two_tasks_on_tiny_random(capsys: pytest.CaptureFixture[str]):
    result = eval_tiny.main(["--model", "tiny-random", "--n", "2", "--kind", "grep", "--max-tokens", "4"])
    printed = json.loads(capsys.readouterr().out)
    assert result is not None and printed["n"] == 2
    assert set(printed["scores"]["overall"]) >= {"parse", "argument", "fact", "recall", "call_rate"}
    assert printed["scores"]["grep"]["n"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["--kind", "recall"], ["--kind", "list_dir", "--max-tokens", "60", "--tool-choice", "required"]],
    ids=["recall-saved-before-question", "tool-task-saved-after-call"],
)
def test_eval_resume_check_matches_in_a_new_process(args: list[str], capsys: pytest.CaptureFixture[str]):
    eval_tiny.main(["--model", "tiny-random", "--n", "2", "--max-tokens", "8", "--resume-check", *args])
    printed = json.loads(capsys.readouterr().out)
    assert printed["resume_check"] == {"checked": 2, "match": 2, "not_saved": 0}
