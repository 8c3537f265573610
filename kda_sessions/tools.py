"""Real, read-only coding tools over one folder (list_dir, read_file, grep), with their OpenAI schemas.

Used by the demo and the examples. Paths are resolved inside the root folder only; output is capped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
            "description": "Read a text file, relative to the project root.",
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


class ToolError(ValueError):
    """A tool call that cannot run (unknown tool, bad arguments, path outside the root)."""


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

    def read_file(self, path: str) -> str:
        p = self._path(path)
        if not p.is_file():
            raise ToolError(f"{path!r} is not a file")
        return p.read_text(errors="replace")[:MAX_OUTPUT]

    def grep(self, pattern: str, path: str = ".") -> str:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ToolError(f"bad pattern {pattern!r}: {e}") from None
        base = self._path(path)
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        out: list[str] = []
        for f in files:
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
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
