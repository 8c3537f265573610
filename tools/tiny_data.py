"""Synthetic coding-agent transcripts over the Python standard library: training rows and held-out tasks for
the built-in model ``tiny`` (issue 7).

Every transcript is rendered by the library's own chat template for the byte tokenizer, exactly as the engine
feeds a session (no BOS): tool declarations (``TOOL_SCHEMAS``) and the system prompt, then tasks. A task is a
user question about one file or directory, an assistant turn that calls one tool, the REAL output of
``kda_sessions.tools.Tools(stdlib)`` for that call, and a short final answer that states a fact copied from
that output. Recall tasks ask, thousands of tokens later, for a fact from an earlier tool output or user note;
they are answered without a tool call.

Files are split into train / held-out by a sha256 of their path relative to the stdlib root, so the split is
the same on every machine and Python version (only the set of files present differs).

    make_row(rng, split, max_len) -> (ids, mask)     one training row, mask 1 on the assistant's tokens
    eval_tasks(seed, n, kind)     -> list[Task]      held-out tasks for tools/eval_tiny.py
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kda_sessions.tokenizer import ByteTokenizer, encode_chat, encode_chat_delta
from kda_sessions.tokenizer.chat import GENERATION_PROMPT
from kda_sessions.tools import MAX_OUTPUT, TOOL_SCHEMAS, Tools

SYSTEM = "You are a careful coding agent. Use the tools to look at the project before you answer."
KINDS = ("read_file", "grep", "list_dir", "recall")
SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
MAX_FILE_BYTES = 200_000
SKIP_PARTS = frozenset({"test", "tests", "site-packages", "idlelib", "__pycache__"})
RECALL_DISTANCE = 2000  # tokens between the end of the fact's turn and the recall question, at least
PLAIN_FRACTION = 0.1
RENAMED_FRACTION = 0.5  # of train conversation rows: a project of real files under random names (RenamedCorpus)
RECALL_FRACTION = 0.6  # of conversation rows (each with 1-3 recall questions; some cannot be placed)
DENSE_RECALL_FRACTION = 0.4  # of recall rows: 4-8 facts (notes and short tool results) and a question for each

TOK = ByteTokenizer()
GEN_IDS: list[int] = TOK.encode(GENERATION_PROMPT, allow_special=True)
_DEF_RE = re.compile(r"^(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)", re.MULTILINE)
_ANY_DEF_RE = re.compile(r"^[ \t]*(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)", re.MULTILINE)

Message = dict[str, Any]


def split_of(rel: str) -> str:
    """'heldout' for about HELDOUT_PERCENT % of paths (stable: sha256 of the relative posix path), else 'train'."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


@dataclass
class Task:
    """One held-out question. ``messages`` starts with the system prompt and ends with the user's question;
    ``tool`` / ``arguments`` are the expected call (None / {} for recall: answer from the context), ``fact`` the
    string the final answer must contain; ``distance`` the tokens between the fact's turn and the question."""

    kind: str
    variant: str
    messages: list[Message]
    tool: str | None
    arguments: dict[str, str]
    fact: str
    distance: int = 0


@dataclass
class _Episode:
    """One task as messages plus its rendered ids and loss mask; ``recall`` holds later questions about it."""

    kind: str
    variant: str
    messages: list[Message]
    ids: list[int]
    mask: list[int]
    tool: str | None
    arguments: dict[str, str]
    fact: str
    recall: list[tuple[str, str, str]] = field(default_factory=list)  # (question, answer, fact)


# ---- the corpus ---------------------------------------------------------------------------------------------


class Corpus:
    """The stdlib's .py files and directories by split, with tool outputs cached (each file is read once)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
        self.tools = Tools(self.root)
        self.texts: dict[str, str] = {}
        files: dict[str, list[str]] = {s: [] for s in SPLITS}
        dirs_with_files: set[str] = set()
        for p in sorted(self.root.rglob("*.py")):
            rel = p.relative_to(self.root).as_posix()
            if SKIP_PARTS.intersection(rel.split("/")[:-1]) or not p.is_file():
                continue
            if p.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.texts[rel] = text
            files[split_of(rel)].append(rel)
            dirs_with_files.add(rel.rsplit("/", 1)[0] if "/" in rel else ".")
        self.files = files
        self.dirs: dict[str, list[str]] = {s: [] for s in SPLITS}
        for d in sorted(dirs_with_files):
            self.dirs["train" if d == "." else split_of(d + "/")].append(d)
        self._cache: dict[tuple[str, str, str], str] = {}
        self._defs: dict[str, list[tuple[str, str]]] = {}

    def call(self, name: str, **args: str) -> str:
        """The real tool's output, cached."""
        key = (name, args.get("pattern", ""), args.get("path", ""))
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = self.tools.call(name, args)
        return out

    def read_len(self, rel: str) -> int:
        """Bytes of read_file(rel)'s output (without reading it through the tool)."""
        return len(self.texts[rel][:MAX_OUTPUT].encode("utf-8"))

    def defs(self, rel: str) -> list[tuple[str, str]]:
        """(def|class, name) of every definition line in the file, in order."""
        d = self._defs.get(rel)
        if d is None:
            d = self._defs[rel] = [(m.group(1), m.group(2)) for m in _ANY_DEF_RE.finditer(self.texts[rel])]
        return d

    def entries(self, d: str) -> list[str]:
        return self.call("list_dir", path=d).split("\n")


@lru_cache(maxsize=4)
def corpus(root: str | None = None) -> Corpus:
    return Corpus(root)


@lru_cache(maxsize=1)
def _name_words() -> tuple[str, ...]:
    """Lower-case words of the corpus's definition names: the stuff random project names are made of."""
    c = corpus()
    words = {w for rel in c.files["train"] for _, n in c.defs(rel) for w in n.lower().split("_") if w.isalpha()}
    return tuple(sorted(w for w in words if 3 <= len(w) <= 9))


class RenamedCorpus:
    """A fresh project made of real train-split stdlib files and directory listings under random names.

    With only ~100 stdlib directories and ~1,500 files, the model can answer a training question by recalling
    a memorised name instead of copying it from the question, and then fails on held-out names (run 2 of
    docs/tiny.md wrote ``importlib/metadata`` for ``importlib``). Here every file and directory a row can use
    gets a random path, so only copying works. The tools still run for real: each file is written (same bytes)
    and each listed directory created (same entry names, empty) under a per-process temp root when a tool first
    touches it. Offers the parts of ``Corpus`` that episodes use; every path is in the "train" split."""

    def __init__(self, rng: random.Random, base: Corpus, n_files: int = 48, n_dirs: int = 12) -> None:
        import os
        import shutil
        import tempfile

        root = Path(tempfile.gettempdir()) / f"tiny_ws_{os.getpid()}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.root = root.resolve()
        self.tools = Tools(self.root)
        self.base = base
        words = _name_words()

        def name() -> str:
            k = rng.random()
            w = rng.choice(words)
            return w if k < 0.3 else f"{w}_{rng.choice(words)}" if k < 0.8 else f"{w}{rng.randrange(2, 100)}"

        taken: dict[str, str] = {}  # path -> "holder" (a folder of renamed files), "file" or "listing"

        def fresh(make: Any, kind: str) -> str:
            while True:
                n = make()
                clash = n in taken or any(t.startswith(n + "/") for t in taken) or any(
                    n.startswith(t + "/") and k != "holder" for t, k in taken.items()
                )
                if not clash:
                    taken[n] = kind
                    return n

        dir_names = [fresh(lambda: name() if rng.random() < 0.7 else f"{name()}/{name()}", "holder") for _ in range(n_dirs)]
        self.real: dict[str, str] = {}  # alias -> real rel (files) or real dir
        files = []
        for rel in rng.sample(base.files["train"], min(n_files, len(base.files["train"]))):
            real_base = rel.rsplit("/", 1)[-1]

            def make_file(real_base: str = real_base) -> str:
                d = rng.choice(dir_names)
                return f"{d}/{real_base if rng.random() < 0.4 else name() + '.py'}"

            alias = fresh(make_file, "file")
            self.real[alias] = rel
            files.append(alias)
        self.files = {"train": files, "heldout": []}
        self.texts = {a: base.texts[r] for a, r in self.real.items()}
        real_dirs = [d for d in base.dirs["train"] if d != "."]
        self.dirs: dict[str, list[str]] = {"train": [], "heldout": []}
        for d in rng.sample(real_dirs, min(n_dirs, len(real_dirs))):
            alias = fresh(lambda: name() if rng.random() < 0.6 else f"{name()}/{name()}", "listing")
            self.real[alias] = d
            self.dirs["train"].append(alias)
        self._made: set[str] = set()

    def _make(self, alias: str) -> None:
        if alias in self._made or alias not in self.real:
            return
        self._made.add(alias)
        p = self.root / alias
        if alias in self.texts:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(self.texts[alias].encode("utf-8"))
            return
        p.mkdir(parents=True, exist_ok=True)
        for e in self.base.entries(self.real[alias]):
            if e.endswith("/"):
                (p / e[:-1]).mkdir(exist_ok=True)
            elif e:
                (p / e).touch()

    def call(self, name: str, **args: str) -> str:
        self._make(args.get("path", ""))
        return self.tools.call(name, args)

    def read_len(self, rel: str) -> int:
        return self.base.read_len(self.real[rel])

    def defs(self, rel: str) -> list[tuple[str, str]]:
        return self.base.defs(self.real[rel])

    def entries(self, d: str) -> list[str]:
        return self.call("list_dir", path=d).split("\n")


# ---- rendering ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def header_ids(system: str = SYSTEM) -> tuple[int, ...]:
    """The tool declarations and system prompt, as create_session(system, TOOL_SCHEMAS) renders them."""
    return tuple(encode_chat(TOK, [{"role": "system", "content": system}], TOOL_SCHEMAS, add_generation_prompt=False))


def render(messages: list[Message]) -> tuple[list[int], list[int]]:
    """Ids of messages appended after a closed turn, and the loss mask (1 on the assistant's own tokens)."""
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        part = encode_chat_delta(TOK, [m], add_generation_prompt=False)
        ids += part
        if m["role"] == "assistant":
            assert part[: len(GEN_IDS)] == GEN_IDS
            mask += [0] * len(GEN_IDS) + [1] * (len(part) - len(GEN_IDS))
        else:
            mask += [0] * len(part)
    return ids, mask


def tool_call(name: str, args: dict[str, str]) -> dict[str, Any]:
    return {"id": f"functions.{name}:0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _fact_re(fact: str) -> re.Pattern[str]:
    left = r"(?<![\w])" if re.match(r"\w", fact) else ""
    right = r"(?![\w])" if re.search(r"\w$", fact) else ""
    return re.compile(left + re.escape(fact) + right)


def fact_in(answer: str, fact: str) -> bool:
    """The fact appears in the answer as a whole word ("line 12" is not in "line 123")."""
    return bool(fact) and _fact_re(fact).search(answer) is not None


# ---- tasks --------------------------------------------------------------------------------------------------

_INTRO = {
    "read_file": ["Let me read {path}.", "I'll open {path}.", "Reading {path}."],
    "grep": ["Let me grep {path}.", "I'll search {path} for it.", "Searching {path}."],
    "list_dir": ["Let me list {path}.", "I'll look at the directory.", "Listing {path}."],
}


def _tool_episode(
    rng: random.Random, kind: str, variant: str, question: str, args: dict[str, str], answer: str, fact: str,
    output: str,
) -> _Episode:
    intro = "" if rng.random() < 0.6 else rng.choice(_INTRO[kind]).format(path=args.get("path", "."))
    call = tool_call(kind, args)
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": intro, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": output},
        {"role": "assistant", "content": answer},
    ]
    ids, mask = render(messages)
    return _Episode(kind, variant, messages, ids, mask, kind, args, fact)


def _first_def(output: str) -> tuple[str, str] | None:
    m = _DEF_RE.search(output)
    return (("function" if m.group(1) == "def" else "class"), m.group(2)) if m else None


def _plain_lines(output: str, n: int) -> list[str] | None:
    """The first n lines of output when splitting at '\\n' and at every line break (grep's) agree."""
    head = output.split("\n")[:n]
    if len(head) < n or "\n".join(head).splitlines() != head:
        return None
    return head


def _read_episode(rng: random.Random, c: Corpus, rel: str) -> _Episode | None:
    out = c.call("read_file", path=rel)
    first = _first_def(out)
    lines = _plain_lines(out, 12)
    line_choices = [i for i, s in enumerate(lines or []) if s.strip() and len(s) <= 100]
    variants = (["first_def"] if first else []) + (["line"] if line_choices else [])
    if not variants:
        return None
    variant = rng.choice(variants)
    recall: list[tuple[str, str, str]] = []
    if first:
        what, name = first
        q = rng.choice([
            "What is the first function or class defined in {p}?",
            "Which function or class comes first in {p}?",
            "Name the first top-level def or class in {p}.",
        ]).format(p=rel)
        a = f"The first {what} defined in {rel} is `{name}`."
        first_qa = (q, a, name)
        recall.append((f"Earlier you read {rel}. What was the first function or class defined in it?", a, name))
    if line_choices:
        i = rng.choice(line_choices)
        text = lines[i].strip()  # type: ignore[index]
        q = rng.choice(["What is on line {n} of {p}?", "Show me line {n} of {p}.", "What does line {n} of {p} say?"])
        q = q.format(n=i + 1, p=rel)
        a = f"Line {i + 1} of {rel} is: {text}"
        line_qa = (q, a, text)
        j = rng.choice(line_choices)
        tj = lines[j].strip()  # type: ignore[index]
        recall.append((
            f"Earlier you read {rel}. What was on line {j + 1} of it?", f"Line {j + 1} of {rel} was: {tj}", tj,
        ))
    q, a, fact = first_qa if variant == "first_def" else line_qa
    ep = _tool_episode(rng, "read_file", variant, q, {"path": rel}, a, fact, out)
    ep.recall = recall
    return ep


def _grep_episode(rng: random.Random, c: Corpus, rel: str) -> _Episode | None:
    defs = c.defs(rel)
    if not defs:
        return None
    for _ in range(4):
        what, name = rng.choice(defs)
        pattern = f"{what} {name}"
        out = c.call("grep", pattern=pattern, path=rel)
        if out and "\n" not in out:
            break
    else:
        return None
    n = out.split(":", 2)[1]
    q = rng.choice([
        "On which line of {p} is `{pat}` defined?",
        "Where in {p} is `{pat}`? Give the line number.",
        "Find `{pat}` in {p}: which line?",
    ]).format(p=rel, pat=pattern)
    a = f"`{pattern}` is on line {n} of {rel}."
    ep = _tool_episode(rng, "grep", "def_line", q, {"pattern": pattern, "path": rel}, a, f"line {n}", out)
    ep.recall = [(f"Earlier you searched {rel} for `{pattern}`. Which line was it on?", a, f"line {n}")]
    return ep


def _list_episode(rng: random.Random, c: Corpus, d: str, split: str) -> _Episode | None:
    entries = c.entries(d)
    if not entries or entries == [""]:
        return None
    shown = "the project root" if d == "." else f"{d}/"
    variants = ["has", "first"] + (["count"] if len(entries) <= 10 else [])
    variant = rng.choice(variants)
    first_a = f"The first entry of {shown} is {entries[0]}."
    recall = [(f"Earlier you listed {shown}. What was its first entry?", first_a, entries[0])]
    if variant == "has":
        present = rng.random() < 0.5
        if present:
            name = rng.choice(entries)
        else:
            other = rng.choice(c.dirs[split])
            name = rng.choice(c.entries(other))
            present = name in entries
        q = rng.choice(["Is there a {x} in {d}?", "Does {d} contain {x}?", "Check whether {d} has {x}."])
        q = q.format(x=name, d=shown)
        a = f"Yes, {shown} contains {name}." if present else f"No, {shown} has no {name}."
        fact = "Yes" if present else "No"
    elif variant == "first":
        q = rng.choice(["What is the first entry of {d}?", "List {d}: which entry comes first?"]).format(d=shown)
        a, fact = first_a, entries[0]
    else:
        k = len(entries)
        q = rng.choice(["How many entries are in {d}?", "Count the entries of {d}."]).format(d=shown)
        a, fact = f"{shown} has {k} entries.", f"{k} entries"
    ep = _tool_episode(rng, "list_dir", variant, q, {"path": d}, a, fact, "\n".join(entries))
    ep.recall = recall
    return ep


_NOTE_THINGS = ["ticket number", "branch name", "release codename", "reviewer's handle", "build id"]


def _note_episode(rng: random.Random, c: Corpus, split: str) -> _Episode:
    """A user statement to remember, acknowledged; its recall question is built in."""
    thing = rng.choice(_NOTE_THINGS)
    rel = rng.choice(c.files[split])
    words = [n for _, n in c.defs(rel)] or ["main"]
    value = f"{rng.choice(words)}-{rng.randrange(10, 10000)}"
    if thing == "ticket number":
        value = f"{''.join(rng.choice('ABCDEFGHKMNPRSTX') for _ in range(2))}-{rng.randrange(100, 100000)}"
    messages = [
        {"role": "user", "content": f"Please remember this for later: the {thing} is {value}."},
        {"role": "assistant", "content": rng.choice(["Noted.", "Got it.", "I will remember that."])},
    ]
    ids, mask = render(messages)
    q = rng.choice(["What {t} did I give you earlier?", "Remind me: what was the {t}?"]).format(t=thing)
    return _Episode("note", thing, messages, ids, mask, None, {}, value,
                    recall=[(q, f"The {thing} is {value}.", value)])


def _recall_episode(question: str, answer: str) -> tuple[list[Message], list[int], list[int]]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    ids, mask = render(messages)
    return messages, ids, mask


def _episode(
    rng: random.Random, c: Corpus, split: str, budget: int, used: set[str], kind: str | None = None
) -> _Episode | None:
    """A tool task (of ``kind``, else a random one) whose ids fit in ``budget`` tokens, on a file or directory
    not yet ``used`` in this conversation."""
    fixed = kind
    for _ in range(8):
        kind = fixed or rng.choices(("read_file", "grep", "list_dir"), (4, 4, 2))[0]
        if kind == "list_dir":
            d = rng.choice(c.dirs[split])
            if d in used or len(c.call("list_dir", path=d)) + 250 > budget:
                continue
            ep = _list_episode(rng, c, d, split)
        else:
            rel = rng.choice(c.files[split])
            if rel in used:
                continue
            if kind == "read_file":
                if c.read_len(rel) + 300 > budget:
                    continue
                ep = _read_episode(rng, c, rel)
            else:
                ep = _grep_episode(rng, c, rel)
        if ep is not None and len(ep.ids) <= budget:
            used.add(ep.arguments["path"])
            return ep
    return None


# ---- rows ---------------------------------------------------------------------------------------------------


def _plain_row(rng: random.Random, c: Corpus, split: str, max_len: int) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    while len(ids) < max_len:
        rel = rng.choice(c.files[split])
        text = c.texts[rel]
        if not ids:  # start the row at a random line of the first file
            lines = text.split("\n")
            text = "\n".join(lines[rng.randrange(len(lines)) :])
        ids += TOK.encode(f"# {rel}\n{text}\n\n")
    ids = ids[:max_len]
    return ids, [1] * len(ids)


def make_row(rng: random.Random, split: str, max_len: int) -> tuple[list[int], list[int]]:
    """One training row: (ids, mask), len <= max_len. A conversation of as many tasks as fit (about a third
    with a recall question 2,000+ tokens after its fact), or, for PLAIN_FRACTION of rows, plain source text
    (mask all 1). The conversation's mask is 1 on the assistant's content, tool-call tokens and <|im_end|>."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    c: Any = corpus()
    if rng.random() < PLAIN_FRACTION:
        return _plain_row(rng, c, split, max_len)
    if split == "train" and rng.random() < RENAMED_FRACTION:
        c = RenamedCorpus(rng, c)
    ids = list(header_ids())
    mask = [0] * len(ids)
    if len(ids) + 400 > max_len:  # no room for a task after the header
        return _plain_row(rng, c, split, max_len)
    used: set[str] = set()
    recall_row = max_len - len(ids) >= RECALL_DISTANCE + 1200 and rng.random() < RECALL_FRACTION
    # recall questions to place: [ids, mask, target position, earliest position], 1-3 per recall row (each is a few tokens of
    # loss in thousands: one per row taught too little long-range recall, docs/tiny.md run 2)
    pending: list[list[Any]] = []
    if recall_row:
        dense = rng.random() < DENSE_RECALL_FRACTION  # many facts up front, many questions later
        for j in range(rng.randrange(4, 9) if dense else rng.choice((1, 2, 3))):
            room = max_len - len(ids) - RECALL_DISTANCE - (100 if dense else 300) - 70 * (j + 1)
            if room < 100:
                break
            source: _Episode | None
            if (j > 0 and not dense) or rng.random() < (0.65 if dense else 0.4):
                source = _note_episode(rng, c, split)
            else:
                source = _episode(rng, c, split, min(220 if dense else 2500, room), used)
            if source is None or not source.recall or len(source.ids) > room:
                continue
            ids += source.ids
            mask += source.mask
            q, a, _ = rng.choice(source.recall)
            _, q_ids, q_mask = _recall_episode(q, a)
            pending.append([q_ids, q_mask, len(ids) + RECALL_DISTANCE, len(ids) + RECALL_DISTANCE])
    if pending:
        reserve_all = sum(len(p[0]) for p in pending)
        for p in pending:  # each question somewhere between its earliest position and the row's end
            slack = max_len - reserve_all - p[2]
            p[2] += rng.randrange(slack) if slack > 1 else 0
        pending.sort(key=lambda p: p[2])
    misses = 0
    while misses < 3:
        reserve = sum(len(p[0]) for p in pending)
        if pending and len(ids) >= pending[0][2]:
            q_ids, q_mask, _, _ = pending.pop(0)
            ids += q_ids
            mask += q_mask
            continue
        budget = max_len - len(ids) - reserve
        if budget < 200:
            break
        ep = _episode(rng, c, split, budget, used)
        if ep is None and pending:  # tool tasks no longer fit: short notes carry the row to the questions
            ep = _note_episode(rng, c, split)
            if len(ep.ids) > budget:
                ep = None
        if ep is None:
            misses += 1
            continue
        ids += ep.ids
        mask += ep.mask
    for q_ids, q_mask, _, earliest in pending:  # the rest, if the row ran long enough and they fit
        if len(ids) >= earliest and len(ids) + len(q_ids) <= max_len:
            ids += q_ids
            mask += q_mask
    assert len(ids) == len(mask) <= max_len
    return ids, mask


# ---- held-out tasks -----------------------------------------------------------------------------------------


def _as_task(ep: _Episode, history: list[Message]) -> Task:
    return Task(ep.kind, ep.variant, [*history, ep.messages[0]], ep.tool, dict(ep.arguments), ep.fact)


def _one_task(rng: random.Random, c: Corpus, kind: str) -> Task | None:
    split = "heldout"
    history: list[Message] = [{"role": "system", "content": SYSTEM}]
    used: set[str] = set()
    if kind == "recall":
        source = _note_episode(rng, c, split) if rng.random() < 0.4 else _episode(rng, c, split, 2500, used)
        if source is None or not source.recall:
            return None
        history += source.messages
        distance = 0
        while distance < RECALL_DISTANCE:
            ep = _episode(rng, c, split, 2500, used)
            if ep is None:
                return None
            history += ep.messages
            distance += len(ep.ids)
        q, _, fact = rng.choice(source.recall)
        return Task("recall", source.variant, [*history, {"role": "user", "content": q}], None, {}, fact, distance)
    for _ in range(rng.randrange(3)):  # 0-2 earlier tasks, as in training conversations
        ep = _episode(rng, c, split, 2000, used)
        if ep is not None:
            history += ep.messages
    ep = _episode(rng, c, split, 6000, used, kind)
    return None if ep is None else _as_task(ep, history)


def eval_tasks(seed: int, n: int, kind: str | None = None) -> list[Task]:
    """``n`` held-out tasks (held-out files and directories only), deterministic in ``seed``; kinds in turn
    when ``kind`` is None, else only that kind (one of KINDS)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    c = corpus()
    rng = random.Random(seed)
    kinds = [kind] if kind else list(KINDS)
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 50 * n + 100:
            raise RuntimeError(f"could not build {n} held-out tasks of kind {kind!r} from {c.root}")
        t = _one_task(rng, c, kinds[len(tasks) % len(kinds)])
        if t is not None:
            tasks.append(t)
    return tasks
