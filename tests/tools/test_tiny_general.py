"""tools/tiny_phrasing.py (the question grammar) and tools/tiny_general.py (rows and tasks that generalise):
the grammar's coverage, held-out phrasings and package trees never in training rows, and the episode shapes."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

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
    train = {t.id: tp.template_regex(t) for ts in tp.TEMPLATES.values() for t in ts if not (t.heldout or t.extra)}
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
        return (seed, "train", 2048, (2000, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, general, 0.5, 0.0, 0.0, 0.0)

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


def _focus_episodes(seeds: range, per_row: int = 30) -> list[tuple[object, tg._Episode]]:
    out = []
    for seed in seeds:
        rng = random.Random(seed)
        c = tg.focus_corpus(rng, 0.5)
        words, used = tg.project_words(c), set()
        for _ in range(per_row):
            ep = tg.focus_episode(rng, c, 3000, used, words)
            if ep is not None:
                out.append((c, ep))
    return out


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
    job = (12, "train", 4096, (2000, 2000), 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0)
    assert train_tiny._row(job) == tg.make_general_row(random.Random(12), "train", 4096, 0.5, focus=1.0)
    # a sibling project names its folders mostly with one plain word, in groups that start alike
    sib = [tg.focus_corpus(random.Random(s), 0.5) for s in range(12) if random.Random(s).random() < tg.FOCUS_SIBLINGS]
    assert len(sib) >= 3 and all(isinstance(c, RenamedCorpus) for c in sib)
    parts = [x for c in sib for d in c.holders() + c.dirs["train"] for x in d.split("/")]
    assert sum(x.isalpha() for x in parts) > 0.6 * len(parts)
    words = tg.sibling_words(random.Random(1))
    assert len(words) >= 24 and not {w.lower() for w in words} & tg.heldout_names()
    assert max(sum(w[:2] == v[:2] for v in words) for w in words) >= 4
