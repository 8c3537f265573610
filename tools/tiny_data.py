"""Synthetic coding-agent transcripts over the Python standard library: training rows and held-out tasks for
the built-in model ``tiny`` (issue 7).

Every transcript is rendered by the library's own chat template for the byte tokenizer, exactly as the engine
feeds a session (no BOS): tool declarations (``TOOL_SCHEMAS``) and the system prompt, then tasks. A task is a
user question about one file or directory, an assistant turn that calls one tool, the REAL output of
``kda_sessions.tools.Tools(stdlib)`` for that call (read_file's lines numbered as by ``cat -n``), and a short
final answer that states a fact copied from that output. Recall tasks ask, thousands of tokens later, for a fact
from an earlier tool output or user note; they are answered without a tool call.

Files are split into train / held-out by a sha256 of their path relative to the stdlib root, so the split is
the same on every machine and Python version (only the set of files present differs).

    make_row(rng, split, max_len, distance, ...) -> (ids, mask)      one training row; mask 1 on the assistant's
                                                                    tokens, 2 on the fact inside its answers
    curriculum_distances(step, a, b, s) -> (lo, hi)                  recall distances of a training step
    eval_tasks(seed, n, kind) -> list[Task]                          held-out tasks for tools/eval_tiny.py

Rows and tasks in other phrasings, over installed package trees, with multi-step tasks, corrected tool errors
and off-task refusals are tools/tiny_general.py's (issue 31); the questions here keep their fixed forms.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import random
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kda_sessions.tokenizer import ByteTokenizer, encode_chat, encode_chat_delta
from kda_sessions.tokenizer.chat import GENERATION_PROMPT
from kda_sessions.tools import TOOL_SCHEMAS, Tools

SYSTEM = "You are a careful coding agent. Use the tools to look at the project before you answer."
KINDS = ("read_file", "grep", "list_dir", "recall")
SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
MAX_FILE_BYTES = 200_000
SKIP_PARTS = frozenset({"test", "tests", "site-packages", "idlelib", "__pycache__"})
RECALL_DISTANCE = 2000  # tokens between the end of the fact's turn and the recall question, at least (the eval's)
PLAIN_FRACTION = 0.1
LINE_READ_LIMITS = (1, 3, 5)  # read_file limit of a "line N" task, by N: the asked line always comes first
FIRST_DEF_PATTERN = "^(async def|def|class) "  # grep pattern of a "first def or class in FILE" task
# share of training "first entry" questions whose answer is `__init__.py` turned into "has" questions: run 8 used
# 0.75 and its model then invented names where the first entry *is* `__init__.py`; run 9 keeps three quarters
INIT_FIRST_DROP = 0.25
RENAMED_FRACTION = 0.5  # of train conversation rows: a project of real files under random names (RenamedCorpus)
RECALL_FRACTION = 0.6  # of conversation rows (each with 1-3 recall questions; some cannot be placed)
DENSE_RECALL_FRACTION = 0.4  # of recall rows: 4-8 facts (notes and short tool results) and a question for each
FACT = 2  # mask value of the fact's tokens inside an assistant answer (1: the assistant's other tokens)
FILL_SLACK = 200  # tokens a filler episode may run past a recall question's target position

TOK = ByteTokenizer()
PAD_ID = TOK.special_ids["<|pad|>"]  # what training pads its rows with (never a target: mask 0)
GEN_IDS: list[int] = TOK.encode(GENERATION_PROMPT, allow_special=True)
_DEF_RE = re.compile(r"^(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)")
_NUMBERED_RE = re.compile(r" *(\d+)\t(.*)")
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
    arguments: dict[str, Any]
    fact: str
    recall: list[tuple[str, str, str]] = field(default_factory=list)  # (question, answer, fact)
    template: str = ""  # the phrasing grammar's template id of the question (tools/tiny_general.py), if any


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
        self._cache: dict[tuple[Any, ...], str] = {}
        self._defs: dict[str, list[tuple[str, str]]] = {}

    def call(self, name: str, **args: Any) -> str:
        """The real tool's output, cached."""
        key = (name, *sorted((k, str(v)) for k, v in args.items()))
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = self.tools.call(name, args)
        return out

    def read_len(self, rel: str) -> int:
        """Bytes of read_file(rel)'s output."""
        return len(self.call("read_file", path=rel).encode("utf-8"))

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


@lru_cache(maxsize=1)
def plain_words() -> tuple[str, ...]:
    """Lower-case words of 3-12 letters written at least 3 times in the comments and docstrings of the corpus's
    training files ("supervisor", "middleware", "lifespan"): folder and file names of other projects are such
    words, not the stdlib's definition names that ``_name_words`` gives."""
    c = corpus()
    counts: dict[str, int] = {}
    for rel in c.files["train"]:
        for line in c.texts[rel].splitlines():
            s = line.strip()
            if s.startswith("#") or (s and s[0].isupper() and not s.endswith((":", ")", ",", "("))):
                for w in re.findall(r"\b[a-z]{3,12}\b", s):
                    counts[w] = counts.get(w, 0) + 1
    import keyword

    return tuple(sorted(w for w, n in counts.items() if n >= 3 and not keyword.iskeyword(w)))


@lru_cache(maxsize=1)
def _name_stems() -> tuple[str, ...]:
    """Names a near-miss name starts with: train-split file stems and directory names, and the name words."""
    c = corpus()
    stems = {rel.rsplit("/", 1)[-1].removesuffix(".py") for rel in c.files["train"]}
    stems |= {d.rsplit("/", 1)[-1] for d in c.dirs["train"] if d != "."}
    return tuple(sorted(x for x in stems | set(_name_words()) if 3 <= len(x) <= 16 and x.isidentifier()))


def _renamed_entries(rng: random.Random, entries: list[str]) -> list[str]:
    """New names for a directory's ``entries`` (same count, extensions and directory slashes kept, all distinct):
    half start like a stdlib stem and run on into part of a word, one in six is capitalised (it sorts before
    ``__init__.py``), and ``__init__.py`` keeps its name half the time."""
    words, stems = _name_words(), _name_stems()
    keep_init = rng.random() < 0.5
    out: list[str] = []
    for e in entries:
        if not e or (e == "__init__.py" and keep_init):
            out.append(e)
            continue
        slash = e.endswith("/")
        base = e[:-1] if slash else e
        ext = base[base.index(".", 1):] if "." in base[1:] else ""
        while True:
            if rng.random() < 0.5:
                tail = rng.choice(words)
                new = rng.choice(stems) + tail[: rng.randrange(1, len(tail) + 1)]
            else:
                new = rng.choice(words) if rng.random() < 0.5 else f"{rng.choice(words)}_{rng.choice(words)}"
            if rng.random() < 1 / 6:
                new = new[0].upper() + new[1:]
            new = new + ext + ("/" if slash else "")
            if new not in out and new not in entries:
                break
        out.append(new)
    return out


def _rename_defs(names: list[str], text: str, propose: Callable[[str], str]) -> dict[str, str]:
    """New names for the definitions ``names`` of a file's ``text`` (but dunders and names under 4 characters):
    ``propose(name)`` up to 4 times, keeping the first identifier that is neither a word of the text already nor
    another's new name."""
    taken = set(re.findall(r"\w+", text))
    out: dict[str, str] = {}
    for n in dict.fromkeys(names):
        if n.startswith("__") or len(n) < 4:
            continue
        for _ in range(4):
            new = propose(n)
            if new.isidentifier() and new not in taken:
                out[n] = new
                taken.add(new)
                break
    return out


def _copy_defs(rng: random.Random, names: list[str], text: str, words: tuple[str, ...]) -> dict[str, str]:
    """``_rename_defs`` with each new name one of ``words`` made an identifier (dots to underscores, a leading
    digit after an underscore; a class name starts upper-case): names no training text holds, so reading the file
    and grepping for them only works by copying them byte for byte."""

    def propose(n: str) -> str:
        new = rng.choice(words).replace(".", "_")
        new = f"_{new}" if new[0].isdigit() else new
        return new[0].upper() + new[1:] if n[0].isupper() else new

    return _rename_defs(names, text, propose)


def _near_miss_defs(rng: random.Random, names: list[str], text: str) -> dict[str, str]:
    """``_rename_defs`` with each new name keeping the old one's first third or more and running on into the start
    of a name word."""
    words = _name_words()

    def propose(n: str) -> str:
        w = rng.choice(words)
        return n[: rng.randrange(max(2, len(n) // 3), len(n))] + w[: rng.randrange(1, len(w) + 1)]

    return _rename_defs(names, text, propose)


class RenamedCorpus:
    """A fresh project made of real train-split stdlib files and directory listings under random names.

    With only ~100 stdlib directories and ~1,500 files, the model can answer a training question by recalling
    a memorised name instead of copying it from the question, and then fails on held-out names (run 2 of
    docs/tiny.md wrote ``importlib/metadata`` for ``importlib``). Here every file and directory a row can use
    gets a random path, so only copying works. The tools still run for real: each file is written (same bytes)
    and each listed directory created (same entry names, empty) under a per-process temp root when a tool first
    touches it. Offers the parts of ``Corpus`` that episodes use; every path is in the "train" split."""

    def __init__(
        self, rng: random.Random, base: Corpus, n_files: int = 48, n_dirs: int = 12, near_miss: float = 0.0,
        near_miss_defs: float = 0.0, near_miss_entries: float = 0.0, words: tuple[str, ...] | None = None,
        def_words: tuple[str, ...] | None = None, name_mix: tuple[float, float] = (0.3, 0.8),
    ) -> None:
        import os
        import shutil
        import tempfile

        root = Path(tempfile.gettempdir()) / f"tiny_ws_{os.getpid()}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.root = root.resolve()
        self.tools = Tools(self.root)
        self.base = base
        words = words or _name_words()  # what names are made of (tiny_general passes plain English words too)

        stems = _name_stems()

        def name() -> str:
            # ``near_miss`` of the names start like a stdlib name and run on into something new, no separator
            # (held-out "turtledemo" after training's "turtle"): only copying gets them right. 0 draws nothing
            # from rng, so rows of runs before the option are unchanged.
            if near_miss and rng.random() < near_miss:
                tail = rng.choice(words)
                return rng.choice(stems) + tail[: rng.randrange(1, len(tail) + 1)]
            # ``name_mix`` (a, b): a word alone below a, two joined by "_" below b, else a word and a number
            k = rng.random()
            w = rng.choice(words)
            a, b = name_mix
            return w if k < a else f"{w}_{rng.choice(words)}" if k < b else f"{w}{rng.randrange(2, 100)}"

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
        # ``near_miss_defs`` of the files get near-miss names for their definitions (``_renamed``), drawn from a
        # stream of their own: one draw here, none when 0
        self._near_defs = near_miss_defs
        self._def_words = def_words  # what those names are (``_copy_defs``); None: near misses (``_near_miss_defs``)
        self._defs_seed = rng.getrandbits(64) if near_miss_defs else 0
        self._renames: dict[str, dict[str, str]] = {}
        self._read_lens: dict[str, int] = {}
        # ``near_miss_entries`` of the listed directories get new entry names (``_listing``), from a stream of their
        # own: one draw here, none when 0
        self._near_entries = near_miss_entries
        self._entries_seed = rng.getrandbits(64) if near_miss_entries else 0
        self._listings: dict[str, list[str]] = {}

    def _listing(self, alias: str) -> list[str]:
        """The entries of listed directory ``alias``: the real directory's, or, for a share ``near_miss_entries``
        of them, every entry renamed (extension and trailing ``/`` kept; some names near-miss stdlib stems, some
        capitalised, ``__init__.py`` kept half the time). The listing then has a first entry, a member set and
        names that only reading the tool output gives: run 11 answered ``__init__.py`` as the first entry of a
        folder with a README and "No" for entries a listing showed."""
        got = self._listings.get(alias)
        if got is None:
            got = self.base.entries(self.real[alias])
            if self._near_entries:
                r = random.Random(f"{self._entries_seed}:{alias}")
                if r.random() < self._near_entries:
                    got = _renamed_entries(r, got)
            self._listings[alias] = got
        return got

    def _renamed(self, alias: str) -> dict[str, str]:
        """The file's definition renames (old -> new; empty if none), applied to its text on first use. A renamed
        definition keeps a prefix of its stdlib name and runs on into part of another word (``FixTy`` +
        ``rant``), so the model must copy it from the tool output instead of finishing a memorised name."""
        m = self._renames.get(alias)
        if m is None:
            m = {}
            if self._near_defs and alias in self.texts:
                r = random.Random(f"{self._defs_seed}:{alias}")
                if r.random() < self._near_defs:
                    names = [n for _, n in self.base.defs(self.real[alias])]
                    m = (_copy_defs(r, names, self.texts[alias], self._def_words) if self._def_words
                         else _near_miss_defs(r, names, self.texts[alias]))
                    if m:
                        pat = re.compile(r"\b(" + "|".join(map(re.escape, sorted(m, key=len, reverse=True))) + r")\b")
                        self.texts[alias] = pat.sub(lambda mo: m[mo.group(1)], self.texts[alias])
            self._renames[alias] = m
        return m

    def holders(self) -> list[str]:
        """The folders that hold renamed files (``fresh(..., "holder")`` above): listing one shows its renamed
        files, so a multi-step task can list it and then read a file it found there."""
        return sorted({f.rsplit("/", 1)[0] for f in self.files["train"]})

    def _make(self, alias: str) -> None:
        if alias in self._made:
            return
        if alias not in self.real:  # a holder folder: every renamed file below it, so its listing is complete
            below = [f for f in self.files["train"] if f.startswith(alias + "/")]
            for f in below:
                self._make(f)
            if below:
                self._made.add(alias)
            return
        self._renamed(alias)
        self._made.add(alias)
        p = self.root / alias
        if alias in self.texts:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(self.texts[alias].encode("utf-8"))
            return
        p.mkdir(parents=True, exist_ok=True)
        for e in self._listing(alias):
            if e.endswith("/"):
                (p / e[:-1]).mkdir(exist_ok=True)
            elif e:
                (p / e).touch()

    def call(self, name: str, **args: Any) -> str:
        self._make(args.get("path", ""))
        return self.tools.call(name, args)

    def read_len(self, rel: str) -> int:
        if not self._renamed(rel):
            return self.base.read_len(self.real[rel])
        n = self._read_lens.get(rel)
        if n is None:  # the renamed text's own output, read once
            n = self._read_lens[rel] = len(self.call("read_file", path=rel).encode("utf-8"))
        return n

    def defs(self, rel: str) -> list[tuple[str, str]]:
        m = self._renamed(rel)
        return [(kind, m.get(n, n)) for kind, n in self.base.defs(self.real[rel])]

    def entries(self, d: str) -> list[str]:
        return self.call("list_dir", path=d).split("\n")


# ---- rendering ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def header_ids(system: str = SYSTEM) -> tuple[int, ...]:
    """The tool declarations and system prompt, as create_session(system, TOOL_SCHEMAS) renders them."""
    return tuple(encode_chat(TOK, [{"role": "system", "content": system}], TOOL_SCHEMAS, add_generation_prompt=False))


def render(messages: list[Message], fact: str | None = None) -> tuple[list[int], list[int]]:
    """Ids of messages appended after a closed turn, and the loss mask: 1 on the assistant's own tokens, FACT
    on the last match of ``fact`` in the last message (an assistant answer stating it)."""
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
    if fact is not None:
        content = messages[-1]["content"]
        body = content.encode("utf-8")
        start = len(ids) - len(part) + len(GEN_IDS)  # byte tokens: the content follows the generation prompt
        assert messages[-1]["role"] == "assistant" and ids[start : start + len(body)] == list(body)
        matches = list(_fact_re(fact).finditer(content))
        assert matches, (fact, content)
        last = matches[-1]
        a = start + len(content[: last.start()].encode("utf-8"))
        b = a + len(last.group().encode("utf-8"))
        mask[a:b] = [FACT] * (b - a)
    return ids, mask


def tool_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
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
    rng: random.Random, kind: str, variant: str, question: str, args: dict[str, Any], answer: str, fact: str,
    output: str,
) -> _Episode:
    intro = "" if rng.random() < 0.6 else rng.choice(_INTRO[kind]).format(path=args.get("path", "."))
    call = tool_call(kind, args)
    messages: list[Message] = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": intro, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": output},
        {"role": "assistant", "content": answer},
    ]
    ids, mask = render(messages, fact)
    return _Episode(kind, variant, messages, ids, mask, kind, args, fact)


def numbered_lines(output: str) -> list[tuple[int, str]]:
    """(number, text) of each line of read_file's output (``cat -n``: f"{n:>6}\\t{line}")."""
    rows = []
    for row in output.split("\n"):
        m = _NUMBERED_RE.fullmatch(row)
        if m:
            rows.append((int(m.group(1)), m.group(2)))
    return rows


def _first_def(lines: list[tuple[int, str]]) -> tuple[str, str] | None:
    """(function|class, name) of the first top-level def or class among read_file's numbered lines."""
    for _, text in lines:
        m = _DEF_RE.match(text)
        if m:
            return ("function" if m.group(1) == "def" else "class"), m.group(2)
    return None


def _read_episode(rng: random.Random, c: Corpus, rel: str, variant: str | None = None) -> _Episode | None:
    """A question about file ``rel``: its first definition (answered with a grep) or a line of it (a read of that
    line and the next few); ``variant`` ("first_def" or "line") picks one, else either at random."""
    out = c.call("read_file", path=rel)
    lines = numbered_lines(out)
    first = _first_def(lines)
    # any shown line: its number is printed next to it, so "line N" is a lookup wherever it is
    line_choices = [(n, s.strip()) for n, s in lines if s.strip() and len(s) <= 100]
    variants = (["first_def"] if first else []) + (["line"] if line_choices else [])
    if variant is not None:
        variants = [v for v in variants if v == variant]
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
        i, text = rng.choice(line_choices)
        q = rng.choice(["What is on line {n} of {p}?", "Show me line {n} of {p}.", "What does line {n} of {p} say?"])
        q = q.format(n=i, p=rel)
        a = f"Line {i} of {rel} is: {text}"
        line_qa = (q, a, text)
        j, tj = rng.choice(line_choices)
        recall.append((f"Earlier you read {rel}. What was on line {j} of it?", f"Line {j} of {rel} was: {tj}", tj))
    if variant == "first_def":
        # grep the file for top-level definitions, as an agent would: the answer is on the output's first line
        q, a, fact = first_qa
        args = {"pattern": FIRST_DEF_PATTERN, "path": rel}
        found = c.call("grep", **args)
        m = _DEF_RE.match(found.split("\n", 1)[0].split(": ", 1)[-1])
        if m is None or m.group(2) != fact:  # a definition the two regexes see differently: no task
            return None
        ep = _tool_episode(rng, "grep", variant, q, args, a, fact, found)
        ep.kind = "read_file"  # a question about a file's content, answered with grep
        ep.recall = [(f"Earlier you looked at {rel}. What was the first function or class defined in it?", a, fact)]
        return ep
    # "line N": read only the lines from N (as an agent looks at one place of a long file), so the asked line is
    # the first one of the output; its recall asks for that line again (the rest of the file was not shown)
    limit = LINE_READ_LIMITS[i % len(LINE_READ_LIMITS)]
    args = {"path": rel, "start": i, "limit": limit}
    q, a, fact = line_qa
    ep = _tool_episode(rng, "read_file", variant, q, args, a, fact, c.call("read_file", **args))
    ep.recall = [(f"Earlier you read line {i} of {rel}. What was on it?", f"Line {i} of {rel} was: {text}", text)]
    return ep


def _grep_episode(rng: random.Random, c: Corpus, rel: str, what: str | None = None) -> _Episode | None:
    """The line of a ``def name`` / ``class Name`` of file ``rel``; ``what`` ("def" or "class") picks the kind."""
    defs = c.defs(rel) if what is None else [x for x in c.defs(rel) if x[0] == what]
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


def _list_episode(
    rng: random.Random, c: Corpus, d: str, split: str, variant: str | None = None
) -> _Episode | None:
    """A question about folder ``d``: does it contain X, its first entry, or (10 entries or fewer) how many
    entries; ``variant`` ("has", "first", "count") picks one (None where it cannot be asked), else one at random."""
    entries = c.entries(d)
    if not entries or entries == [""]:
        return None
    shown = "the project root" if d == "." else f"{d}/"
    variants = ["has", "first"] + (["count"] if len(entries) <= 10 else [])
    if variant is not None:
        if variant not in variants:
            return None
    else:
        variant = rng.choice(variants)
        if variant == "first" and entries[0] == "__init__.py" and split == "train" and rng.random() < INIT_FIRST_DROP:
            variant = "has"  # a first entry the model can guess teaches it to guess (run 7: `__init__.py` for README)
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
        # the entries numbered before the total: the model counts by copying each entry after the next number
        # (run 11 answered "6 entries" for every held-out folder of 5 when the total came alone)
        numbered = ", ".join(f"{i} {e}" for i, e in enumerate(entries, 1))
        a, fact = f"Counting {shown}: {numbered}. {shown} has {k} entries.", f"{k} entries"
    ep = _tool_episode(rng, "list_dir", variant, q, {"path": d}, a, fact, "\n".join(entries))
    ep.recall = recall
    return ep


_NOTE_THINGS = ["ticket number", "branch name", "release codename", "reviewer's handle", "build id"]  # the eval's
# training rows also use these, so that a row can hold many notes and still never ask about one thing twice
_MORE_THINGS = [
    "deploy tag", "staging host", "port number", "commit hash", "feature flag", "database name", "issue number",
    "customer id", "on-call engineer", "config key", "queue name", "test seed", "base image", "milestone",
    "cache bucket", "license key", "meeting room", "backup folder", "service account", "rollout id",
    "project codename", "vendor code", "build number", "account number", "pipeline id", "sprint name",
    "cluster name", "region code", "API version", "tracking id", "package name", "order number", "locale",
    "bucket prefix", "secret name",
]
_CODES = "ABCDEFGHKMNPRSTX"


def _note_value(rng: random.Random, thing: str, words: list[str]) -> str:
    """A random value of the thing's usual shape: only copying it from the note can answer its question."""
    if thing in ("ticket number", "issue number", "customer id", "license key", "tracking id", "order number"):
        return f"{''.join(rng.choice(_CODES) for _ in range(2))}-{rng.randrange(100, 100000)}"
    if thing in ("port number", "test seed", "build number", "account number"):
        return str(rng.randrange(1024, 65536))
    if thing == "commit hash":
        return f"{rng.getrandbits(28):07x}"
    return f"{rng.choice(words)}-{rng.randrange(10, 10000)}"


def _note_episode(rng: random.Random, c: Corpus, split: str, taken: set[str] | None = None) -> _Episode | None:
    """A user statement to remember, acknowledged; its recall question is built in. With ``taken`` (the things
    already noted in this row, updated here): a thing not in it, from the training list, or None when none is
    left; without it, one of the eval's things."""
    things = _NOTE_THINGS if taken is None else [t for t in _NOTE_THINGS + _MORE_THINGS if t not in taken]
    if not things:
        return None
    thing = rng.choice(things)
    if taken is not None:
        taken.add(thing)
    rel = rng.choice(c.files[split])
    value = _note_value(rng, thing, [n for _, n in c.defs(rel)] or ["main"])
    say = "Please remember this for later: the {t} is {v}."  # the eval's wording; training rows vary it
    if taken is not None:
        say = rng.choice([say, say, "Remember: the {t} is {v}.", "Note that the {t} is {v}.", "FYI, the {t} is {v}."])
    messages = [
        {"role": "user", "content": say.format(t=thing, v=value)},
        {"role": "assistant", "content": rng.choice(["Noted.", "Got it.", "I will remember that."])},
    ]
    ids, mask = render(messages)
    q = rng.choice(["What {t} did I give you earlier?", "Remind me: what was the {t}?"]).format(t=thing)
    return _Episode("note", thing, messages, ids, mask, None, {}, value,
                    recall=[(q, f"The {thing} is {value}.", value)])


def _recall_episode(question: str, answer: str, fact: str) -> tuple[list[int], list[int]]:
    return render([{"role": "user", "content": question}, {"role": "assistant", "content": answer}], fact)


def draw_distance(rng: random.Random, distance: tuple[int, int]) -> int:
    """One recall question's minimum distance from its fact, in tokens: ``lo`` when lo == hi, else ``hi`` for
    half of the questions and log-uniform in [lo, hi) for the rest (the long range is the target; the short
    range keeps the skill where it first forms)."""
    lo, hi = distance
    if lo >= hi:
        return hi
    if rng.random() < 0.5:
        return hi
    return int(lo * (hi / lo) ** rng.random())


def curriculum_distances(step: int, a: int, b: int, steps: int) -> tuple[int, int]:
    """make_row's ``distance`` at training step ``step`` of a recall curriculum from ``a`` to ``b`` tokens over
    ``steps`` steps: (d, d) with d growing geometrically from a to b (equal steps for every doubling: linear
    growth would leave the short range, where the lookup is learnable, after a few percent of the steps), then
    (a, b) for good (half of the questions at b or more, the rest spread over [a, b))."""
    if not 0 < a <= b or steps < 0:
        raise ValueError(f"recall curriculum needs 0 < a <= b and steps >= 0, got {a}:{b}:{steps}")
    if step >= steps:
        return a, b
    d = round(a * (b / a) ** (max(step, 0) / steps))
    return d, d


def _check_row_args(split: str, distance: tuple[int, int], drill: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 < distance[0] <= distance[1]:
        raise ValueError(f"distance must be (lo, hi) with 0 < lo <= hi, got {distance}")
    if not 0.0 <= drill <= 1.0 - PLAIN_FRACTION:
        raise ValueError(f"drill must be in [0, {1.0 - PLAIN_FRACTION}], got {drill}")


def _episode(
    rng: random.Random, c: Corpus, split: str, budget: int, used: set[str], kind: str | None = None
) -> _Episode | None:
    """A tool task (of ``kind``, else a random one) whose ids fit in ``budget`` tokens, on a file or directory
    not yet ``used`` in this conversation. ``kind`` "read_line" (training only) is a read_file task of the "line"
    variant on any file: a read of a few lines is short however long the file (a random read_file task must fit
    the whole file in ``budget``, which keeps most files out of short budgets)."""
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
            elif kind == "read_line":
                ep = _read_episode(rng, c, rel, "line")
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


def make_row(
    rng: random.Random, split: str, max_len: int, distance: tuple[int, int] = (RECALL_DISTANCE, RECALL_DISTANCE),
    drill: float = 0.0, near_miss: float = 0.0, near_miss_defs: float = 0.0, near_miss_entries: float = 0.0,
    line_recall: float = 0.0,
) -> tuple[list[int], list[int]]:
    """One training row: (ids, mask), len <= max_len. A conversation of as many tasks as fit (60% with 1-8
    recall questions), or, for ``drill`` of all rows, a drill row (``_drill_row``), or, for PLAIN_FRACTION of
    rows, plain source text (mask all 1). The conversation's mask is 1 on the assistant's content, tool-call
    tokens and <|im_end|>, and FACT (2) on the fact each final answer states. Each recall question comes at
    least ``draw_distance(distance)`` tokens after its fact (and at most about twice that). ``near_miss``: the
    share of RenamedCorpus names that start like a stdlib name (see there); ``near_miss_defs`` the share of its
    files whose definitions get such names, ``near_miss_entries`` the share of its listed directories whose
    entries get new names. ``line_recall``: the share of recall sources (tool tasks of recall rows and of drills)
    that are line reads ("What was on line N of F?"), which short budgets otherwise almost never allow (at 0, about
    one such question in 150 rows against 1 in 12 of the eval's recall tasks)."""
    _check_row_args(split, distance, drill)
    for name, value in (("near_miss", near_miss), ("near_miss_defs", near_miss_defs),
                        ("near_miss_entries", near_miss_entries), ("line_recall", line_recall)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    c: Any = corpus()
    if rng.random() < PLAIN_FRACTION:
        return _plain_row(rng, c, split, max_len)
    if split == "train" and rng.random() < RENAMED_FRACTION:
        c = RenamedCorpus(rng, c, near_miss=near_miss, near_miss_defs=near_miss_defs,
                          near_miss_entries=near_miss_entries)
    ids = list(header_ids())
    mask = [0] * len(ids)
    if len(ids) + 400 > max_len:  # no room for a task after the header
        return _plain_row(rng, c, split, max_len)
    if drill and rng.random() < drill / (1.0 - PLAIN_FRACTION):
        return _drill_row(rng, c, split, max_len, distance, ids, mask, line_recall)
    used: set[str] = set()
    taken: set[str] = set()  # note things of this row: each asked about at most once, so never ambiguous
    recall_row = max_len - len(ids) >= distance[0] + 1000 and rng.random() < RECALL_FRACTION
    # recall questions to place: [ids, mask, target position, earliest position, distance], 1-3 per recall row
    # (each is a few tokens of loss in thousands: one per row taught too little long-range recall, docs/tiny.md)
    pending: list[list[Any]] = []
    if recall_row:
        dense = rng.random() < DENSE_RECALL_FRACTION  # many facts up front, many questions later
        for j in range(rng.randrange(4, 9) if dense else rng.choice((1, 2, 3))):
            d = draw_distance(rng, distance)
            room = max_len - len(ids) - d - (100 if dense else 300) - 70 * (j + 1)
            if room < 100:
                continue
            source: _Episode | None
            if (j > 0 and not dense) or rng.random() < (0.65 if dense else 0.4):
                source = _note_episode(rng, c, split, taken)
            else:
                line = line_recall and rng.random() < line_recall  # (no draw at 0: rows as before)
                source = _episode(rng, c, split, min(220 if dense else 2500, room), used, "read_line" if line else None)
            if source is None or not source.recall or len(source.ids) > room:
                continue
            ids += source.ids
            mask += source.mask
            q, a, fact = rng.choice(source.recall)
            q_ids, q_mask = _recall_episode(q, a, fact)
            pending.append([q_ids, q_mask, len(ids) + d, len(ids) + d, d])
    if pending:
        reserve_all = sum(len(p[0]) for p in pending)
        for p in pending:  # each question between its earliest position and twice its distance (or the row's end)
            slack = min(max_len - reserve_all - p[2], p[4])
            p[2] += rng.randrange(slack) if slack > 1 else 0
        pending.sort(key=lambda p: p[2])
    misses = 0
    while misses < 3:
        reserve = sum(len(p[0]) for p in pending)
        if pending and len(ids) >= pending[0][2]:
            q_ids, q_mask = pending.pop(0)[:2]
            ids += q_ids
            mask += q_mask
            continue
        budget = max_len - len(ids) - reserve
        if budget < 200:
            break
        kind = None
        if pending:  # land near the next question's target: a long read_file here would overshoot it by thousands
            budget = min(budget, pending[0][2] - len(ids) + FILL_SLACK)
            kind = "grep" if budget < 600 else None
        ep = _episode(rng, c, split, budget, used, kind)
        if ep is None and pending:  # tool tasks do not fit: short notes carry the row to the questions
            ep = _note_episode(rng, c, split, taken)
            if ep is not None and len(ep.ids) > budget:
                ep = None
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


DRILL_NOTE_SHARE = 0.8  # of a drill row's facts (~75 tokens each); the rest are small grep and list_dir tasks (~330)
DRILL_TOOL_TOKENS = 420  # at most, per tool task of a drill row (a grep task is 290-410 tokens)


def _drill_row(
    rng: random.Random, c: Any, split: str, max_len: int, distance: tuple[int, int], ids: list[int],
    mask: list[int], line_recall: float = 0.0,
) -> tuple[list[int], list[int]]:
    """The rest of a row (after the header ``ids``, ``mask``) as a drill of associative recall: short facts
    (user notes, small grep and list_dir tasks), each asked about once, ``draw_distance(distance)`` tokens or a
    little more after it, with the eval's recall questions. Values are random or come from files under random
    names, so only copying them works. Only early facts can be asked from ``hi`` tokens away; a later fact's
    distance is drawn again below what still fits. 4K rows: ~12 recall answers at 64-500 tokens, ~4 at
    2,000, ~13 at (64, 2000) of which ~2 at 2,000+, against 1-3 in a conversation."""
    used: set[str] = set()
    taken: set[str] = set()
    pending: list[tuple[int, int, list[int], list[int]]] = []  # heap of (target position, order, ids, mask)
    while True:
        if pending and len(ids) >= pending[0][0]:
            _, _, q_ids, q_mask = heapq.heappop(pending)
            ids += q_ids
            mask += q_mask
            continue
        reserve = sum(len(p[2]) for p in pending)
        budget = max_len - len(ids) - reserve
        source = _note_episode(rng, c, split, taken) if rng.random() < DRILL_NOTE_SHARE else None
        if source is None and budget >= 250:
            kind = rng.choice(("grep", "grep", "grep", "list_dir"))
            if line_recall and rng.random() < line_recall:  # (no draw at 0: rows as before)
                kind = "read_line"
            source = _episode(rng, c, split, min(budget, DRILL_TOOL_TOKENS), used, kind)
        if source is None:
            source = _note_episode(rng, c, split, taken)
        if source is None or len(source.ids) > budget:
            break
        ids += source.ids
        mask += source.mask
        recall = [r for r in source.recall if r[2] != "__init__.py"]  # a guessable first entry teaches no copying
        if not recall:
            continue
        q, a, fact = rng.choice(recall)
        q_ids, q_mask = _recall_episode(q, a, fact)
        d = draw_distance(rng, distance)
        room = max_len - len(ids) - reserve - len(q_ids) - 100  # the longest distance still asked in this row
        if room < d and room >= distance[0]:  # a late fact: a shorter distance, log-uniform in [lo, room)
            d = int(distance[0] * (room / distance[0]) ** rng.random())
        if d <= room:  # else the fact stays a distractor
            heapq.heappush(pending, (len(ids) + d, len(ids), q_ids, q_mask))
    assert len(ids) == len(mask) <= max_len  # questions still pending here are dropped: their distance not reached
    return ids, mask


# ---- held-out tasks -----------------------------------------------------------------------------------------


def _as_task(ep: _Episode, history: list[Message]) -> Task:
    # the eval's "right arguments" is the right file or pattern: read_file's line range is judged by the answer,
    # and a file question answered with grep by its path (any pattern that finds the definition will do)
    keep = ("path",) if ep.kind == "read_file" else ("path", "pattern")
    args = {k: v for k, v in ep.arguments.items() if k in keep}
    return Task(ep.kind, ep.variant, [*history, ep.messages[0]], ep.tool, args, ep.fact)


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
