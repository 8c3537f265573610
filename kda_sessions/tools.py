"""Real, read-only coding tools over one folder (list_dir, read_file, grep), with their OpenAI schemas.

Used by the demo and the examples. Paths are resolved inside the root folder only; output is capped at
MAX_OUTPUT characters. read_file numbers its lines as ``cat -n`` does (so "what is on line N" is a lookup, not
a count), and grep counts lines the same way: lines end at "\n" only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kda_sessions.errors import ToolError

MAX_OUTPUT = 8000

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List the entries of a directory, relative to the project root.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": (
                "Read a text file, relative to the project root, with numbered lines (as cat -n); "
                "optionally only `limit` lines from line `start` (1-based)."
            ),
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start": {"type": "integer"}, "limit": {"type": "integer"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Lines matching a regular expression in the files under a directory.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                "required": ["pattern"],
                "additionalProperties": False,
            },
        },
    },
]


def _lines(text: str) -> list[str]:
    """The lines of a file as ``cat -n`` and ``grep -n`` count them: split at "\n" only (str.splitlines also
    splits at form feeds and other breaks, which would make the tools' line numbers disagree with editors)."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def number_lines(text: str, limit: int = MAX_OUTPUT, start: int = 1, count: int | None = None) -> str:
    """``cat -n`` of text (f"{n:>6}\t{line}" per line) from line ``start`` (1-based), at most ``count`` lines,
    cut after the last whole line within ``limit`` characters (a first line longer than that is cut at
    ``limit``)."""
    return _numbered(_lines(text), limit, start, count)


def _numbered(lines: list[str], limit: int, start: int, count: int | None) -> str:
    out: list[str] = []
    size = -1  # no "\n" before the first line
    stop = len(lines) if count is None else min(len(lines), start - 1 + count)
    for n, line in enumerate(lines[start - 1:stop], start):
        row = f"{n:>6}\t{line}"
        if size + 1 + len(row) > limit:
            if not out:
                out.append(row[:limit])
            break
        out.append(row)
        size += 1 + len(row)
    return "\n".join(out)


def _line_arg(name: str, v: Any) -> Any:
    """A line number argument as an int >= 1 (JSON may send 3.0 for 3), else a ToolError; None stays None."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ToolError(f"read_file's {name} must be an integer >= 1, got {v!r}")
    return v


class Tools:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    def _path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if p != self.root and self.root not in p.parents:
            raise ToolError(f"path {rel!r} is outside the project root")
        return p

    def list_dir(self, path: str = ".") -> str:
        p = self._path(path)
        if not p.is_dir():
            raise ToolError(f"{path!r} is not a directory")
        entries = sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir() if not e.name.startswith("."))
        return "\n".join(entries)

    def read_file(self, path: str, start: int = 1, limit: int | None = None) -> str:
        """The file's lines numbered as by ``cat -n``; with ``start`` / ``limit``, only lines start ..
        start + limit - 1 (an agent's way to look at one place of a long file)."""
        start, limit = _line_arg("start", start), _line_arg("limit", limit)
        p = self._path(path)
        if not p.is_file():
            raise ToolError(f"{path!r} is not a file")
        lines = _lines(p.read_text(errors="replace"))
        if start > max(len(lines), 1):
            raise ToolError(f"{path!r} has {len(lines)} lines; start {start} is past its end")
        return _numbered(lines, MAX_OUTPUT, start, limit)

    def grep(self, pattern: str, path: str = ".") -> str:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ToolError(f"bad pattern {pattern!r}: {e}") from None
        base = self._path(path)
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        out: list[str] = []
        for f in files:
            for n, line in enumerate(_lines(f.read_text(errors="replace")), 1):
                if rx.search(line):
                    out.append(f"{f.relative_to(self.root)}:{n}: {line.strip()}")
        return "\n".join(out)[:MAX_OUTPUT]

    def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        fns: dict[str, Callable[..., str]] = {"list_dir": self.list_dir, "read_file": self.read_file, "grep": self.grep}
        fn = fns.get(name)
        if fn is None:
            raise ToolError(f"unknown tool {name!r}")
        try:
            return fn(**args)
        except TypeError as e:
            raise ToolError(f"bad arguments for {name}: {e}") from None
