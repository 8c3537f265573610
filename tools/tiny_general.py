"""Rows and held-out tasks that teach `tiny` the task, not the sentence (issue 31).

Next to tiny_data's conversations (its fixed question forms, over the stdlib), these rows ask with the phrasing
grammar of ``tiny_phrasing`` (train templates only) over the stdlib or over any installed package tree, and mix in
four more episode shapes:

- a tool task of tiny_data (read_file, grep, list_dir) asked in a grammar phrasing;
- a multi-step task: list a folder, then grep or read its first Python file, then answer;
- a tool error answered by a corrected call: a wrong call (left out of the loss), the tool's ``error: ...`` as
  agents report it (examples/agent_loop.py, the eval), the right call, the answer;
- an off-task message answered by the fixed ``REFUSAL``, which says what the model can do.

Copy drills (``copy`` of make_general_row, ``copy_corpus``): a training project named with a fresh vocabulary of long
words seen nowhere else (``copy_words``), in folders, files and definitions, so calls and answers must copy them.

Focus rows (``focus`` of make_general_row, ``focus_episode``): the held-out failures of the shipped weights in
training shapes: projects whose names start alike (``sibling_words``), a wrong first call (a garbled folder or file
name, ``def`` for ``class``, the entry listed for its folder) answered by the real tool (an error, or a grep's
empty output) and then corrected, list_dir intent drills, and the EXTRA phrasings of ``tiny_phrasing``.

Listing rows (``listing`` of make_general_row, ``listing_episode``): on focus rows' projects, list_dir drills whose
count, first-entry and "contains" questions all say "the listing of D" (``listing_drill``), and tool tasks after a
context sentence whose words start like the parts of the path the call must name (``lure_episode``), some with a
first call garbled toward such a word, then corrected.

Package trees: every top-level package of the interpreter's site-packages with at least MIN_TREE_FILES Python
files. Whole trees are held out by a sha256 of ``tree:NAME`` (as tiny_data splits files) and by ``HELDOUT_TREES``;
inside a training tree, files and folders are split by path hash as in the stdlib. ``EVAL_TREE`` (uvicorn, a
dependency of kda_sessions, so installed wherever the eval runs) is held out by its hash.

    make_general_row(rng, split, max_len, tree_share) -> (ids, mask)     like tiny_data.make_row
    general_tasks(seed, n, tree) -> list[Task]     held-out phrasings over a held-out tree (kinds in turn)
    off_task_tasks(seed, n, tree) -> list[Task]    held-out off-task messages after 0-2 tasks over that tree
"""

from __future__ import annotations

import copy
import random
import re
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

from kda_sessions.tools import ToolError
from tools import tiny_phrasing as grammar
from tools.tiny_data import (
    _DEF_RE,
    FILL_SLACK,
    FIRST_DEF_PATTERN,
    LINE_READ_LIMITS,
    RECALL_DISTANCE,
    RENAMED_FRACTION,
    SKIP_PARTS,
    SYSTEM,
    Corpus,
    Message,
    RenamedCorpus,
    Task,
    _Episode,
    _episode,
    _grep_episode,
    _list_episode,
    _name_words,
    _note_episode,
    _plain_row,
    _recall_episode,
    corpus,
    draw_distance,
    header_ids,
    numbered_lines,
    plain_words,
    render,
    split_of,
    tool_call,
)

REFUSAL = grammar.REFUSAL
HELDOUT_TREES = ("httpx", "httpx2")  # besides the hashed ones: the tree issue 31 was measured on, and its fork
EVAL_TREE = "uvicorn"
MIN_TREE_FILES = 8
MAX_TREE_FILES = 1500  # larger trees (torch, openai) take seconds to load into each data worker
GENERAL_KINDS = ("read_file", "grep", "list_dir", "multi_step")
# shares of a general row's episodes: a rephrased tool task, multi-step, a tool error corrected, off-task
MIX = {"task": 0.40, "multi": 0.33, "error": 0.11, "off_task": 0.16}
TRAIN_TYPO = 0.2  # of training questions with one mistyped word (held-out questions keep the grammar's 0.1)
RENAMED_TREE_FRACTION = 0.5  # of training rows on a package tree: its files and folders under new names
# EVAL_TREE's folder and file stems, excluded from copy-drill words on machines without it installed too (the GPU
# image that makes the training rows); heldout_names adds those of every held-out tree installed
EVAL_TREE_NAMES = (
    "_ansi", "_compat", "_subprocess", "_types", "_version", "asgi2", "asyncio", "auto", "auto_zttp_impl",
    "basereload", "config", "flow_control", "h11_impl", "http", "httptools_impl", "importer", "lifespan", "logging",
    "loops", "main", "message_logger", "middleware", "multiprocess", "off", "on", "protocols", "proxy_headers", "server",
    "statreload", "supervisors", "utils", "uvicorn", "uvloop", "watchfilesreload", "websockets", "websockets_impl",
    "websockets_sansio_impl", "workers", "wsgi", "wsproto_impl", "zttp_h2_impl", "zttp_impl", "zuvloop",
)
COPY_DEFS = 0.7  # of a copy-drill project's files: definitions renamed with the project's words (``copy_corpus``)
MAX_MISSES = 12  # episodes that did not fit before a row ends (a small tree runs out of unused files)
_ANSWER_NAME_RE = re.compile(r"(?:contains|has no) (.+)\.$")
# focus rows (``focus`` of make_general_row), aimed at the held-out failures of the shipped weights: folder names
# garbled inside paths, a made-up answer after a call that found nothing, `def X` for "the class X", count
# questions answered as "the first entry". Shares of a focus row's episodes:
FOCUS_MIX = {"task": 0.33, "intent": 0.20, "error": 0.27, "multi": 0.12, "off_task": 0.08}
FOCUS_KINDS = {"grep": 0.45, "read_line": 0.25, "read_file": 0.10, "list_dir": 0.20}  # of its tool tasks
FOCUS_SIBLINGS = 0.5  # of focus rows: a project named with plain words in groups that share their first letters
FOCUS_NAME_MIX = (0.75, 0.9)  # their names: 75% one plain word ("loops"), 15% two joined by "_", 10% word + number
ABSENT = 0.1  # of focus error episodes: a grep of the right path for a name it lacks (empty output), answered "No"
# listing rows (``listing`` of make_general_row), aimed at the two held-out failures the focus rows left: a count
# question that says "the listing of D" answered with the first entry, and a name garbled toward a word of the
# context sentence ("tell me" -> `tellvansiol.py`). Shares of a listing row's episodes:
LISTING_MIX = {"drill": 0.45, "lure": 0.30, "lure_error": 0.15, "multi": 0.05, "off_task": 0.05}
MAX_COUNTED = 10  # tiny_data asks for a count only in folders of this many entries or fewer
MIN_LISTING_DIRS = 4  # a listing row's project has at least this many folders (``listing_corpus``)
_WORD_RE = re.compile(r"[A-Za-z]{3,}")
_FIX_INTRO = {  # the corrected call's text, by what went wrong
    "path": ["", "", "That path is not the one in the question; trying again.", "Wrong path; fixing the call.",
             "I mistyped the path. Again, with the path from the question."],
    "empty": ["", "", "No output: that path does not exist. Trying again with the path from the question.",
              "Nothing found there: I mistyped the path.", "Empty result; the path was wrong."],
    "what": ["", "No match: the question asks for `{pat}`.", "Nothing found; the pattern must be `{pat}`."],
    "tool": ["", "Wrong tool; fixing the call.", "That was the wrong path for {tool}; fixing the call."],
}
_CORRECT_INTRO = ["", "", "That call failed. Trying again.", "Wrong path; fixing the call.", "Let me fix that."]


def tree_split(name: str) -> str:
    """'heldout' for a package tree never used in training, else 'train'."""
    return "heldout" if name in HELDOUT_TREES or split_of(f"tree:{name}") == "heldout" else "train"


@lru_cache(maxsize=1)
def package_trees() -> dict[str, str]:
    """name -> folder of each installed package tree (site-packages / dist-packages folders of sys.path and the
    interpreter's purelib and platlib): a folder with ``__init__.py`` and MIN_TREE_FILES to MAX_TREE_FILES .py
    files outside tests, not kda_sessions."""
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"]} | {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    out: dict[str, str] = {}
    for root in sorted(roots):
        base = Path(root)
        if not base.is_dir():
            continue
        for d in sorted(base.iterdir()):
            if d.name in out or d.name == "kda_sessions" or not (d / "__init__.py").is_file():
                continue
            n = 0
            for p in d.rglob("*.py"):
                n += not SKIP_PARTS.intersection(p.relative_to(d).parts[:-1])
                if n > MAX_TREE_FILES:
                    break
            if MIN_TREE_FILES <= n <= MAX_TREE_FILES:
                out[d.name] = str(d.resolve())
    return out


@lru_cache(maxsize=1)
def rename_words() -> tuple[str, ...]:
    """What renamed projects of general rows name their files and folders with: plain English words of the stdlib's
    comments ("middleware", "supervisors") and the words of its definition names (tiny_data's renamed projects)."""
    return tuple(sorted(set(plain_words()) | set(_name_words())))


@lru_cache(maxsize=1)
def heldout_names() -> frozenset[str]:
    """Every folder and file stem of the held-out package trees, singular and plural: no copy-drill word is one,
    so the general eval's folder names (``middleware``, ``supervisors``) stay unseen in training."""
    stems = set(EVAL_TREE_NAMES)
    for name in trees("heldout"):
        c = tree_corpus(name, whole=True)
        stems |= {name} | {part.removesuffix(".py") for rel in c.files["heldout"] + c.dirs["heldout"]
                           for part in rel.split("/")}
    names: set[str] = set()
    for stem in map(str.lower, stems):
        names |= {stem, stem.removesuffix("s"), stem + "s"}
    return frozenset(n for n in names if n)


_TECH = (
    "http", "proto", "sock", "async", "json", "yaml", "toml", "cfg", "auth", "token", "cache", "queue", "worker",
    "handler", "loader", "router", "server", "client", "stream", "buffer", "codec", "parser", "lexer", "reload",
    "watch", "event", "signal", "config", "gateway", "adapter", "backend", "frontend", "schema", "plugin",
    "registry", "daemon", "scheduler", "dispatch", "socket", "tcp", "udp", "grpc", "rpc", "sql", "orm", "blob",
    "shard", "replica", "cluster", "metrics", "tracing", "telemetry", "session", "cookie", "header", "payload",
    "serializer", "validator", "pipeline", "executor", "runtime", "kernel", "tensor", "vector", "matrix",
)
_ONSETS = ("b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl",
           "pr", "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z", "x", "sp", "sk")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "io")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "x", "nd", "rt", "st", "ck", "ng")
_DOT_TAILS = ("d", "v2", "local", "old", "new", "core", "api", "ext", "impl", "base", "dev", "tmp")


@lru_cache(maxsize=1)
def _long_plain() -> tuple[str, ...]:
    return tuple(w for w in plain_words() if len(w) >= 7)


def _made_up(rng: random.Random) -> str:
    """A pronounceable word nobody wrote: 2-4 syllables ("draveloumst", "quistrapen")."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randrange(2, 5)))


def copy_word(rng: random.Random) -> str:
    """One long name for a copy drill: a long plain English word, a compound of plain and technical words, a
    made-up word, CamelCase or camelCase, with digits, with underscores, or dotted. Never a held-out tree's name."""
    long_plain = _long_plain()
    while True:
        def part() -> str:
            k = rng.random()
            return rng.choice(long_plain) if k < 0.4 else rng.choice(_TECH) if k < 0.7 else _made_up(rng)

        k = rng.random()
        if k < 0.18:
            w = rng.choice(long_plain) + rng.choice(("", "", "s", "ers", "ing", "ed"))
        elif k < 0.36:
            w = part() + part()
        elif k < 0.58:
            w = _made_up(rng)
        elif k < 0.72:
            parts = [part() for _ in range(rng.randrange(2, 4))]
            w = "".join(x.capitalize() for x in parts)
            w = w if rng.random() < 0.6 else w[0].lower() + w[1:]
        elif k < 0.84:
            n = str(rng.choice((2, 3, 8, 11, 16, 32, 64, rng.randrange(100, 1000))))
            a, b = part(), part()
            w = rng.choice((a + n, a + n + b, f"{a}_{n}", f"v{n}{a}"))
        elif k < 0.93:
            w = rng.choice((f"_{part()}", f"{part()}_{part()}_{part()}", f"{part()}__{part()}"))
        else:
            w = f"{part()}.{rng.choice(_DOT_TAILS) if rng.random() < 0.6 else part()}"
        if 7 <= len(w) <= 22 and w.lower() not in heldout_names() and not w.endswith(".py"):
            return w


def copy_words(rng: random.Random, n: int = 160) -> tuple[str, ...]:
    """``n`` distinct ``copy_word``s: the vocabulary of one copy-drill project."""
    out: dict[str, None] = {}
    while len(out) < n:
        out[copy_word(rng)] = None
    return tuple(out)


def copy_corpus(rng: random.Random, name: str | None) -> RenamedCorpus:
    """A copy drill: package tree ``name`` (or the stdlib) renamed with a fresh ``copy_words`` vocabulary, folders,
    files and (COPY_DEFS of the files) definitions, so every path a call names, every line an answer quotes and
    every pattern a grep asks for holds long words seen nowhere else: only byte-for-byte copying gets them right."""
    base = tree_corpus(name) if name is not None else corpus()
    if len(base.dirs["train"]) <= 2 or not base.files["train"]:
        base = corpus()
    words = copy_words(rng)
    return RenamedCorpus(rng, base, words=words, near_miss_defs=COPY_DEFS, def_words=words)


def trees(split: str) -> list[str]:
    return [n for n in package_trees() if tree_split(n) == split]


@lru_cache(maxsize=32)
def tree_corpus(name: str, whole: bool = False) -> Corpus:
    """The tree's corpus; ``whole``: every file and folder under "heldout" (a held-out tree is held out whole)."""
    c = corpus(package_trees()[name])
    if not whole:
        return c
    w = copy.copy(c)
    w.files = {"train": [], "heldout": sorted(c.files["train"] + c.files["heldout"])}
    w.dirs = {"train": [], "heldout": sorted(c.dirs["train"] + c.dirs["heldout"])}
    return w


# ---- episodes -------------------------------------------------------------------------------------------------


def _intent(ep: _Episode) -> tuple[str, dict[str, str]]:
    """The grammar intent and slots of a tiny_data episode."""
    a = ep.arguments
    if ep.kind == "read_file":
        if ep.variant == "line":
            return "line", {"p": a["path"], "n": str(a["start"])}
        return "first_def", {"p": a["path"]}
    if ep.kind == "grep":
        what, name = a["pattern"].split(" ", 1)
        return "def_line", {"p": a["path"], "pat": a["pattern"], "what": what, "name": name}
    d = a["path"]
    if ep.variant == "has":
        m = _ANSWER_NAME_RE.search(ep.messages[-1]["content"])
        assert m, ep.messages[-1]["content"]
        return "has", {"d": d, "x": m.group(1)}
    return ep.variant, {"d": d}


def _question(rng: random.Random, intent: str, slots: dict[str, str], split: str) -> tuple[str, str]:
    """grammar.question with more typos in training: a slip next to a folder name garbled the name it copied."""
    if split == "train":
        return grammar.question(rng, intent, slots, split, typo=TRAIN_TYPO)
    return grammar.question(rng, intent, slots, split)


def rephrase(rng: random.Random, ep: _Episode, split: str) -> _Episode:
    """The episode asked in a grammar phrasing of ``split``; ``template`` names the phrasing."""
    intent, slots = _intent(ep)
    return _asked(ep, *_question(rng, intent, slots, split))


def _asked(ep: _Episode, text: str, tid: str) -> _Episode:
    """``ep`` with its question worded as ``text``, by the template ``tid``."""
    messages = [{**ep.messages[0], "content": text}, *ep.messages[1:]]
    ids, mask = render(messages, ep.fact)
    out = copy.copy(ep)
    out.messages, out.ids, out.mask = messages, ids, mask
    out.template = tid
    return out


def _first_py(c: Corpus | RenamedCorpus, d: str, split: str) -> tuple[list[str], str] | None:
    """(entries of folder d, path of its first Python file), that file being in ``split``; else None."""
    entries = c.entries(d)
    first = next((e for e in entries if e.endswith(".py")), None)
    if first is None:
        return None
    rel = first if d == "." else f"{d}/{first}"
    return (entries, rel) if rel in c.files[split] else None


def multi_step_episode(rng: random.Random, c: Corpus | RenamedCorpus, split: str, budget: int) -> _Episode | None:
    """List a folder, then grep its first Python file for definitions (or read a line of it), then answer. On a
    renamed project the folder is one that holds renamed files (its listed folders hold empty entries), so the
    folder's and the file's new names must be copied from the question and the listing."""
    dirs = c.holders() if isinstance(c, RenamedCorpus) else c.dirs[split]
    if not dirs:
        return None
    for _ in range(6):
        d = rng.choice(dirs)
        found = _first_py(c, d, split)
        if found is None:
            continue
        entries, rel = found
        listing = "\n".join(entries)
        shown = "the project root" if d == "." else f"{d}/"
        if rng.random() < 0.5:
            args2: dict[str, Any] = {"pattern": FIRST_DEF_PATTERN, "path": rel}
            out2 = c.call("grep", **args2)
            m = _DEF_RE.match(out2.split("\n", 1)[0].split(": ", 1)[-1]) if out2 else None
            if m is None:
                continue
            what = "function" if m.group(1) == "def" else "class"
            intent, slots, fact = "dir_first_def", {"d": d}, m.group(2)
            answer = f"The first Python file of {shown} is {rel.rsplit('/', 1)[-1]}; the first {what} defined in it is `{fact}`."
            tool2 = "grep"
        else:
            lines = [(n, s.strip()) for n, s in numbered_lines(c.call("read_file", path=rel)) if s.strip() and len(s) <= 100]
            if not lines:
                continue
            n, fact = rng.choice(lines)
            args2 = {"path": rel, "start": n, "limit": LINE_READ_LIMITS[n % len(LINE_READ_LIMITS)]}
            out2 = c.call("read_file", **args2)
            intent, slots, tool2 = "dir_line", {"d": d, "n": str(n)}, "read_file"
            answer = f"Line {n} of {rel} is: {fact}"
        text, tid = _question(rng, intent, slots, split)
        call1, call2 = tool_call("list_dir", {"path": d}), tool_call(tool2, args2)
        call2["id"] = call2["id"].replace(":0", ":1")
        messages: list[Message] = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "", "tool_calls": [call1]},
            {"role": "tool", "tool_call_id": call1["id"], "content": listing},
            {"role": "assistant", "content": "", "tool_calls": [call2]},
            {"role": "tool", "tool_call_id": call2["id"], "content": out2},
            {"role": "assistant", "content": answer},
        ]
        ids, mask = render(messages, fact)
        if len(ids) > budget:
            continue
        return _Episode("multi_step", intent, messages, ids, mask, "list_dir", {"path": d}, fact, template=tid)
    return None


def _typo_path(rng: random.Random, p: str) -> str:
    """The path with one letter of its last part dropped (the kind of slip a copy makes)."""
    head, _, last = p.rpartition("/")
    i = rng.randrange(len(last) - 1) if len(last) > 1 else 0
    return (head + "/" if head else "") + last[:i] + last[i + 1:]


def _wrong_call(rng: random.Random, ep: _Episode) -> tuple[str, dict[str, Any]]:
    """A plausible wrong call for the episode's task: the other tool on the same path, a path with a letter
    dropped, or (grep) a pattern that does not compile."""
    tool, args = ep.tool, dict(ep.arguments)
    assert tool is not None
    k = rng.randrange(3)
    if k == 0:
        return ("read_file", {"path": args["path"]}) if tool == "list_dir" else ("list_dir", {"path": args["path"]})
    if k == 1 and tool == "grep":
        return "grep", {**args, "pattern": args["pattern"] + "("}
    return tool, {**args, "path": _typo_path(rng, args["path"])}


def error_episode(rng: random.Random, c: Corpus | RenamedCorpus, ep: _Episode) -> _Episode | None:
    """``ep`` with a failing call before its right one: the wrong call's turn has mask 0 (only the recovery is
    learnt), the error is the real tool's message as ``error: ...``."""
    name, args = _wrong_call(rng, ep)
    try:
        c.tools.call(name, args)
        return None  # the slip happened to name something real
    except ToolError as e:
        error = f"error: {e}"
    return _retried(ep, tool_call(name, args), error, rng.choice(_CORRECT_INTRO), f"error:{ep.variant}")


def _retried(ep: _Episode, call: dict, output: str, intro: str, variant: str) -> _Episode:
    """``ep`` after a first ``call`` that got ``output`` from the tool (out of the loss): then ``ep``'s own call,
    said with ``intro``, its result and its answer."""
    right = ep.messages[1]
    right = {**right, "content": intro,
             "tool_calls": [{**right["tool_calls"][0], "id": right["tool_calls"][0]["id"].replace(":0", ":1")}]}
    result = {**ep.messages[2], "tool_call_id": right["tool_calls"][0]["id"]}
    head = [ep.messages[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    tail = [{"role": "tool", "tool_call_id": call["id"], "content": output}, right, result, *ep.messages[3:]]
    ids1, _ = render(head)
    ids2, mask2 = render(tail, ep.fact)
    out = copy.copy(ep)
    out.messages, out.ids, out.mask = head + tail, ids1 + ids2, [0] * len(ids1) + mask2
    out.variant = variant
    return out


def off_task_episode(rng: random.Random, split: str) -> _Episode:
    text, tid = grammar.off_task(rng, split)
    messages: list[Message] = [{"role": "user", "content": text}, {"role": "assistant", "content": REFUSAL}]
    ids, mask = render(messages)
    return _Episode("off_task", tid, messages, ids, mask, None, {}, REFUSAL, template=tid)


def general_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, split: str, budget: int, used: set[str]
) -> _Episode | None:
    """One episode of a shape drawn from MIX, fitting ``budget`` tokens."""
    shape = rng.choices(list(MIX), list(MIX.values()))[0]
    if shape == "off_task":
        ep: _Episode | None = off_task_episode(rng, split)
    elif shape == "multi":
        ep = multi_step_episode(rng, c, split, budget)
    else:
        ep = _episode(rng, c, split, budget, used)
        if ep is not None:
            ep = rephrase(rng, ep, split)
            if shape == "error":
                ep = error_episode(rng, c, ep)
    return ep if ep is not None and len(ep.ids) <= budget else None


# ---- focus rows: the held-out failures of the shipped weights, in training shapes -------------------------------


@lru_cache(maxsize=1)
def _prefix_groups() -> tuple[tuple[str, ...], ...]:
    """Plain words (``rename_words``, 4+ letters, never a held-out tree's name) in groups of 4 or more that share
    their first 2 or 3 letters ("locations", "locks", "logger", "lookup")."""
    held = heldout_names()
    words = [w for w in rename_words() if len(w) >= 4 and w.isalpha() and w not in held]
    out: list[tuple[str, ...]] = []
    for n in (2, 3):
        groups: dict[str, list[str]] = {}
        for w in words:
            groups.setdefault(w[:n], []).append(w)
        out += [tuple(g) for _, g in sorted(groups.items()) if len(g) >= 4]
    return tuple(out)


def sibling_words(rng: random.Random, n_groups: int = 6, per_group: int = 6) -> tuple[str, ...]:
    """A project's vocabulary: ``per_group`` words of each of ``n_groups`` prefix groups, so that the project's
    folders and files start alike ("loaders/", "locations/", "lookup/") and only copying a name to its end
    names the right one (the shipped weights wrote ``protcaps`` for ``protocols``, ``linear`` for ``lifespan``)."""
    groups = _prefix_groups()
    out: dict[str, None] = {}
    for g in rng.sample(groups, n_groups):
        out |= dict.fromkeys(rng.sample(g, min(per_group, len(g))))
    return tuple(out)


def focus_corpus(rng: random.Random, tree_share: float) -> Corpus | RenamedCorpus:
    """A focus row's project: FOCUS_SIBLINGS of them a training tree (or the stdlib) renamed with
    ``sibling_words`` (FOCUS_NAME_MIX: mostly single plain words, as other projects name folders), else
    ``row_corpus``'s draw (no copy drill)."""
    if rng.random() < FOCUS_SIBLINGS:
        name = row_tree(rng, "train", tree_share)
        base = tree_corpus(name) if name is not None else corpus()
        if len(base.dirs["train"]) <= 2 or not base.files["train"]:
            base = corpus()
        return RenamedCorpus(rng, base, words=sibling_words(rng), name_mix=FOCUS_NAME_MIX)
    return row_corpus(rng, "train", tree_share)


def project_words(c: Corpus | RenamedCorpus) -> tuple[str, ...]:
    """Folder and file stems of the project (its training paths): what the context before a focus question names
    now and then, so that a call copies the question's path and not a name said before it."""
    paths = (c.files["train"] + c.dirs["train"]) if isinstance(c, RenamedCorpus) else c.dirs["train"]
    parts = {x.removesuffix(".py") for rel in paths for x in rel.split("/")}
    return tuple(sorted(w for w in parts if len(w) >= 3 and w not in (".", "__init__", "__main__")))


def focus_rephrase(rng: random.Random, ep: _Episode, words: tuple[str, ...]) -> _Episode:
    """``rephrase`` in training phrasings with the EXTRA templates and context sentences naming ``words``."""
    intent, slots = _intent(ep)
    return _asked(ep, *grammar.question(rng, intent, slots, "train", typo=TRAIN_TYPO, extra=True, words=words))


def _focus_tool_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], kind: str | None = None
) -> _Episode | None:
    """A tool task of a kind drawn from FOCUS_KINDS (or ``kind``); a grep asks for a class or a function alike
    (files define more functions: "the definition of the class X" was grepped as ``def X``)."""
    kind = kind or rng.choices(list(FOCUS_KINDS), list(FOCUS_KINDS.values()))[0]
    if kind != "grep":
        return _episode(rng, c, "train", budget, used, kind)
    what = rng.choice(("def", "class"))
    for _ in range(10):
        rel = rng.choice(c.files["train"])
        if rel in used:
            continue
        ep = _grep_episode(rng, c, rel, what)
        if ep is not None and len(ep.ids) <= budget:
            used.add(rel)
            return ep
    return None


def intent_drill(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...]
) -> _Episode | None:
    """Two or three questions about one folder, each of another list_dir intent (how many entries, the first
    entry, does it contain X) in EXTRA phrasings, each answered after its own list_dir call: the question, not the
    folder, decides the answer's form."""
    dirs = c.dirs["train"] + (c.holders() if isinstance(c, RenamedCorpus) else [])
    for _ in range(6):
        d = rng.choice(dirs)
        if d in used or len(c.call("list_dir", path=d)) + 600 > budget:
            continue
        variants = ["count", "first", "has"]
        rng.shuffle(variants)
        eps = [ep for v in variants[: rng.choice((2, 3))] if (ep := _list_episode(rng, c, d, "train", v)) is not None]
        if len(eps) < 2:
            continue
        eps = [focus_rephrase(rng, ep, words) for ep in eps]
        ids = [t for ep in eps for t in ep.ids]
        if len(ids) > budget:
            continue
        used.add(d)
        last = eps[-1]
        return _Episode("list_dir", "drill:" + "+".join(ep.variant for ep in eps),
                        [m for ep in eps for m in ep.messages], ids, [m for ep in eps for m in ep.mask],
                        "list_dir", {"path": d}, last.fact, template=last.template)
    return None


def _exists(c: Corpus | RenamedCorpus, path: str) -> bool:
    """Whether ``path`` names a file or folder of the project (a renamed project's, made or not yet made)."""
    if isinstance(c, RenamedCorpus):
        names = set(c.real) | set(c.holders()) | set(c.files["train"])
        if path in names or any(n.startswith(path + "/") for n in names):
            return True
    return (c.root / path).exists()


@lru_cache(maxsize=1)
def _garble_words() -> tuple[str, ...]:
    """``rename_words`` but the held-out trees' names: a garbled call never writes an eval folder's name."""
    held = heldout_names()
    return tuple(w for w in rename_words() if w not in held)


def garble(rng: random.Random, part: str, question: str) -> str:
    """``part`` of a path (a folder name, or a file's stem) as a bad copy writes it, the ways the shipped weights
    did: its first letters run on into another word (``protocols`` -> ``protcaps``), another word with the same
    start (``lifespan`` -> ``linear``), a word of the question's context pasted in (``loops`` -> ``tenmultis``
    after "in ten minutes"), or a letter dropped, swapped or doubled."""
    words = _garble_words()
    qwords = [w for w in _WORD_RE.findall(question) if w.lower() not in part.lower()]
    for _ in range(12):
        k = rng.random()
        if k < 0.35 and len(part) >= 4:
            w = rng.choice(words)
            j = rng.randrange(len(w))
            new = part[: rng.randrange(2, len(part) - 1)] + w[j : j + rng.randrange(2, 7)]
        elif k < 0.6:
            same = [w for w in words if w[:2] == part[:2].lower() and w != part]
            if not same:
                continue
            new = rng.choice(same)
        elif k < 0.8 and qwords:
            w = rng.choice(qwords).lower()
            new = w[: rng.randrange(2, len(w) + 1)] + part[rng.randrange(1, len(part)) :] if len(part) > 1 else w
        elif len(part) >= 3:
            new = grammar._typo(rng, part)
        else:
            continue
        if new and new != part and "/" not in new and new.strip(".") and not new.startswith("-"):
            return new
    return part + "s" if not part.endswith("s") else part[:-1]


def _garbled_path(rng: random.Random, path: str, question: str, folder: bool) -> str:
    """``path`` with one part garbled: mostly a folder part (the first one most often), else the last part (a
    file's stem, its ``.py`` kept). ``folder``: the path names a folder (every part is one)."""
    parts = path.split("/")
    n_dirs = len(parts) if folder else len(parts) - 1
    if n_dirs and rng.random() < 0.8:
        i = 0 if rng.random() < 0.7 else rng.randrange(n_dirs)
        parts[i] = garble(rng, parts[i], question)
    else:
        stem, dot, ext = parts[-1].partition(".")
        parts[-1] = garble(rng, stem, question) + dot + ext if stem else garble(rng, parts[-1], question)
    return "/".join(parts)


def _focus_wrong_call(rng: random.Random, ep: _Episode) -> tuple[str, dict[str, Any], str] | None:
    """(tool, arguments, what went wrong: "path", "what" or "tool") of a wrong first call for ``ep``."""
    tool, args = ep.tool, dict(ep.arguments)
    assert tool is not None
    question = ep.messages[0]["content"]
    k = rng.random()
    if tool == "grep" and ep.variant == "def_line" and k < 0.25:  # `def X` for "the class X", and back
        what, name = args["pattern"].split(" ", 1)
        return tool, {**args, "pattern": f"{'def' if what == 'class' else 'class'} {name}"}, "what"
    if tool == "list_dir" and ep.variant == "has" and k < 0.25:  # the entry asked about listed, not the folder
        m = _ANSWER_NAME_RE.search(ep.messages[-1]["content"])
        return (tool, {"path": m.group(1)}, "tool") if m else None
    if tool == "read_file" and k < 0.1:
        return "list_dir", {"path": args["path"]}, "tool"
    path = _garbled_path(rng, args["path"], question, folder=tool == "list_dir")
    return tool, {**args, "path": path}, "path"


def focus_error_episode(rng: random.Random, c: Corpus | RenamedCorpus, ep: _Episode) -> _Episode | None:
    """``ep`` (a focus-phrased tool task) with a wrong call first (``_focus_wrong_call``: a garbled folder or file
    name, the wrong kind of definition, the wrong path for the tool) that the real tool answers with its
    ``error: ...`` (read_file, list_dir) or, for a grep of a path that does not exist or a pattern the file lacks,
    with nothing (``Tools.grep`` returns an empty output, as in the eval). Then the corrected call, its output and
    the answer. The wrong turn has mask 0: only the correction and the answer are learnt, never an answer after a
    failed call."""
    for _ in range(4):
        wrong = _focus_wrong_call(rng, ep)
        if wrong is None:
            continue
        name, args, why = wrong
        failed = _failure(c, ep, name, args, why)
        if failed is not None:
            out, why = failed
            break
    else:
        return None
    intro = rng.choice(_FIX_INTRO[why]).format(pat=ep.arguments.get("pattern", ""), tool=name)
    return _retried(ep, tool_call(name, args), out, intro, f"error:{why}:{ep.variant}")


def _failure(
    c: Corpus | RenamedCorpus, ep: _Episode, name: str, args: dict[str, Any], why: str
) -> tuple[str, str] | None:
    """(the real tool's output, what went wrong) of the wrong call ``name(args)`` for ``ep``: ``error: ...``, or the
    empty output of a grep of a path that does not exist ("empty") or a pattern the file lacks; None where the call
    is ``ep``'s own, names something real, or succeeds."""
    if args == ep.arguments and name == ep.tool:
        return None
    if why == "path" and _exists(c, args["path"]):
        return None  # the slip named something real: no error to recover from
    try:
        out = c.tools.call(name, args)
    except ToolError as e:
        return f"error: {e}", why
    if out != "" or why == "tool":  # a grep that finds nothing is the only failure without an error
        return None
    return out, "empty" if why == "path" else why


def absent_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...]
) -> _Episode | None:
    """A grep of the right file for a definition it does not have (a name of another file): the output is empty
    and the answer says so, quoting no line: an answer comes from what the tool showed, and an empty output after
    the question's own path is not a path to fix."""
    files = c.files["train"]
    for _ in range(6):
        rel, other = rng.choice(files), rng.choice(files)
        defs = [d for d in c.defs(other) if not d[1].startswith("_")]
        if rel in used or rel == other or not defs:
            continue
        what, name = rng.choice(defs)
        pattern = f"{what} {name}"
        if re.search(rf"\b{re.escape(name)}\b", c.texts[rel]) or c.call("grep", pattern=pattern, path=rel) != "":
            continue
        call = tool_call("grep", {"pattern": pattern, "path": rel})
        text, tid = grammar.question(rng, "def_line", {"p": rel, "pat": pattern, "what": what, "name": name},
                                     "train", typo=TRAIN_TYPO, extra=True, words=words)
        answer = f"No: grep finds no `{pattern}` in {rel}, so it is not defined there."
        messages: list[Message] = [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": ""},
            {"role": "assistant", "content": answer},
        ]
        ids, mask = render(messages, "No")
        if len(ids) > budget:
            continue
        used.add(rel)
        return _Episode("grep", "absent", messages, ids, mask, "grep", {"pattern": pattern, "path": rel}, "No",
                        template=tid)
    return None


_SHARED_SHAPES = ("off_task", "multi")
"""Episode shapes focus and listing rows draw alike."""


def _shared_shape(rng: random.Random, c: Corpus | RenamedCorpus, budget: int, shape: str) -> _Episode | None:
    """An off-task refusal or a multi-step task (list, then read), the shapes of ``_SHARED_SHAPES``."""
    if shape == "off_task":
        return off_task_episode(rng, "train")
    return multi_step_episode(rng, c, "train", budget)


def focus_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...]
) -> _Episode | None:
    """One episode of a focus row, of a shape drawn from FOCUS_MIX, fitting ``budget`` tokens."""
    shape = rng.choices(list(FOCUS_MIX), list(FOCUS_MIX.values()))[0]
    ep: _Episode | None
    if shape in _SHARED_SHAPES:
        ep = _shared_shape(rng, c, budget, shape)
    elif shape == "intent":
        ep = intent_drill(rng, c, budget, used, words)
    elif shape == "error" and rng.random() < ABSENT:
        ep = absent_episode(rng, c, budget, used, words)
    else:
        ep = _focus_tool_episode(rng, c, budget, used)
        if ep is not None:
            ep = focus_rephrase(rng, ep, words)
            if shape == "error":
                ep = focus_error_episode(rng, c, ep)
    return ep if ep is not None and len(ep.ids) <= budget else None


# ---- listing rows: "the listing of D" for every list_dir intent, context words that start like the path --------


def listing_corpus(rng: random.Random, tree_share: float) -> Corpus | RenamedCorpus:
    """A listing row's project: ``focus_corpus``'s, or on the stdlib where that is a package tree of fewer than
    MIN_LISTING_DIRS folders (``requests``, ``h11``: one folder of more than MAX_COUNTED entries, no count to ask,
    and a dozen files the row's tasks soon use up)."""
    c = focus_corpus(rng, tree_share)
    if len(c.dirs["train"]) + len(c.holders() if isinstance(c, RenamedCorpus) else []) < MIN_LISTING_DIRS:
        c = focus_corpus(rng, 0.0)
    return c


def listing_drill(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...]
) -> _Episode | None:
    """How many entries, and the first entry or whether it contains X or both, of one folder of MAX_COUNTED
    entries or fewer, in a shuffled order, every question in the words of LISTING_WORDS ("the listing of D", "D's
    listing"), each answered after its own list_dir call (the count numbered as tiny_data numbers it): the same
    words ask for all three, so only the question's intent decides the answer."""
    dirs = c.dirs["train"] + (c.holders() if isinstance(c, RenamedCorpus) else [])
    for _ in range(10):
        d = rng.choice(dirs)
        if d in used:
            continue
        listing = c.call("list_dir", path=d)
        if listing.count("\n") >= MAX_COUNTED or 2 * len(listing) + 300 > budget:
            continue
        variants = ["count", *rng.sample(["first", "has"], rng.choice((1, 2)))]
        rng.shuffle(variants)
        eps = [ep for v in variants if (ep := _list_episode(rng, c, d, "train", v)) is not None]
        if len(eps) < len(variants):
            continue
        eps = [_asked(ep, *grammar.question(rng, *_intent(ep), "train", typo=TRAIN_TYPO, extra=True, words=words,
                                            listing=True)) for ep in eps]
        ids = [t for ep in eps for t in ep.ids]
        if len(ids) > budget:
            continue
        used.add(d)
        last = eps[-1]
        return _Episode("list_dir", "listing:" + "+".join(ep.variant for ep in eps),
                        [m for ep in eps for m in ep.messages], ids, [m for ep in eps for m in ep.mask],
                        "list_dir", {"path": d}, last.fact, template=last.template)
    return None


_STEM_RE = re.compile(r"[^A-Za-z]*([A-Za-z]{2,})")


def path_stems(path: str) -> list[str]:
    """The letters each part of ``path`` starts with, lower-case, past leading underscores or digits (``_version.py``
    -> ``version``), for parts that start with two letters or more: what a lure word starts like."""
    out = []
    for part in path.split("/"):
        m = _STEM_RE.match(part.removesuffix(".py"))
        if m and part != ".":
            out.append(m.group(1).lower())
    return out


@lru_cache(maxsize=1)
def _lure_index() -> dict[str, tuple[str, ...]]:
    """Plain English words (``plain_words``, never a held-out tree's name) by their first 2, 3 and 4 letters."""
    held = heldout_names()
    index: dict[str, list[str]] = {}
    for w in plain_words():
        if w not in held:
            for k in (2, 3, 4):
                if len(w) > k:
                    index.setdefault(w[:k], []).append(w)
    return {k: tuple(v) for k, v in index.items()}


def lure_words(rng: random.Random, stems: list[str]) -> list[str]:
    """One or two plain words, each starting with the same 2-4 letters as one of ``stems`` (the first folder's most
    often) and not that stem; empty where no word starts like any of them."""
    out: list[str] = []
    for _ in range(rng.choice((1, 2))):
        stem = stems[0] if rng.random() < 0.5 else rng.choice(stems)
        for k in sorted({min(rng.choice((2, 3, 4)), len(stem)), 2}, reverse=True):
            if found := [w for w in _lure_index().get(stem[:k], ()) if w != stem]:
                out.append(rng.choice(found))
                break
    return out


def lure_garble(rng: random.Random, part: str, word: str) -> str:
    """``part`` of a path (a folder, or a file with its ``.py`` kept) as a copy that drifted into ``word`` writes
    it: the word itself (its leading underscore dropped or kept), the word run on into the part's tail, or the
    part's head run on into the word's tail (``loops`` after "look": ``look``, ``lookps``, ``loook``)."""
    stem, ext = (part[:-3], ".py") if part.endswith(".py") else (part, "")
    core = stem.lstrip("_0123456789")
    lead, word = stem[: len(stem) - len(core)], word.lower()
    j = next((i for i, (a, b) in enumerate(zip(core.lower(), word)) if a != b), min(len(core), len(word)))
    k = rng.random()
    if k < 0.35:
        new = word if rng.random() < 0.5 else lead + word
    elif k < 0.65:
        new = lead + word + core[j:]
    else:
        new = lead + core[: rng.randrange(j, len(core))] + word[j:] if j < len(core) else lead + word
    return (new if new != stem else lead + word + "s") + ext


def lure_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...],
    error: bool = False,
) -> _Episode | None:
    """A tool task (FOCUS_KINDS) asked after a ``lure_sentence``: context whose words start like the parts of the
    path the call must name, so a name finished from the context instead of copied from the question is wrong.
    ``error``: a first call with one part garbled toward such a word (``lure_garble``), answered by the real tool
    (an error, or a grep's empty output) and out of the loss, then the corrected call and the answer."""
    ep = _focus_tool_episode(rng, c, budget, used)
    if ep is None:
        return None
    stems = path_stems(ep.arguments["path"])
    picks = lure_words(rng, stems) if stems else []
    if not picks:
        return None
    sentence = grammar.lure_sentence(rng, stems, picks)
    intent, slots = _intent(ep)
    ep = _asked(ep, *grammar.question(rng, intent, slots, "train", typo=TRAIN_TYPO, extra=True, lure=sentence))
    if not error:
        ep.variant = f"lure:{ep.variant}"
        return ep
    assert ep.tool is not None
    parts = ep.arguments["path"].split("/")
    pairs = [(w, i) for w, s in grammar.lures_in(sentence, stems) for i, part in enumerate(parts)
             if part != "." and path_stems(part) == [s]]
    for _ in range(4):
        if not pairs:
            return None
        word, i = rng.choice(pairs)
        wrong = "/".join([*parts[:i], lure_garble(rng, parts[i], word), *parts[i + 1:]])
        failed = _failure(c, ep, ep.tool, {**ep.arguments, "path": wrong}, "path")
        if failed is not None:
            out, why = failed
            intro = rng.choice(_FIX_INTRO[why])
            return _retried(ep, tool_call(ep.tool, {**ep.arguments, "path": wrong}), out, intro,
                            f"lure_error:{why}:{ep.variant}")
    return None


def listing_episode(
    rng: random.Random, c: Corpus | RenamedCorpus, budget: int, used: set[str], words: tuple[str, ...]
) -> _Episode | None:
    """One episode of a listing row, of a shape drawn from LISTING_MIX, fitting ``budget`` tokens."""
    shape = rng.choices(list(LISTING_MIX), list(LISTING_MIX.values()))[0]
    ep: _Episode | None
    if shape in _SHARED_SHAPES:
        ep = _shared_shape(rng, c, budget, shape)
    elif shape == "drill":
        ep = listing_drill(rng, c, budget, used, words)
    else:
        ep = lure_episode(rng, c, budget, used, words, error=shape == "lure_error")
    return ep if ep is not None and len(ep.ids) <= budget else None


# ---- rows and tasks -------------------------------------------------------------------------------------------


def row_tree(rng: random.Random, split: str, tree_share: float) -> str | None:
    """For ``tree_share`` of rows, the name of a package tree of ``split``; else None (the stdlib)."""
    names = trees(split)
    return rng.choice(names) if names and tree_share and rng.random() < tree_share else None


def row_corpus(rng: random.Random, split: str, tree_share: float, copy: float = 0.0) -> Corpus | RenamedCorpus:
    """The package tree ``row_tree`` draws (in training its files split by path hash, held out: all of them), else
    the stdlib; in training, RENAMED_TREE_FRACTION of the tree rows and RENAMED_FRACTION of the stdlib rows under
    new names made of ``rename_words`` (tiny_data.RenamedCorpus), so that folder names must be copied; ``copy`` of
    the training rows are copy drills (``copy_corpus``; at 0 nothing is drawn for it)."""
    name = row_tree(rng, split, tree_share)
    if copy and split == "train" and rng.random() < copy:
        return copy_corpus(rng, name)
    if name is not None:
        # a held-out tree is held out whole: its own path-hash split can leave no held-out folder at all
        c = tree_corpus(name, whole=split == "heldout")
        if split == "train" and rng.random() < RENAMED_TREE_FRACTION and len(c.dirs["train"]) > 2 and c.files["train"]:
            return RenamedCorpus(rng, c, words=rename_words())
        return c
    if split == "train" and rng.random() < RENAMED_FRACTION:
        return RenamedCorpus(rng, corpus(), words=rename_words())
    return corpus()


def _recall_sources(
    rng: random.Random, c: Corpus | RenamedCorpus, split: str, max_len: int, distance: tuple[int, int],
    ids: list[int], mask: list[int], used: set[str], taken: set[str],
) -> list[list[Any]]:
    """1-3 facts to recall later (a user note, or a rephrased tool task), appended to ``ids`` / ``mask``; returns
    their questions as [ids, mask, target position, earliest position, distance], sorted by target, each target
    ``draw_distance(distance)`` tokens after its fact plus up to as much again (as tiny_data.make_row places them):
    the general rows then keep the recall that their larger share of training would otherwise wear off."""
    pending: list[list[Any]] = []
    for j in range(rng.choice((1, 2, 3))):
        d = draw_distance(rng, distance)
        room = max_len - len(ids) - d - 300 - 70 * (j + 1)
        if room < 100:
            continue
        source: _Episode | None
        if j > 0 or rng.random() < 0.6:
            source = _note_episode(rng, c, split, taken)
        else:
            source = _episode(rng, c, split, min(2500, room), used)
            source = rephrase(rng, source, split) if source is not None else None
        if source is None or not source.recall or len(source.ids) > room:
            continue
        ids += source.ids
        mask += source.mask
        q_ids, q_mask = _recall_episode(*rng.choice(source.recall))
        pending.append([q_ids, q_mask, len(ids) + d, len(ids) + d, d])
    reserve_all = sum(len(p[0]) for p in pending)
    for p in pending:
        slack = min(max_len - reserve_all - p[2], p[4])
        p[2] += rng.randrange(slack) if slack > 1 else 0
    return sorted(pending, key=lambda p: p[2])


def make_general_row(
    rng: random.Random, split: str, max_len: int, tree_share: float = 0.5, recall: float = 0.0,
    distance: tuple[int, int] = (RECALL_DISTANCE, RECALL_DISTANCE), copy: float = 0.0, focus: float = 0.0,
    listing: float = 0.0, recall_late: float = 0.0,
) -> tuple[list[int], list[int]]:
    """One row (ids, mask as tiny_data.make_row: 1 on the assistant's tokens but failed calls, 2 on facts): the
    header, then general episodes on one corpus (``row_corpus``) until the row is full. ``split`` picks the
    phrasings, trees, files and off-task messages. ``recall``: the share of rows that start with 1-3 facts (notes,
    tool results) asked about ``distance`` tokens later (``_recall_sources``); at 0 nothing is drawn for it.
    ``copy``: the share of training rows that are copy drills (``row_corpus``). ``focus``: the share of training
    rows that are focus rows (``focus_corpus``, ``focus_episode``; at 0 nothing is drawn for it, and a focus row is
    never a copy drill). ``listing``: the share of training rows that are listing rows (``listing_corpus``,
    ``listing_episode``), drawn by the same random number as ``focus`` (focus + listing <= 1; at 0 nothing is
    drawn for it). ``recall_late``: the share of rows with recall questions whose facts come after 1-3 of the
    row's episodes rather than right after the header (at 0 nothing is drawn for it). Every fact of the
    conversation rows before it stood first in its row (only tiny_data's drill rows spread short facts through the
    row), and the shipped model recalled from the row's first tool outputs: asked about its latest grep, after a
    listing and another grep, it gave the other grep's line (the demo's recall)."""
    if split not in grammar.SPLITS:
        raise ValueError(f"split must be one of {grammar.SPLITS}, got {split!r}")
    if not 0.0 <= tree_share <= 1.0:
        raise ValueError(f"tree_share must be in [0, 1], got {tree_share}")
    if not 0.0 <= recall <= 1.0:
        raise ValueError(f"recall must be in [0, 1], got {recall}")
    if not 0.0 <= copy <= 1.0:
        raise ValueError(f"copy must be in [0, 1], got {copy}")
    if not 0.0 <= focus <= 1.0:
        raise ValueError(f"focus must be in [0, 1], got {focus}")
    if listing < 0.0 or focus + listing > 1.0:
        raise ValueError(f"listing must be in [0, 1 - focus], got {listing} (focus {focus})")
    if not 0.0 <= recall_late <= 1.0:
        raise ValueError(f"recall_late must be in [0, 1], got {recall_late}")
    aimed = None  # "focus" or "listing": a row of focus_corpus's projects and that kind's episodes
    if (focus or listing) and split == "train":
        u = rng.random()
        aimed = "focus" if u < focus else "listing" if u < focus + listing else None
    if aimed:
        c = focus_corpus(rng, tree_share) if aimed == "focus" else listing_corpus(rng, tree_share)
    else:
        c = row_corpus(rng, split, tree_share, copy)
    words = project_words(c) if aimed else ()
    ids = list(header_ids())
    mask = [0] * len(ids)
    if len(ids) + 400 > max_len:  # no room for a task after the header: source text, as tiny_data does
        return _plain_row(rng, corpus(), split, max_len)
    used: set[str] = set()
    taken: set[str] = set()  # note things of this row: each asked about at most once

    def episode(budget: int) -> _Episode | None:
        if aimed == "focus":
            return focus_episode(rng, c, budget, used, words)
        if aimed == "listing":
            return listing_episode(rng, c, budget, used, words)
        return general_episode(rng, c, split, budget, used)

    pending: list[list[Any]] = []
    if recall and max_len - len(ids) >= distance[0] + 1000 and rng.random() < recall:
        if recall_late and rng.random() < recall_late:  # other episodes before the facts
            for _ in range(rng.choice((1, 2, 3))):
                budget = min(2500, max_len - len(ids) - distance[0] - 1500)
                ep = episode(budget) if budget >= 200 else None
                if ep is not None:
                    ids += ep.ids
                    mask += ep.mask
        if max_len - len(ids) >= distance[0] + 1000:
            pending = _recall_sources(rng, c, split, max_len, distance, ids, mask, used, taken)
    misses = 0
    while misses < MAX_MISSES:
        if pending and len(ids) >= pending[0][2]:
            q_ids, q_mask = pending.pop(0)[:2]
            ids += q_ids
            mask += q_mask
            continue
        budget = max_len - len(ids) - sum(len(p[0]) for p in pending)
        if budget < 200:
            break
        if pending:  # land near the next question's target, not thousands of tokens past it
            budget = min(budget, pending[0][2] - len(ids) + FILL_SLACK)
        ep = episode(budget)
        if ep is None and pending:  # nothing fits before the question: a short note carries the row on
            ep = _note_episode(rng, c, split, taken)
            ep = ep if ep is not None and len(ep.ids) <= budget else None
        if ep is None:
            misses += 1
            continue
        ids += ep.ids
        mask += ep.mask
    for q_ids, q_mask, _, earliest, _ in pending:  # the rest, if the row ran long enough and they fit
        if len(ids) >= earliest and len(ids) + len(q_ids) <= max_len:
            ids += q_ids
            mask += q_mask
    assert len(ids) == len(mask) <= max_len
    return ids, mask


def _history(rng: random.Random, c: Corpus) -> list[Message]:
    """The system prompt and 0-2 earlier held-out tasks, as in the in-template eval."""
    history: list[Message] = [{"role": "system", "content": SYSTEM}]
    used: set[str] = set()
    for _ in range(rng.randrange(3)):
        ep = _episode(rng, c, "heldout", 2000, used)
        if ep is not None:
            history += rephrase(rng, ep, "heldout").messages
    return history


def _eval_tree(tree: str | None) -> Corpus:
    name = tree or EVAL_TREE
    if name not in package_trees():
        raise RuntimeError(f"package tree {name!r} is not installed (installed: {sorted(package_trees())})")
    if tree_split(name) != "heldout":
        raise ValueError(f"tree {name!r} is used in training; held-out trees here: {trees('heldout')}")
    return tree_corpus(name, whole=True)


def general_tasks(seed: int, n: int, tree: str | None = None) -> list[Task]:
    """``n`` tasks in held-out phrasings over held-out tree ``tree`` (default EVAL_TREE), GENERAL_KINDS in turn."""
    c = _eval_tree(tree)
    rng = random.Random(seed)
    tasks: list[Task] = []
    for _ in range(50 * n + 100):
        if len(tasks) == n:
            break
        kind = GENERAL_KINDS[len(tasks) % len(GENERAL_KINDS)]
        history = _history(rng, c)
        if kind == "multi_step":
            ep = multi_step_episode(rng, c, "heldout", 6000)
        else:
            ep = _episode(rng, c, "heldout", 6000, set(), kind)
            ep = rephrase(rng, ep, "heldout") if ep is not None else None
        if ep is None:
            continue
        keep = ("path",) if ep.kind in ("read_file", "multi_step") else ("path", "pattern")
        args = {k: v for k, v in ep.arguments.items() if k in keep}
        tasks.append(Task(ep.kind, ep.variant, [*history, ep.messages[0]], ep.tool, args, ep.fact))
    if len(tasks) < n:
        raise RuntimeError(f"could not build {n} general tasks from {c.root}")
    return tasks


def off_task_tasks(seed: int, n: int, tree: str | None = None) -> list[Task]:
    """``n`` held-out off-task messages, each after 0-2 tasks over the held-out tree; the fact is REFUSAL."""
    c = _eval_tree(tree)
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        history = _history(rng, c)
        text, tid = grammar.off_task(rng, "heldout")
        tasks.append(Task("off_task", tid, [*history, {"role": "user", "content": text}], None, {}, REFUSAL))
    return tasks
