"""tools/tiny_phrasing.py (the question grammar) and tools/tiny_general.py (rows and tasks that generalise):
the grammar's coverage, held-out phrasings and package trees never in training rows, and the episode shapes."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kda_sessions.tokenizer import parse_assistant_output, validate_arguments
from kda_sessions.tools import TOOL_SCHEMAS, ToolError, Tools
from tools import eval_tiny
from tools import tiny_general as tg
from tools import tiny_phrasing as tp
from tools.tiny_data import FACT, GEN_IDS, TOK, RenamedCorpus, _episode, corpus, fact_in, make_row, render

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
END = TOK.special_ids["<|im_end|>"]
USER = TOK.special_ids["<|im_user|>"]
MIDDLE = TOK.special_ids["<|im_middle|>"]
SLOTS = {"p": "pkg/sub/mod_a.py", "d": "pkg/sub", "n": "417", "pat": "class Frobnicator", "what": "class",
         "name": "Frobnicator", "x": "helpers.py"}


def _user_turns(ids: list[int]) -> list[str]:
    """The text of every user message of a rendered row."""
    out = []
    for i, t in enumerate(ids):
        if t == USER:
            j = ids.index(MIDDLE, i) + 1
            out.append(TOK.decode(ids[j : ids.index(END, j)]))
    return out


def _rows(seed: int, n: int, max_len: int = 4096, tree_share: float = 0.5) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [tg.make_general_row(rng, "train", max_len, tree_share) for _ in range(n)]


def test_ordinals():
    assert [tp.ordinal(str(n)) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]


def test_grammar_covers_every_intent_in_both_splits():
    assert set(tp.INTENTS) == set(tp.SLOTS)
    texts = [t.text for ts in tp.TEMPLATES.values() for t in ts]
    assert len(texts) == len(set(texts))  # a phrasing is in one split only
    for intent, ts in tp.TEMPLATES.items():
        train, held = tp.templates(intent, "train"), tp.templates(intent, "heldout")
        assert len(train) >= 4 and len(held) >= 1, intent
        for t in ts:
            used = set(re.findall(r"\{(\w+)\}", t.text)) - {"nth"} | ({"n"} if "{nth}" in t.text else set())
            assert used <= tp.SLOTS[intent] and used & {"p", "d"}, t.text
    # verbs and word orders: the templates of one intent start with several different words
    assert all(len({t.text.split()[0] for t in tp.templates(i, "train")}) >= 4 for i in tp.INTENTS)
    assert set(tp.OFF_TASK["train"]).isdisjoint(tp.OFF_TASK["heldout"]) and len(tp.OFF_TASK["heldout"]) >= 5
    with pytest.raises(ValueError, match="intent"):
        tp.templates("delete_file", "train")
    with pytest.raises(ValueError, match="missing"):
        tp.question(random.Random(0), "line", {"p": "a.py"}, "train")


@pytest.mark.parametrize("intent", tp.INTENTS)
def test_questions_vary_and_keep_their_slots_verbatim(intent: str):
    rng = random.Random(1)
    seen = set()
    for _ in range(200):
        text, tid = tp.question(rng, intent, SLOTS, "train", typo=1.0)
        assert tid.startswith(intent + ":") and not any(t.id == tid and t.heldout for t in tp.TEMPLATES[intent])
        slots_used = set(re.findall(r"\{(\w+)\}", tid.split(":", 1)[1]))
        for k in slots_used - {"d"}:  # a typo never touches a slot; a folder may read "the pkg/sub folder"
            assert (tp.ordinal(SLOTS["n"]) if k == "nth" else SLOTS[k]) in text, (k, text)
        if "d" in slots_used:
            assert "pkg/sub" in text, text
        seen.add(text)
    assert len(seen) > 120  # templates x quoting x context x politeness x typos
    plain, _ = tp.question(random.Random(2), intent, SLOTS, "heldout", plain=True)
    assert any(tp.template_regex(t).search(plain) for t in tp.templates(intent, "heldout"))


def test_heldout_phrasings_and_off_task_messages_never_appear_in_training_rows():
    held = [tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts if t.heldout]
    held += [tp.template_regex(t) for t in tp.OFF_TASK["heldout"]]
    train = {t.id: tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts
             if not (t.heldout or t.extra or t.listing)}
    questions = [q for ids, _ in _rows(3, 64) for q in _user_turns(ids)]
    assert len(questions) > 200
    for q in questions:
        assert not any(rx.search(q) for rx in held), q
    used = {tid for tid, rx in train.items() if any(rx.search(q) for q in questions)}
    assert len(used) > 0.5 * len(train)  # and many of the training phrasings do appear


def test_heldout_trees_are_never_the_corpus_of_a_training_row():
    names = tg.package_trees()
    assert tg.EVAL_TREE in names and tg.tree_split(tg.EVAL_TREE) == "heldout"
    assert all(tg.tree_split(n) == "heldout" for n in tg.HELDOUT_TREES)
    assert set(tg.trees("train")).isdisjoint(tg.trees("heldout")) and tg.trees("train")
    drawn = set()
    for seed in range(300):  # make_general_row's first draws pick its tree (row_corpus): replay them
        drawn.add(tg.row_tree(random.Random(seed), "train", 0.9))
    assert None in drawn and len(drawn) > 10
    assert all(tg.tree_split(n) == "train" for n in drawn - {None})
    assert tg.row_tree(random.Random(0), "heldout", 1.0) in tg.trees("heldout")
    roots = {str(Path(names[n]).resolve()) for n in tg.trees("train")}
    renamed = 0
    for seed in range(8):  # a tree row's corpus is a training tree, or one under new names (RENAMED_TREE_FRACTION)
        c = tg.row_corpus(random.Random(seed), "train", 1.0)
        if isinstance(c, RenamedCorpus):
            renamed += 1
            assert str(c.base.root) in roots and set(c.real.values()) <= set(c.base.files["train"] + c.base.dirs["train"])
        else:
            assert str(c.root) in roots
    assert 0 < renamed < 8
    # a held-out tree is held out whole (its own path-hash split may hold no folder): every file is a held-out one
    for seed in range(4):
        h = tg.row_corpus(random.Random(seed), "heldout", 1.0)
        assert not h.files["train"] and not h.dirs["train"] and h.dirs["heldout"]


def test_training_rows_on_a_tree_call_its_train_files_only():
    checked = 0
    for seed in range(6):
        c = tg.row_corpus(random.Random(seed), "train", 1.0)
        ids, mask = tg.make_general_row(random.Random(seed), "train", 4096, 1.0)
        text = TOK.decode(ids)
        for start in [i for i in range(len(ids)) if ids[i : i + len(GEN_IDS)] == GEN_IDS]:
            end = ids.index(END, start)
            for call in parse_assistant_output(ids[start + len(GEN_IDS) : end + 1], TOK).tool_calls:
                path = json.loads(call.function.arguments)["path"]
                if mask[start + len(GEN_IDS)] == 0:  # a failed call (left out of the loss): its path may not exist
                    continue
                # a renamed project's multi-step task lists a folder holding its renamed files
                holders = c.holders() if isinstance(c, RenamedCorpus) else []
                assert path in c.files["train"] or path in c.dirs["train"] or path in holders, (path, c.root)
                checked += 1
        assert "error: " not in text or "<|tool_call_begin|>" in text
    assert checked > 20


def test_rows_are_full_masked_and_every_call_validates():
    shapes = {"error": 0, "multi": 0, "off": 0}
    rows = _rows(5, 8, 8192)
    assert sum(len(ids) for ids, _ in rows) > 0.9 * 8 * 8192  # rows are full (padding is wasted training)
    for ids, mask in rows:
        assert len(ids) == len(mask) <= 8192 and set(mask) <= {0, 1, FACT}
        for start in [i for i in range(len(ids)) if ids[i : i + len(GEN_IDS)] == GEN_IDS]:
            parsed = parse_assistant_output(ids[start + len(GEN_IDS) : ids.index(END, start) + 1], TOK)
            assert not parsed.errors
            for call in parsed.tool_calls:
                assert not validate_arguments(call.function.arguments, SCHEMAS[call.function.name])
        text = TOK.decode(ids)
        shapes["error"] += text.count("error: ")
        shapes["multi"] += len(re.findall(r"The first Python file of|first Python file in", text))
        shapes["off"] += text.count(tp.REFUSAL)
    assert all(v >= 3 for v in shapes.values()), shapes


def test_a_tool_error_is_answered_by_the_corrected_call():
    c = corpus()
    rng = random.Random(7)
    made = 0
    for _ in range(40):
        ep = _episode(rng, c, "train", 3000, set())
        fixed = ep and tg.error_episode(rng, c, tg.rephrase(rng, ep, "train"))
        if not fixed:
            continue
        made += 1
        user, wrong, error, right, result, answer = fixed.messages
        assert error["content"].startswith("error: ") and error["tool_call_id"] == wrong["tool_calls"][0]["id"]
        assert wrong["tool_calls"][0]["function"] != right["tool_calls"][0]["function"]
        assert right["tool_calls"][0]["function"] == ep.messages[1]["tool_calls"][0]["function"]
        assert result["content"] == ep.messages[2]["content"] and answer == ep.messages[3]
        # the failed call is not learnt; the correction and the answer are
        n_head = len(render([user, wrong])[0])
        assert set(fixed.mask[:n_head]) == {0} and 1 in fixed.mask[n_head:] and FACT in fixed.mask[n_head:]
    assert made >= 20


def test_multi_step_lists_then_reads_the_first_python_file():
    c = corpus()
    rng = random.Random(8)
    for _ in range(10):
        ep = tg.multi_step_episode(rng, c, "train", 6000)
        assert ep is not None and ep.tool == "list_dir"
        _, _, listing, call2, result, answer = ep.messages
        first = next(e for e in listing["content"].split("\n") if e.endswith(".py"))
        args2 = json.loads(call2["tool_calls"][0]["function"]["arguments"])
        assert args2["path"].rsplit("/", 1)[-1] == first
        assert ep.fact in result["content"] and fact_in(answer["content"], ep.fact)


def test_multi_step_on_a_renamed_project_lists_a_folder_of_renamed_files():
    made = 0
    for seed in range(6):
        rng = random.Random(seed)
        c = RenamedCorpus(rng, corpus(), words=tg.rename_words())
        for _ in range(3):
            ep = tg.multi_step_episode(rng, c, "train", 6000)
            if ep is None:
                continue
            made += 1
            d = ep.arguments["path"]
            _, _, listing, call2, result, answer = ep.messages
            assert d in c.holders() and d not in c.dirs["train"]
            # the listing shows every renamed file of the folder, whatever was touched before
            below = {f[len(d) + 1 :].split("/", 1)[0] for f in c.files["train"] if f.startswith(d + "/")}
            assert {e.rstrip("/") for e in listing["content"].split("\n")} == below
            path = json.loads(call2["tool_calls"][0]["function"]["arguments"])["path"]
            assert path in c.files["train"] and path.startswith(d + "/")
            assert ep.fact in result["content"] and fact_in(answer["content"], ep.fact)
    assert made >= 12


def test_general_rows_with_recall_ask_about_facts_far_back():
    note_re = re.compile(r"the (.+) is (\S+)\.$")
    question_re = re.compile(r"^(?:What (.+) did I give you earlier\?|Remind me: what was the (.+)\?)$")
    asked = 0
    for seed in range(4):
        ids, mask = tg.make_general_row(random.Random(seed), "train", 8192, 0.5, recall=1.0, distance=(64, 2000))
        assert len(ids) == len(mask) <= 8192
        notes = dict(m.groups() for t in _user_turns(ids) if (m := note_re.search(t)))
        for t in _user_turns(ids):
            if m := question_re.match(t):  # every question asks about a thing a note of this row gave
                asked += 1
                assert (m.group(1) or m.group(2)) in notes, (t, notes)
    assert asked >= 3
    # at 0 nothing is drawn for recall: the rows are those of runs before the option
    assert tg.make_general_row(random.Random(3), "train", 4096, 0.5, recall=0.0) == tg.make_general_row(
        random.Random(3), "train", 4096, 0.5)
    with pytest.raises(ValueError, match="recall must be"):
        tg.make_general_row(random.Random(3), "train", 4096, 0.5, recall=1.5)


def test_late_recall_facts_come_after_other_episodes():
    """With recall_late the row's first user turn is a task, not a fact to recall (without it, facts stand first);
    the questions still ask about facts the row gave. At 0 nothing is drawn: the rows of earlier runs."""
    from tools import train_tiny

    note_re = re.compile(r"the (.+) is (\S+)\.$")
    question_re = re.compile(r"^(?:What (.+) did I give you earlier\?|Remind me: what was the (.+)\?)$")
    first_is_note = {0.0: 0, 1.0: 0}
    asked = 0
    for seed in range(6):
        for late in (0.0, 1.0):
            ids, mask = tg.make_general_row(random.Random(seed), "train", 8192, 0.5, recall=1.0, distance=(64, 2000),
                                            recall_late=late)
            assert len(ids) == len(mask) <= 8192
            turns = _user_turns(ids)
            first_is_note[late] += bool(note_re.search(turns[0]))
            notes = dict(m.groups() for t in turns if (m := note_re.search(t)))
            for t in turns:
                if late and (m := question_re.match(t)):
                    asked += 1
                    assert (m.group(1) or m.group(2)) in notes, (t, notes)
    assert first_is_note[0.0] >= 1 and first_is_note[1.0] == 0 and asked >= 2
    for kw in ({}, {"recall": 0.6}, {"recall": 1.0, "focus": 0.5}):
        assert tg.make_general_row(random.Random(5), "train", 4096, 0.5, recall_late=0.0, **kw) == \
            tg.make_general_row(random.Random(5), "train", 4096, 0.5, **kw)
    job = (5, "train", 8192, (64, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0)
    assert train_tiny._row(job) == tg.make_general_row(random.Random(5), "train", 8192, 0.5, recall=1.0,
                                                       distance=(64, 2000), recall_late=1.0)
    with pytest.raises(ValueError, match="recall_late must be"):
        tg.make_general_row(random.Random(3), "train", 4096, 0.5, recall_late=1.5)


def test_general_eval_tasks_use_the_heldout_tree_and_phrasings():
    c = tg.tree_corpus(tg.EVAL_TREE, whole=True)
    tasks = tg.general_tasks(0, 8)
    assert [t.kind for t in tasks] == list(tg.GENERAL_KINDS) * 2
    for t in tasks:
        assert t.arguments["path"] in c.files["heldout"] or t.arguments["path"] in c.dirs["heldout"]
        calls = [m for m in t.messages if m.get("tool_calls")]
        for m in calls:
            p = json.loads(m["tool_calls"][0]["function"]["arguments"])["path"]
            assert p in c.files["heldout"] or p in c.dirs["heldout"]
    assert [json.dumps(t.messages) for t in tg.general_tasks(0, 8)] == [json.dumps(t.messages) for t in tasks]
    off = tg.off_task_tasks(0, 6)
    held = [tp.template_regex(t) for t in tp.OFF_TASK["heldout"]]
    assert all(t.fact == tp.REFUSAL and t.tool is None for t in off)
    assert all(any(rx.search(t.messages[-1]["content"]) for rx in held) for t in off)
    with pytest.raises(ValueError, match="used in training"):
        tg.general_tasks(0, 2, tree=tg.trees("train")[0])


def test_issue31_targets_compare_with_the_in_template_figures():
    t = {"overall": {"right_call": 0.95, "fact": 0.85}}
    good = eval_tiny.issue31(t, {"overall": {"right_call": 0.9, "fact": 0.8}}, {"refusal": 0.95})
    assert all(good["pass"].values())
    bad = eval_tiny.issue31(t, {"overall": {"right_call": 0.9, "fact": 0.72}}, {"refusal": 0.5})
    assert bad["pass"] == {"right_call": True, "fact": True, "gap": False, "refusal": False}
    assert bad["gap_to_in_template"] == {"right_call": 0.05, "fact": 0.13}


def test_generation_config_of_tiny_is_greedy():
    path = Path(tg.__file__).resolve().parents[1] / "kda_sessions" / "builtin" / "tiny.generation_config.json"
    cfg = json.loads(path.read_text())
    assert cfg["temperature"] == 0.0 and cfg["do_sample"] is False and 0 < cfg["max_new_tokens"] <= 512


@pytest.mark.slow
def test_general_eval_runs_on_tiny_random(capsys: pytest.CaptureFixture[str]):
    eval_tiny.main(["--model", "tiny-random", "--n", "2", "--general", "--max-tokens", "4"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["general"]["overall"]["n"] == 2 and printed["off_task"]["n"] == 2
    assert set(printed["issue31"]["pass"]) == {"right_call", "fact", "gap", "refusal"}


def test_training_rows_take_a_share_of_general_rows_and_zero_changes_nothing():
    from tools import train_tiny

    def job(seed: int, general: float) -> tuple:
        return (seed, "train", 2048, (2000, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, general, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0)

    assert train_tiny._row(job(11, 0.0)) == make_row(random.Random(11), "train", 2048)
    assert train_tiny._row(job(11, 1.0)) == tg.make_general_row(random.Random(11), "train", 2048, 0.5)
    ids, mask = tg.make_general_row(random.Random(11), "train", 1024)  # no room after the header: source text
    assert len(ids) == 1024 and set(mask) == {1}


def test_copy_words_are_long_varied_and_never_a_heldout_trees_name():
    rng = random.Random(3)
    words = tg.copy_words(rng, 400)
    assert len(set(words)) == 400 and all(7 <= len(w) <= 22 for w in words)
    assert not {w.lower() for w in words} & tg.heldout_names()
    assert {"middleware", "supervisors", "protocols"} <= tg.heldout_names()  # the eval tree's folders
    c = tg.tree_corpus(tg.EVAL_TREE, whole=True)  # EVAL_TREE_NAMES holds them where the tree is not installed
    stems = {p.removesuffix(".py") for rel in c.files["heldout"] + c.dirs["heldout"] for p in rel.split("/")}
    assert stems - {".", "__init__", "__main__"} <= set(tg.EVAL_TREE_NAMES)
    kinds = {"upper": any(c.isupper() for w in words for c in w), "digit": any(c.isdigit() for w in words for c in w),
             "underscore": any("_" in w for w in words), "dot": any("." in w for w in words)}
    assert all(kinds.values()), kinds
    assert sum(w not in tg.rename_words() for w in words) > 300  # mostly words no other row names things with


def test_copy_drill_rows_copy_their_projects_words_into_calls_and_answers():
    calls = defs = 0
    for seed in range(3):
        rng = random.Random(seed)
        ids, mask = tg.make_general_row(rng, "train", 8192, 0.5, copy=1.0)
        c = tg.row_corpus(random.Random(seed), "train", 0.5, 1.0)  # the row's first draws: its project
        assert isinstance(c, RenamedCorpus) and len(ids) == len(mask) <= 8192
        renamed = {new for alias in c.files["train"] for new in c._renamed(alias).values()}
        for start in [i for i in range(len(ids)) if ids[i : i + len(GEN_IDS)] == GEN_IDS]:
            parsed = parse_assistant_output(ids[start + len(GEN_IDS) : ids.index(END, start) + 1], TOK)
            assert not parsed.errors
            for call in parsed.tool_calls:
                assert not validate_arguments(call.function.arguments, SCHEMAS[call.function.name])
                args = json.loads(call.function.arguments)
                calls += args["path"].split("/", 1)[0] in {p.split("/", 1)[0] for p in c.real} | {
                    f.split("/", 1)[0] for f in c.files["train"]}
                defs += any(w in args.get("pattern", "") for w in renamed)
    assert calls >= 10 and defs >= 1
    # held-out rows and rows at copy 0 draw nothing for it
    assert tg.make_general_row(random.Random(5), "heldout", 4096, 0.5, copy=1.0) == tg.make_general_row(
        random.Random(5), "heldout", 4096, 0.5)
    assert tg.make_general_row(random.Random(5), "train", 4096, 0.5, copy=0.0) == tg.make_general_row(
        random.Random(5), "train", 4096, 0.5)


# ---- focus rows (make_general_row's ``focus``): the held-out failures of the shipped weights -------------------


def _episodes(corpus: Any, episode: Any, seeds: range, per_row: int) -> Iterator[tuple[Any, tg._Episode]]:
    """Episodes of ``episode`` (focus_episode, listing_episode) on projects of ``corpus``, with their projects,
    lazily: a renamed project's files live only until the next one is made (one temp root a process), so a test
    that runs the tools runs them on each episode before taking the next."""
    for seed in seeds:
        rng = random.Random(seed)
        c = corpus(rng, 0.5)
        words, used = tg.project_words(c), set()
        for _ in range(per_row):
            ep = episode(rng, c, 3000, used, words)
            if ep is not None:
                yield c, ep


def _focus_episodes(seeds: range, per_row: int = 30) -> list[tuple[Any, tg._Episode]]:
    return list(_episodes(tg.focus_corpus, tg.focus_episode, seeds, per_row))


def test_focus_rows_hold_each_kind_of_episode_in_its_share():
    eps = _focus_episodes(range(16))
    assert len(eps) > 400
    share = {k: sum(k_of(ep) for _, ep in eps) / len(eps) for k, k_of in {
        "error": lambda ep: ep.variant.startswith("error:") or ep.variant == "absent",
        "intent": lambda ep: ep.variant.startswith("drill:"),
        "multi": lambda ep: ep.kind == "multi_step",
        "off_task": lambda ep: ep.kind == "off_task",
    }.items()}
    for k, v in share.items():  # an episode that did not fit is drawn again: shares near FOCUS_MIX's
        assert abs(v - tg.FOCUS_MIX[k]) < 0.08, (k, v, share)
    kinds = {ep.variant.split(":")[1] + ":" + ep.tool for _, ep in eps if ep.variant.startswith("error:")}
    assert {"empty:grep", "path:read_file", "path:list_dir", "what:grep", "tool:list_dir"} <= kinds, kinds
    # greps ask for classes as often as for functions: "the class X" was grepped as `def X`
    whats = [ep.arguments["pattern"].split()[0] for _, ep in eps if ep.kind == "grep" and ep.variant == "def_line"]
    assert len(whats) > 40 and 0.35 < whats.count("class") / len(whats) < 0.65
    # intent drills ask two or three list_dir intents about one folder, count in most of them
    drills = [ep for _, ep in eps if ep.variant.startswith("drill:")]
    assert all(len(set(ep.variant[6:].split("+"))) == len(ep.variant[6:].split("+")) >= 2 for ep in drills)
    assert sum("count" in ep.variant for ep in drills) > 0.5 * len(drills)
    for ep in drills:
        calls = [m["tool_calls"][0]["function"]["arguments"] for m in ep.messages if m.get("tool_calls")]
        assert len(calls) == len(ep.variant[6:].split("+")) and set(calls) == {json.dumps({"path": ep.arguments["path"]})}


def test_focus_errors_are_the_real_tools_output_then_the_corrected_call():
    checked = folder_parts = 0
    nested: dict[str, int] = {"grep": 0, "read_file": 0, "list_dir": 0}  # a folder part garbled, by tool
    for c, ep in _focus_episodes(range(12)):
        if not ep.variant.startswith("error:"):
            continue
        user, wrong, error, right, _result, *rest = ep.messages
        name = wrong["tool_calls"][0]["function"]["name"]
        args = json.loads(wrong["tool_calls"][0]["function"]["arguments"])
        try:  # exactly what the library's Tools return, as the eval (and examples/agent_loop.py) report it
            expected = Tools(c.root).call(name, args)
        except ToolError as e:
            expected = f"error: {e}"
        assert error["content"] == expected and error["tool_call_id"] == wrong["tool_calls"][0]["id"]
        assert expected == "" if ep.variant.startswith("error:empty") or ep.variant.startswith("error:what") else (
            expected.startswith("error: "))
        # after the failure comes the right call (never an answer), then its output and the answer
        fixed = json.loads(right["tool_calls"][0]["function"]["arguments"])
        assert right["role"] == "assistant" and fixed == ep.arguments and fixed != args
        assert fact_in(rest[-1]["content"], ep.fact) and ep.fact not in right["content"]
        n_head = len(render([user, wrong])[0])
        n_fix = len(render([user, wrong, error])[0])
        assert set(ep.mask[:n_head]) == {0} and set(ep.mask[n_fix:n_fix + len(render([right])[0])]) - {0} == {1}
        if ep.variant.startswith(("error:empty", "error:path")):
            wp, rp = args["path"].split("/"), fixed["path"].split("/")
            assert len(wp) == len(rp) and sum(a != b for a, b in zip(wp, rp)) == 1
            folder_parts += wp[0] != rp[0] and len(rp) > 1
            nested[name] += any(a != b for a, b in zip(wp[:-1], rp[:-1]))
        checked += 1
    assert checked > 60 and folder_parts > 0.3 * checked and min(nested.values()) >= 5, nested


def test_absent_definitions_are_answered_no_from_the_empty_output():
    n = 0
    for _, ep in _focus_episodes(range(16)):
        if ep.variant == "absent":
            n += 1
            _, call, out, answer = ep.messages
            assert out["content"] == "" and answer["content"].startswith("No:") and ep.fact == "No"
            assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == ep.arguments
    assert n >= 3


def test_garbled_names_differ_as_a_bad_copy_would():
    rng = random.Random(4)
    for part in ("protocols", "loops", "lifespan", "middleware", "ab", "x"):
        seen = {tg.garble(rng, part, "I have a demo in ten minutes. Which line of loops/a.py?") for _ in range(50)}
        assert part not in seen and all(s and "/" not in s for s in seen)
        if len(part) > 4:
            assert len(seen) > 10 and any(s[:2] == part[:2] for s in seen)


def test_focus_rows_use_extra_phrasings_and_never_heldout_ones():
    held = [tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts if t.heldout]
    held += [tp.template_regex(t) for t in tp.OFF_TASK["heldout"]]
    extra = {t.id: tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts if t.extra}
    rows = [tg.make_general_row(random.Random(s), "train", 8192, 0.5, focus=1.0) for s in range(6)]
    questions = [q for ids, _ in rows for q in _user_turns(ids)]
    assert len(questions) > 80
    for q in questions:
        assert not any(rx.search(q) for rx in held), q
        assert not any(h in q for h in tp.CONTEXT["heldout"]), q
    assert sum(any(rx.search(q) for rx in extra.values()) for q in questions) > 0.2 * len(questions)
    for ids, mask in rows:  # well formed: every call parses and validates, rows are full
        assert len(ids) == len(mask) <= 8192 and len(ids) > 0.9 * 8192 and set(mask) <= {0, 1, FACT}
        for start in [i for i in range(len(ids)) if ids[i : i + len(GEN_IDS)] == GEN_IDS]:
            parsed = parse_assistant_output(ids[start + len(GEN_IDS) : ids.index(END, start) + 1], TOK)
            assert not parsed.errors
            for call in parsed.tool_calls:
                assert not validate_arguments(call.function.arguments, SCHEMAS[call.function.name])


def test_extra_phrasings_are_opt_in_and_training_only():
    for intent in tp.INTENTS:
        assert not any(t.extra for t in tp.templates(intent, "train") + tp.templates(intent, "heldout"))
    assert len(tp.templates("count", "train", extra=True)) >= 2 * len(tp.templates("count", "train"))
    assert all(not t.heldout for ts in tp.TEMPLATES.values() for t in ts if t.extra)
    with pytest.raises(ValueError, match="training questions only"):
        tp.question(random.Random(0), "count", SLOTS, "heldout", extra=True)
    rng = random.Random(5)
    sentences = {tp.context_sentence(rng, ("loaders", "locks")) for _ in range(3000)}
    assert len(sentences) > 500 and not sentences & set(tp.CONTEXT["heldout"])
    assert any("loaders" in s for s in sentences)


def test_focus_zero_draws_nothing_and_focus_rows_come_from_train_rows():
    from tools import train_tiny

    assert tg.make_general_row(random.Random(6), "train", 4096, 0.5, focus=0.0) == tg.make_general_row(
        random.Random(6), "train", 4096, 0.5)
    assert tg.make_general_row(random.Random(6), "heldout", 4096, 0.5, focus=1.0) == tg.make_general_row(
        random.Random(6), "heldout", 4096, 0.5)
    with pytest.raises(ValueError, match="focus must be"):
        tg.make_general_row(random.Random(6), "train", 4096, 0.5, focus=1.5)
    job = (12, "train", 4096, (2000, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0)
    assert train_tiny._row(job) == tg.make_general_row(random.Random(12), "train", 4096, 0.5, focus=1.0)
    # a sibling project names its folders mostly with one plain word, in groups that start alike
    sib = [tg.focus_corpus(random.Random(s), 0.5) for s in range(12) if random.Random(s).random() < tg.FOCUS_SIBLINGS]
    assert len(sib) >= 3 and all(isinstance(c, RenamedCorpus) for c in sib)
    parts = [x for c in sib for d in c.holders() + c.dirs["train"] for x in d.split("/")]
    assert sum(x.isalpha() for x in parts) > 0.6 * len(parts)
    words = tg.sibling_words(random.Random(1))
    assert len(words) >= 24 and not {w.lower() for w in words} & tg.heldout_names()
    assert max(sum(w[:2] == v[:2] for v in words) for w in words) >= 4


# ---- listing rows (make_general_row's ``listing``): "the listing of D" for every intent, context lures -----------


def _words(text: str) -> list[str]:
    return re.findall(r"\{\w+\}(?:'s)?|[a-z']+", text.lower())


def _word_distance(a: list[str], b: list[str]) -> int:
    """Levenshtein distance between two word lists."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def test_listing_phrasings_never_are_nor_render_a_heldout_one():
    listing = [t for ts in tp.TEMPLATES.values() for t in ts if t.listing]
    held = [t for ts in tp.TEMPLATES.values() for t in ts if t.heldout]
    assert len(listing) >= 40 and not any(t.heldout or t.extra for t in listing)
    held_rx = [tp.template_regex(t) for t in held]
    held_plain = set()
    for t in held:
        held_plain.add(t.text.format(**SLOTS, nth=tp.ordinal(SLOTS["n"])).rstrip("?.!").lower())
    rng = random.Random(9)
    for t in listing:
        assert t.text not in {h.text for h in held}
        plain = t.text.format(**SLOTS)
        assert plain.rstrip("?.!").lower() not in held_plain and not any(rx.search(plain) for rx in held_rx), t.text
        # not a held-out phrasing with a word or two swapped ("How big is" -> "How long is" would make the eval's
        # held-out count question an in-template one)
        for h in held:
            assert _word_distance(_words(t.text), _words(h.text)) >= 3, (t.text, h.text)
        for _ in range(30):  # quoting, context, politeness, typos: never a held-out phrasing either
            text, _ = tp.question(rng, t.intent, SLOTS, "train", typo=1.0, extra=True, listing=True)
            assert not any(rx.search(text) for rx in held_rx), text
    # the held-out count phrasing the shipped weights answer with the first entry stays held out
    assert "How big is the listing of {d}, in entries?" in {t.text for t in tp.templates("count", "heldout")}


def test_listing_phrasings_are_opt_in_and_all_say_listing():
    for intent in tp.INTENTS:
        assert not any(t.listing for t in tp.templates(intent, "train", extra=True) + tp.templates(intent, "heldout"))
    for intent in ("count", "first", "has"):
        pool = tp.templates(intent, "train", listing=True)
        assert len(pool) >= 15 and all(tp.LISTING_WORDS.search(t.text) and not t.heldout for t in pool)
        assert sum(t.listing for t in pool) >= 0.5 * len(pool)
    with pytest.raises(ValueError, match="training questions only"):
        tp.question(random.Random(0), "count", SLOTS, "heldout", listing=True)


def _listing_episodes(seeds: range, per_row: int = 30) -> Iterator[tuple[Any, tg._Episode]]:
    return _episodes(tg.listing_corpus, tg.listing_episode, seeds, per_row)


def test_listing_rows_hold_each_kind_of_episode_in_its_share():
    eps = list(_listing_episodes(range(12)))
    assert len(eps) > 300
    share = {k: sum(k_of(ep) for _, ep in eps) / len(eps) for k, k_of in {
        "drill": lambda ep: ep.variant.startswith("listing:"),
        "lure": lambda ep: ep.variant.startswith("lure:"),
        "lure_error": lambda ep: ep.variant.startswith("lure_error:"),
        "multi": lambda ep: ep.kind == "multi_step",
        "off_task": lambda ep: ep.kind == "off_task",
    }.items()}
    for k, v in share.items():  # an episode that did not fit is drawn again: shares near LISTING_MIX's
        assert abs(v - tg.LISTING_MIX[k]) < 0.08, (k, v, share)
    kinds = {ep.variant.split(":")[-1] for _, ep in eps if ep.variant.startswith("lure")}
    assert {"def_line", "line", "first_def", "count", "first", "has"} <= kinds, kinds


def test_listing_drills_ask_every_intent_in_listing_words_and_answer_from_the_real_listing():
    drills = questions = listed = 0
    asked = {"count": 0, "first": 0, "has": 0}
    for c, ep in _listing_episodes(range(12)):
        if not ep.variant.startswith("listing:"):
            continue
        drills += 1
        variants = ep.variant.removeprefix("listing:").split("+")
        assert "count" in variants and len(set(variants)) == len(variants) in (2, 3)
        d = ep.arguments["path"]
        entries = Tools(c.root).call("list_dir", {"path": d}).split("\n")  # what the library's tool shows
        assert len(entries) <= tg.MAX_COUNTED
        users = [i for i, m in enumerate(ep.messages) if m["role"] == "user"]
        assert len(users) == len(variants)
        for variant, i in zip(variants, users):
            q, call, out, answer = ep.messages[i]["content"], ep.messages[i + 1], ep.messages[i + 2], ep.messages[i + 3]
            questions += 1
            listed += bool(tp.LISTING_WORDS.search(q))
            asked[variant] += 1
            assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"path": d}
            assert out["content"] == "\n".join(entries)
            a = answer["content"]
            if variant == "count":  # numbered as tiny_data numbers counts, then the true total
                numbered = ", ".join(f"{k} {e}" for k, e in enumerate(entries, 1))
                assert f": {numbered}. " in a and a.endswith(f" has {len(entries)} entries.")
            elif variant == "first":
                assert a.startswith("The first entry of ") and a.endswith(f" is {entries[0]}.")
            else:
                name = re.search(r"(?:contains|has no) (.+)\.$", a).group(1)
                assert a.startswith("Yes," if name in entries else "No,") and name in q
    # every question says "listing of D" or "D's listing" (but where a typo hit that word)
    assert drills > 100 and listed > 0.85 * questions
    assert asked["count"] > 0.35 * questions and min(asked.values()) > 0.15 * questions, asked


def test_lure_sentences_start_like_the_paths_parts():
    rng = random.Random(2)
    for path in ("loops/auto.py", "protocols/http/h11_impl.py", "_version.py", "lifespan/on.py", "middleware"):
        stems = tg.path_stems(path)
        assert stems and all(len(s) >= 2 and s.isalpha() and s.islower() for s in stems)
        for _ in range(40):
            words = tg.lure_words(rng, stems)
            assert words and all(any(w[:2] == s[:2] and w != s for s in stems) for w in words)
            sentence = tp.lure_sentence(rng, stems, words)
            assert tp.lures_in(sentence, stems) and sentence not in tp.CONTEXT["heldout"]
            assert not {w.lower() for w, _ in tp.lures_in(sentence, stems)} & set(stems)
    held = {" ".join(ws[i : i + 3]) for c in tp.CONTEXT["heldout"] if (ws := _words(c)) for i in range(len(ws) - 2)}
    for _ in range(3000):  # the held-out context sentences stay unseen: no three of their words in a row
        sentence = " ".join(_words(tp.lure_sentence(rng, ["loops", "tests"], ["looking", "terms"])))
        assert not any(h in sentence for h in held), sentence
    assert tg.path_stems("_version.py") == ["version"] and tg.path_stems("h11_impl.py") == []
    assert tp.lures_in("I have to look at it in a long while.", ["loops"]) == [("look", "loops"), ("long", "loops")]
    for part, word in (("loops", "look"), ("_version.py", "verbose"), ("lifespan", "linear")):
        seen = {tg.lure_garble(rng, part, word) for _ in range(40)}
        assert part not in seen and len(seen) >= 3 and all(g.lstrip("_")[:2] == word[:2] for g in seen), seen
        assert all(g.endswith(".py") for g in seen) == part.endswith(".py")


def test_lure_episodes_say_a_lure_sentence_and_copy_the_questions_path():
    frames = [re.compile("".join(re.escape(x) if i % 2 == 0 else "[A-Za-z' ]+" for i, x in
                                 enumerate(re.split(r"\{(\w+)\}", f)))) for f in tp.LURE_FRAMES]
    lures = errors = 0
    for c, ep in _listing_episodes(range(12)):
        if not ep.variant.startswith("lure"):
            continue
        lures += 1
        question = ep.messages[0]["content"]
        path = ep.arguments["path"]
        stems = tg.path_stems(path)
        # the message holds a lure sentence, and a word of it starts like one of the path's parts
        said = [m.group() for rx in frames if (m := rx.search(question))]
        assert any(tp.lures_in(x, stems) for x in said), (question, path)
        calls = [m for m in ep.messages if m.get("tool_calls")]
        right = json.loads(calls[-1]["tool_calls"][0]["function"]["arguments"])
        assert right == ep.arguments and fact_in(ep.messages[-1]["content"], ep.fact)
        if ep.variant.startswith("lure_error:"):
            errors += 1
            user, wrong, out = ep.messages[:3]
            args = json.loads(wrong["tool_calls"][0]["function"]["arguments"])
            try:
                expected = Tools(c.root).call(wrong["tool_calls"][0]["function"]["name"], args)
            except ToolError as e:
                expected = f"error: {e}"
            assert out["content"] == expected and (expected == "" or expected.startswith("error: "))
            wp, rp = args["path"].split("/"), path.split("/")
            diff = [(a, b) for a, b in zip(wp, rp) if a != b]
            assert len(wp) == len(rp) and len(diff) == 1
            garbled, part = diff[0]
            lure_starts = {w.lower()[:2] for w, _ in tp.lures_in(question, stems)}
            assert garbled.lstrip("_0123456789")[:2] in lure_starts, (garbled, part, question)
            n_head = len(render([user, wrong])[0])
            assert set(ep.mask[:n_head]) == {0} and FACT in ep.mask[n_head:]
    assert lures > 80 and errors > 20


def test_listing_rows_are_full_well_formed_and_never_heldout():
    held = [tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts if t.heldout]
    held += [tp.template_regex(t) for t in tp.OFF_TASK["heldout"]]
    rows = [tg.make_general_row(random.Random(s), "train", 8192, 0.5, listing=1.0) for s in range(6)]
    questions = [q for ids, _ in rows for q in _user_turns(ids)]
    assert len(questions) > 80
    for q in questions:
        assert not any(rx.search(q) for rx in held), q
        assert not any(h in q for h in tp.CONTEXT["heldout"]), q
    assert sum(bool(tp.LISTING_WORDS.search(q)) for q in questions) > 0.3 * len(questions)
    for ids, mask in rows:
        assert len(ids) == len(mask) <= 8192 and len(ids) > 0.9 * 8192 and set(mask) <= {0, 1, FACT}
        for start in [i for i in range(len(ids)) if ids[i : i + len(GEN_IDS)] == GEN_IDS]:
            parsed = parse_assistant_output(ids[start + len(GEN_IDS) : ids.index(END, start) + 1], TOK)
            assert not parsed.errors
            for call in parsed.tool_calls:
                assert not validate_arguments(call.function.arguments, SCHEMAS[call.function.name])
    # a small package tree (one folder of more than MAX_COUNTED entries) gives way to the stdlib
    for seed in range(20):
        c = tg.listing_corpus(random.Random(seed), 1.0)
        assert len(c.dirs["train"]) + len(c.holders() if isinstance(c, RenamedCorpus) else []) >= tg.MIN_LISTING_DIRS


def test_listing_zero_draws_nothing_and_listing_rows_share_the_focus_draw():
    from tools import train_tiny

    for kw in ({}, {"focus": 0.4}, {"focus": 1.0}, {"copy": 0.5, "recall": 0.6}):
        assert tg.make_general_row(random.Random(6), "train", 4096, 0.5, listing=0.0, **kw) == tg.make_general_row(
            random.Random(6), "train", 4096, 0.5, **kw)
    assert tg.make_general_row(random.Random(6), "heldout", 4096, 0.5, listing=1.0) == tg.make_general_row(
        random.Random(6), "heldout", 4096, 0.5)
    with pytest.raises(ValueError, match="listing must be"):
        tg.make_general_row(random.Random(6), "train", 4096, 0.5, focus=0.6, listing=0.5)
    job = (12, "train", 4096, (2000, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0)
    assert train_tiny._row(job) == tg.make_general_row(random.Random(12), "train", 4096, 0.5, listing=1.0)
    # one number draws both: below focus a focus row, then up to focus + listing a listing row, else a general one
    kinds = []
    for seed in range(12):
        u = random.Random(seed).random()
        row = tg.make_general_row(random.Random(seed), "train", 2048, 0.5, focus=0.3, listing=0.4)
        assert (row == tg.make_general_row(random.Random(seed), "train", 2048, 0.5, focus=1.0)) == (u < 0.3)
        assert (row == tg.make_general_row(random.Random(seed), "train", 2048, 0.5, listing=1.0)) == (0.3 <= u < 0.7)
        kinds.append(0 if u < 0.3 else 1 if u < 0.7 else 2)
    assert set(kinds) == {0, 1, 2}
