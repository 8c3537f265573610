"""tools/tiny_data.py (training rows and held-out tasks for `tiny`) and tools/eval_tiny.py on tiny-random."""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from kda_sessions import Engine
from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel
from kda_sessions.tokenizer import encode_chat, parse_assistant_output, validate_arguments
from kda_sessions.tools import MAX_OUTPUT, TOOL_SCHEMAS, ToolError, Tools
from tools import eval_tiny
from tools.tiny_data import (
    FACT,
    FIRST_DEF_PATTERN,
    GEN_IDS,
    KINDS,
    LINE_READ_LIMITS,
    SYSTEM,
    TOK,
    RenamedCorpus,
    _episode,
    _grep_episode,
    _list_episode,
    _name_stems,
    _read_episode,
    corpus,
    curriculum_distances,
    draw_distance,
    eval_tasks,
    fact_in,
    header_ids,
    make_row,
    numbered_lines,
    render,
    split_of,
)

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
END = TOK.special_ids["<|im_end|>"]
USER = TOK.special_ids["<|im_user|>"]
RECALL_RE = re.compile("Earlier you|did I give you|Remind me")


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


def _rows(seed: int, n: int, max_len: int, split: str = "train", **kw) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [make_row(rng, split, max_len, **kw) for _ in range(n)]


def _recalls(ids: list[int], mask: list[int]) -> list[tuple[int, str, list[int], str]]:
    """(question start, question, value ids, answer) of every recall question of a row: a user turn asking
    it, then the assistant's answer whose FACT-marked tokens are the value."""
    out = []
    for start, end in _assistant_spans(ids):
        q_start = max(i for i in range(start) if ids[i] == USER)
        question = TOK.decode(ids[q_start:start])
        if RECALL_RE.search(question):
            value = [t for t, m in zip(ids[start:end], mask[start:end]) if m == FACT]
            out.append((q_start, question, value, TOK.decode(ids[start:end])))
    return out


def _find_all(ids: list[int], part: list[int], stop: int) -> list[int]:
    """Start of every occurrence of ``part`` in ids[:stop]."""
    n = len(part)
    return [i for i in range(stop - n + 1) if ids[i] == part[0] and ids[i : i + n] == part]


def _is_plain(ids: list[int]) -> bool:
    return ids[: len(header_ids())] != list(header_ids())


def test_rows_are_deterministic_in_the_seed():
    assert _rows(1, 6, 4096) == _rows(1, 6, 4096)
    assert _rows(1, 6, 4096) != _rows(2, 6, 4096)
    assert [asdict(t) for t in eval_tasks(0, 8)] == [asdict(t) for t in eval_tasks(0, 8)]


def test_tasks_digest_tells_task_sets_apart():
    tasks = eval_tasks(0, 8)
    assert eval_tiny.tasks_digest(tasks) == eval_tiny.tasks_digest(eval_tasks(0, 8))
    assert eval_tiny.tasks_digest(tasks) != eval_tiny.tasks_digest(eval_tasks(1, 8))
    changed = [*tasks[:-1], replace(tasks[-1], fact=tasks[-1].fact + "x")]
    assert eval_tiny.tasks_digest(changed) != eval_tiny.tasks_digest(tasks)


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


def test_near_miss_names_run_on_from_a_stdlib_name_and_off_changes_nothing():
    base = corpus()
    stems = set(_name_stems())
    plain = RenamedCorpus(random.Random(5), base)
    assert RenamedCorpus(random.Random(5), base, near_miss=0.0).real == plain.real  # 0 draws nothing extra
    rc = RenamedCorpus(random.Random(5), base, near_miss=1.0)
    for alias in [*rc.dirs["train"], *rc.files["train"]]:
        kept = rc.real[alias].rsplit("/", 1)[-1]  # a file may keep its real base name
        for part in alias.split("/"):
            if part != kept:  # a stem, then at least one more letter, no separator
                assert any(part.removesuffix(".py").startswith(s) and len(part.removesuffix(".py")) > len(s)
                           for s in stems), part
    assert rc.call("read_file", path=rc.files["train"][0]) == base.call("read_file", path=rc.real[rc.files["train"][0]])
    with pytest.raises(ValueError, match="near_miss"):
        make_row(random.Random(1), "train", 2048, near_miss=1.5)


def test_near_miss_defs_rename_definitions_in_the_text_the_tools_and_the_questions():
    base = corpus()
    assert RenamedCorpus(random.Random(6), base, near_miss_defs=0.0).real == RenamedCorpus(random.Random(6), base).real
    rc = RenamedCorpus(random.Random(6), base, near_miss_defs=1.0)
    renamed = 0
    for alias in rc.files["train"][:12]:
        real = rc.real[alias]
        old = [n for _, n in base.defs(real)]
        new = [n for _, n in rc.defs(alias)]
        assert len(new) == len(old)
        assert rc.read_len(alias) == len(rc.call("read_file", path=alias).encode("utf-8"))
        text = rc.texts[alias]  # what was written for the tools (read_file shows only the start of a long file)
        for a, b in zip(old, new):
            if a != b:  # kept a prefix of a, ran on into something else; the file and the tools say b, never a
                renamed += 1
                assert b.isidentifier() and len(b) > 2 and a[:2] == b[:2]
                assert re.search(rf"\b{re.escape(b)}\b", text) and not re.search(rf"\b{re.escape(a)}\b", text)
                assert b in rc.call("grep", pattern=rf"\b{b}\b", path=alias)
            else:
                assert a.startswith("__") or len(a) < 4
    assert renamed > 10
    with pytest.raises(ValueError, match="near_miss_defs"):
        make_row(random.Random(1), "train", 2048, near_miss_defs=-0.1)


def test_near_miss_entries_rename_the_listed_entries_the_tools_serve():
    """At 0 nothing is drawn (the same projects); at 1 every listed directory holds new, distinct names with the
    real extensions and slashes, and list_dir serves exactly them; rows with the option build."""
    base = corpus()
    assert RenamedCorpus(random.Random(6), base, near_miss_entries=0.0).real == RenamedCorpus(random.Random(6), base).real
    rc = RenamedCorpus(random.Random(6), base, near_miss_entries=1.0)
    changed = 0
    for alias in rc.dirs["train"]:
        real = base.entries(rc.real[alias])
        listed = rc.entries(alias)
        assert len(listed) == len(real) == len(set(listed)) and listed == sorted(listed)
        assert sorted(e.endswith("/") for e in listed) == sorted(e.endswith("/") for e in real)
        assert sum(e.endswith(".py") for e in listed) == sum(e.endswith(".py") for e in real)
        changed += len(set(listed) - set(real))
    assert changed > 20
    ids, mask = make_row(random.Random(3), "train", 4096, near_miss_entries=1.0)
    assert 0 < len(ids) <= 4096 and len(mask) == len(ids)
    with pytest.raises(ValueError, match="near_miss_entries"):
        make_row(random.Random(1), "train", 2048, near_miss_entries=2.0)


def _line_recalls(line_recall: float, rows: int) -> int:
    n = 0
    for i in range(rows):
        ids, _ = make_row(random.Random(4 * 10**9 + i), "train", 8192, (64, 2000), 0.2, line_recall=line_recall)
        text = bytes(t for t in ids if t < 256).decode("utf-8", "replace")
        n += len(re.findall(r"Earlier you read line \d+ of [^\n]*What was on it\?", text))
    return n


def test_line_recall_asks_for_lines_read_earlier():
    """At 0 the rows almost never ask for a whole line read long before (about 1 in 150 rows); with the option
    they do, on files of any length, and the recall answer repeats the line the read showed first."""
    assert _line_recalls(0.5, 30) >= 5 * max(1, _line_recalls(0.0, 30))
    c = corpus()
    ep = _episode(random.Random(2), c, "train", 400, set(), "read_line")
    assert ep is not None and ep.kind == "read_file" and ep.variant == "line" and len(ep.ids) <= 400
    (q, a, fact), = ep.recall
    assert q.startswith("Earlier you read line") and a.endswith(fact)
    assert c.read_len(ep.arguments["path"]) + 300 > 400  # a file a random read_file task could not take here
    with pytest.raises(ValueError, match="line_recall"):
        make_row(random.Random(1), "train", 2048, line_recall=-0.1)


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
        assert [min(m, 1) for m in mask] == expected and set(mask) <= {0, 1, FACT}


def test_rows_are_full_and_about_half_recall():
    rows = _rows(7, 60, 8192)
    conv = [ids for ids, _ in rows if not _is_plain(ids)]
    assert sum(len(ids) for ids in conv) / (len(conv) * 8192) > 0.9
    asked = [len(re.findall("Earlier you|did I give you|Remind me", TOK.decode(ids))) for ids in conv]
    recall = [n for n in asked if n]
    assert 0.35 < len(recall) / len(rows) < 0.75
    assert sum(recall) / len(recall) > 1.3  # 1-3 questions per recall row


def test_read_file_numbers_lines_like_cat_n_and_cuts_at_a_line_boundary(tmp_path: Path):
    (tmp_path / "a.py").write_text("x = 1\n\ndef f():\n    return 2\n")
    tools = Tools(tmp_path)
    assert tools.read_file("a.py") == "     1\tx = 1\n     2\t\n     3\tdef f():\n     4\t    return 2"
    assert numbered_lines(tools.read_file("a.py"))[2] == (3, "def f():")
    (tmp_path / "long.py").write_text("".join(f"line_{i} = {i * 7}\n" for i in range(1, 3001)))
    out = tools.read_file("long.py")
    rows = out.split("\n")
    assert len(out) <= MAX_OUTPUT < len(out) + 1 + len(f"{len(rows) + 1:>6}\tline_{len(rows) + 1} = {(len(rows) + 1) * 7}")
    assert rows == [f"{i:>6}\tline_{i} = {i * 7}" for i in range(1, len(rows) + 1)]  # whole lines only
    # grep counts lines as read_file does: at "\n" only (a form feed does not start a line)
    (tmp_path / "ff.py").write_text("a = 1\n\x0cb = 2\nc = 3\n")
    assert tools.grep("c = ", "ff.py") == "ff.py:3: c = 3"
    assert numbered_lines(tools.read_file("ff.py"))[2] == (3, "c = 3")


def test_read_file_reads_a_line_range_and_rejects_bad_ranges(tmp_path: Path):
    (tmp_path / "a.py").write_text("".join(f"v{i} = {i}\n" for i in range(1, 21)))
    tools = Tools(tmp_path)
    assert tools.read_file("a.py", start=7, limit=2) == "     7\tv7 = 7\n     8\tv8 = 8"
    assert tools.call("read_file", '{"path": "a.py", "start": 19}') == "    19\tv19 = 19\n    20\tv20 = 20"
    assert tools.call("read_file", {"path": "a.py", "limit": 1}) == "     1\tv1 = 1"
    assert tools.read_file("a.py", start=20, limit=50) == "    20\tv20 = 20"  # a limit past the end stops there
    for args, problem in [({"start": 0}, "start must be an integer >= 1"), ({"limit": -1}, "limit must be"),
                          ({"start": True}, "start must be"), ({"start": "3"}, "start must be"),
                          ({"start": 21}, "has 20 lines; start 21 is past its end")]:
        with pytest.raises(ToolError, match=problem):
            tools.call("read_file", {"path": "a.py", **args})


def test_line_tasks_read_from_the_asked_line_and_judge_the_path_only():
    c = corpus()
    rng = random.Random(4)
    lines = 0
    for rel in c.files["train"][:60]:
        ep = _read_episode(rng, c, rel)
        if ep is None or ep.variant != "line":
            continue
        lines += 1
        n = int(re.search(r"line (\d+)", ep.messages[0]["content"]).group(1))
        args = json.loads(ep.messages[1]["tool_calls"][0]["function"]["arguments"])
        assert args["path"] == rel and args["start"] == n and args["limit"] in LINE_READ_LIMITS
        shown = numbered_lines(ep.messages[2]["content"])
        assert shown[0] == (n, c.texts[rel].split("\n")[n - 1]) and len(shown) <= args["limit"]
        assert shown[0][1].strip() == ep.fact and all(ep.fact in a for _, a, _ in ep.recall)
    assert lines >= 10
    tasks = [t for t in eval_tasks(2, 24, "read_file") if t.variant == "line"]
    assert tasks and all(set(t.arguments) == {"path"} for t in tasks)


def test_read_file_facts_quote_the_numbered_line():
    c = corpus()
    seen = set()
    for t in eval_tasks(2, 60, "read_file"):
        out = c.call("read_file", path=t.arguments["path"])
        lines = dict(numbered_lines(out))
        if t.variant == "line":
            n = int(re.search(r"line (\d+)", t.messages[-1]["content"]).group(1))
            assert lines[n].strip() == t.fact
        else:  # the first top-level definition, found by grep for definitions in that file
            assert t.tool == "grep" and set(t.arguments) == {"path"}
            first = c.call("grep", pattern=FIRST_DEF_PATTERN, path=t.arguments["path"]).split("\n")[0]
            assert re.search(rf": (async\s+)?(def|class)\s+{t.fact}\b", first)
            assert next(text for _, text in sorted(lines.items()) if re.match(r"(async\s+)?(def|class)\s", text))
        seen.add(t.variant)
    assert seen == {"line", "first_def"}


def test_curriculum_schedule():
    assert curriculum_distances(0, 64, 2000, 1000) == (64, 64)
    assert curriculum_distances(500, 64, 2000, 1000) == (358, 358)  # geometric: 64 * (2000 / 64) ** 0.5
    assert curriculum_distances(999, 64, 2000, 1000) == (1993, 1993)
    assert curriculum_distances(1000, 64, 2000, 1000) == curriculum_distances(5000, 64, 2000, 1000) == (64, 2000)
    rng = random.Random(0)
    draws = [draw_distance(rng, (64, 2000)) for _ in range(2000)]
    assert 0.45 < sum(d >= 2000 for d in draws) / len(draws) < 0.55 and min(draws) >= 64
    short = [d for d in draws if d < 2000]
    assert 0.4 < sum(d < 358 for d in short) / len(short) < 0.6  # log-uniform: half below the geometric mean
    assert {draw_distance(rng, (500, 500)) for _ in range(20)} == {500}
    with pytest.raises(ValueError, match="distance"):
        make_row(random.Random(0), "train", 4096, (0, 100))


@pytest.mark.parametrize("distance", [64, 500, 2000], ids=lambda d: f"d{d}")
def test_recall_questions_come_at_least_distance_after_their_fact(distance: int):
    asked = checked = 0
    for ids, mask in _rows(distance, 24, 4096, distance=(distance, distance), drill=0.3):
        for q_start, question, value, _ in _recalls(ids, mask):
            asked += 1
            hits = _find_all(ids, value, q_start)
            assert hits, question  # the value was stated before it is asked for
            if len(hits) == 1:  # an unambiguous value (random ids, line numbers): its one earlier place
                assert q_start - (hits[0] + len(value)) >= distance, (question, q_start - hits[0])
                checked += 1
    assert asked > 20 and checked > 0.6 * asked


def test_drill_rows_ask_many_questions_about_values_stated_only_once():
    rows = [r for r in _rows(21, 16, 4096, distance=(64, 2000), drill=0.9) if not _is_plain(r[0])]
    per_row = [_recalls(ids, mask) for ids, mask in rows]
    assert sum(len(r) for r in per_row) / len(rows) >= 8
    notes = 0
    for (ids, _), recalls in zip(rows, per_row):
        for q_start, question, value, answer in recalls:
            if "did I give you" in question or "Remind me" in question:  # a note: its value is random
                notes += 1
                hits = _find_all(ids, value, len(ids))
                assert len(hits) == 2 and hits[1] > q_start, answer  # in the note, then in this answer only
                note = TOK.decode(ids[max(i for i in range(hits[0]) if ids[i] == USER) : hits[0]])
                assert re.search(r"(remember|Remember|Note that|FYI).* the [\w' -]+ is $", note), note
    assert notes > 5 * len(rows)


def test_fact_mask_marks_exactly_the_value_in_each_answer():
    for ids, mask in _rows(31, 16, 4096, distance=(64, 2000), drill=0.3):
        if _is_plain(ids):
            continue
        for start, end in _assistant_spans(ids):
            text = TOK.decode(ids[start:end])
            marked = [i for i in range(start, end) if mask[i] == FACT]
            if "<|tool_call_begin|>" in text or text in ("Noted.<|im_end|>", "Got it.<|im_end|>", "I will remember that.<|im_end|>"):
                assert not marked, text
                continue
            assert marked == list(range(marked[0], marked[-1] + 1)), text  # one run
            value = TOK.decode(ids[marked[0] : marked[-1] + 1])
            m = (re.fullmatch(r"The [\w' -]+ is (.+)\.<\|im_end\|>", text)
                 or re.fullmatch(r"`[^`]+` is on (line \d+) of \S+\.<\|im_end\|>", text)
                 or re.fullmatch(r"Line \d+ of \S+ (?:is|was): (.+)<\|im_end\|>", text)
                 or re.fullmatch(r"The first (?:function|class) defined in \S+ is `(\w+)`\.<\|im_end\|>", text)
                 or re.fullmatch(r"The first entry of .+ is (.+)\.<\|im_end\|>", text)
                 or re.fullmatch(r"(Yes|No), .+<\|im_end\|>", text)
                 or re.fullmatch(r".+ has (\d+ entries)\.<\|im_end\|>", text))
            assert m, text
            assert value == m.group(1).strip(), text


def test_batches_weigh_fact_tokens_and_losses_report_them_apart():
    import torch

    from tools import train_tiny

    recall = train_tiny.RecallData((64, 2000, 10), 0.3)
    assert recall.distance(1) == curriculum_distances(1, 64, 2000, 10) and recall.distance(10) == (64, 2000)
    ids, w, kinds = next(train_tiny.batches(1, "train", 4, 4096, 0, 267, prefetch=1, recall=recall, fact_weight=3.0))
    assert ids.shape == w.shape == kinds.shape == (4, 4096)
    assert (kinds == FACT).any()
    assert torch.equal(w[kinds == FACT], torch.full_like(w[kinds == FACT], 3.0))
    assert torch.equal(w[kinds == 1], torch.ones_like(w[kinds == 1]))
    logits = torch.randn(4, 4096, 272)
    loss, mine, fact = train_tiny.masked_losses(logits, ids, w, kinds)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 272), ids[:, 1:].reshape(-1), reduction="none")
    k = kinds[:, 1:].reshape(-1)
    assert torch.allclose(mine, ce[k > 0].mean()) and torch.allclose(fact, ce[k == FACT].mean())
    assert torch.allclose(loss, (ce * w[:, 1:].reshape(-1)).sum() / w[:, 1:].sum())


def test_batches_are_the_same_rows_for_any_number_of_workers():
    """Worker processes interleave the rows (worker w makes rows w, w + n, ...): two batches of 3 rows from 2
    workers equal the rows made in this process, in order; closing the generator stops the workers."""
    import torch

    from tools import train_tiny

    recall = train_tiny.RecallData((64, 2000, 10), 0.3)
    inline = train_tiny.batches(2, "train", 3, 1024, 0, 267, prefetch=1, recall=recall, near_miss=0.3)
    pooled = train_tiny.batches(2, "train", 3, 1024, 2, 267, prefetch=1, recall=recall, near_miss=0.3)
    for _ in range(2):
        for a, b in zip(next(inline), next(pooled)):
            assert torch.equal(a, b)
    procs = pooled.gi_frame.f_locals["procs"]
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    pooled.close()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.slow
def test_quick_training_runs_with_the_recall_flags(tmp_path: Path):
    from tools import train_tiny

    train_tiny.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--recall-curriculum", "64:2000:2",
                     "--drill-fraction", "0.15", "--fact-weight", "3"])
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["steps_done"] == 3 and log["steps"][-1]["recall_distance"] == [64, 2000]
    assert "fact_loss" in log["steps"][-1] and "fact_loss" in log["heldout"]


def test_training_refuses_a_config_too_big_to_ship(tmp_path: Path):
    from tools import train_tiny

    big = tmp_path / "big.json"  # hidden 640, FFN 2,560: 45.5 M parameters, 91.0 MB as bf16
    big.write_text(json.dumps({**json.loads(train_tiny.CONFIG.read_text()), "hidden_size": 640, "intermediate_size": 2560}))
    with pytest.raises(SystemExit, match=r"91\.0 MB as bf16, over the 60 MB"):
        train_tiny.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "big"), "--config", str(big)])


def test_a_bad_row_share_stops_training_before_anything_is_built(tmp_path: Path):
    from tools import train_tiny

    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"--general-focus \+ --general-listing must be at most 1, got 0.7 \+ 0.5"):
        train_tiny.main(["--quick", "--device", "cpu", "--out", str(out), "--general-focus", "0.7",
                         "--general-listing", "0.5"])
    assert not out.exists(), "the flags are checked before the output folder and the model are made"


@pytest.mark.slow
def test_training_takes_another_config(tmp_path: Path):
    from tools import train_tiny

    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**json.loads(train_tiny.CONFIG.read_text()), "intermediate_size": 512}))
    train_tiny.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "run"), "--config", str(small)])
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    saved = json.loads((tmp_path / "run" / "weights" / "config.json").read_text())
    assert log["steps_done"] == 3 and saved["intermediate_size"] == 512


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


def test_count_answers_number_each_listed_entry_before_the_total():
    c = corpus()
    rng = random.Random(4)
    seen = 0
    for d in c.dirs["train"]:
        ep = _list_episode(rng, c, d, "train")
        if ep is None or ep.variant != "count":
            continue
        entries = ep.messages[2]["content"].split("\n")
        answer = ep.messages[3]["content"]
        numbered = ", ".join(f"{i} {e}" for i, e in enumerate(entries, 1))
        assert answer.endswith(f"{numbered}. {answer.split(': ', 1)[0][len('Counting '):]} has {len(entries)} entries.")
        assert ep.fact == f"{len(entries)} entries" and fact_in(answer, ep.fact)
        seen += 1
        if seen == 5:
            break
    assert seen == 5


def test_list_and_grep_episodes_take_the_asked_variant_and_kind():
    c = corpus()
    rng = random.Random(9)
    small = [d for d in c.dirs["train"] if len(c.entries(d)) <= 10][:6]
    big = next(d for d in c.dirs["train"] if len(c.entries(d)) > 10)
    for d in small:
        for v in ("count", "first", "has"):
            ep = _list_episode(rng, c, d, "train", v)
            assert ep is not None and ep.variant == v and ep.arguments == {"path": d}
    assert _list_episode(rng, c, big, "train", "count") is None  # a count is asked of 10 entries or fewer
    for what in ("class", "def"):
        got = [ep for rel in c.files["train"][:80] if (ep := _grep_episode(rng, c, rel, what)) is not None]
        assert len(got) > 10 and all(ep.arguments["pattern"].startswith(what + " ") for ep in got)


def test_renamed_projects_name_mix_picks_single_words_or_joined_ones():
    words = tuple(f"word{chr(97 + i)}{chr(97 + j)}" for i in range(26) for j in range(26))  # enough for 72 names

    def parts(mix: tuple[float, float]) -> list[str]:
        c = RenamedCorpus(random.Random(3), corpus(), n_files=12, n_dirs=6, words=words, name_mix=mix)
        return [x for d in c.holders() + c.dirs["train"] for x in d.split("/")]

    assert all(x in words for x in parts((1.0, 1.0)))
    assert all("_" in x for x in parts((0.0, 1.0)))
    assert not any(x in words or "_" in x for x in parts((0.0, 0.0)))


def test_facts_come_from_the_tool_output():
    for t in eval_tasks(5, 24):
        assert t.kind in KINDS and t.fact
        if t.kind != "recall":
            assert t.tool == ("grep" if t.variant == "first_def" else t.kind)
            assert all(v in t.messages[-1]["content"] for v in t.arguments.values())
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
    by_variant = printed["scores"]["grep"]["fact_by_variant"]  # "hits/tasks" per variant, 2 tasks in all
    assert sum(int(v.split("/")[1]) for v in by_variant.values()) == 2
    assert printed["tasks_digest"] == eval_tiny.tasks_digest(eval_tasks(0, 2, "grep"))


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


def test_save_weights_replaces_the_previous_copy_whole(tmp_path: Path):
    from kda_sessions.model.loader import read_checkpoint
    from tools import train_tiny

    model = HybridModel(ModelConfig.from_file(train_tiny.CONFIG))
    path = tmp_path / "weights"
    (tmp_path / "weights.partial").mkdir()  # left by a run killed while saving
    (tmp_path / "weights.partial" / "junk").write_text("x")
    train_tiny.save_weights(model, path, 4 << 20)
    first = read_checkpoint(path)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    train_tiny.save_weights(model, path, 4 << 20)
    second = read_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]
    assert torch.equal(second["lm_head.weight"], first["lm_head.weight"] + 1.0)
    assert not (path / "junk").exists() and len(list(path.glob("*.safetensors"))) > 1  # sharded at 4 MiB


@pytest.mark.slow
def test_sigterm_ends_training_with_the_weights_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import os
    import signal

    from tools import train_tiny

    real = train_tiny.masked_losses
    calls = []

    def terminated_at_step_two(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` sends it
        return real(*a, **k)

    monkeypatch.setattr(train_tiny, "masked_losses", terminated_at_step_two)
    before = signal.getsignal(signal.SIGTERM)
    train_tiny.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--checkpoint-every", "0"])
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["steps_done"] == 2 and log["stopped_by"] == "SIGTERM" and "heldout" in log
    assert (tmp_path / "weights" / "config.json").exists() and signal.getsignal(signal.SIGTERM) == before


def test_data_workers_die_on_sigterm_while_the_trainer_defers_it():
    """train_tiny.main defers SIGTERM while it trains; the data workers it forks must not inherit that, or closing
    the batches (which terminates them) would wait for them forever."""
    import os
    import signal
    import threading

    from tools import train_tiny

    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        gen = train_tiny.batches(1, "train", 2, 512, 2, 267, prefetch=1)
        next(gen)
        procs = gen.gi_frame.f_locals["procs"]
        closer = threading.Thread(target=gen.close, daemon=True)
        closer.start()
        closer.join(timeout=30)
        alive = closer.is_alive()
        for p in procs:  # clean up whatever happened
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        assert not alive, "closing the batches hung: a worker ignored SIGTERM"
        assert not any(p.is_alive() for p in procs)
    finally:
        signal.signal(signal.SIGTERM, before)
