"""The demo's recall question after other orders of its turns: which tool output a model recalls from.

    python tools/demo_recall.py [--model tiny] [--out FILE]

``kda-sessions demo`` lists the package folder, greps ``__init__.py`` for its first definition, greps ``api.py`` for
``class Engine``, then asks "Earlier you searched api.py for `class Engine`. Which line was it on?". Here each variant
(``VARIANTS``) asks some of those questions in a new session over the same folder (greedy, the model's calls run by
the real ``Tools``; a scripted call stands in where the model makes none, as in the demo), then that recall question,
and prints the reply and whether it holds the line the grep showed. With the `tiny` of docs/tiny.md: right after the
grep alone or before the other grep, wrong in the demo's order (the other grep's line) and after the listing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import Any

import kda_sessions
from kda_sessions.api import Engine
from kda_sessions.demo import SYSTEM
from kda_sessions.tools import TOOL_SCHEMAS, Tools

LIST = ("What is the first entry of the project root?", "list_dir", {"path": "."})
FIRST_DEF = ("What is the first function or class defined in __init__.py?", "grep",
             {"pattern": "^(async def|def|class) ", "path": "__init__.py"})
TARGET = ("On which line of api.py is `class Engine` defined?", "grep", {"pattern": "class Engine", "path": "api.py"})
QUESTION = "Earlier you searched api.py for `class Engine`. Which line was it on?"
VARIANTS = {
    "demo": [LIST, FIRST_DEF, TARGET],
    "listing, then the grep": [LIST, TARGET],
    "the grep alone": [TARGET],
    "the grep, then the other grep": [TARGET, FIRST_DEF],
}


async def run(model: str, max_tokens: int = 160) -> dict[str, Any]:
    root = Path(kda_sessions.__file__).resolve().parent
    tools = Tools(root)
    found = re.match(r"(?:api\.py:)?(\d+): ", tools.call("grep", json.dumps(TARGET[2])))  # "api.py:46: class ..."
    assert found is not None, "the package's api.py defines class Engine"
    line = found.group(1)
    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
    out: dict[str, Any] = {"model": model, "line": line, "variants": {}}
    async with await Engine.open(model=model, store="memory:") as engine:
        for name, turns in VARIANTS.items():
            s = await engine.create_session(system=SYSTEM, tools=TOOL_SCHEMAS)
            for i, (question, tool, args) in enumerate(turns):
                r = await s.send(question, **sampling)
                messages: list[dict[str, Any]] = []
                if r.tool_calls:
                    call = r.tool_calls[0].model_dump()
                else:  # scripted, as the demo does
                    call = {"id": f"functions.{tool}:{i}", "type": "function",
                            "function": {"name": tool, "arguments": json.dumps(args)}}
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                try:
                    result = tools.call(call["function"]["name"], call["function"]["arguments"])
                except Exception as e:  # a bad call becomes an error result, as an agent would send it
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                await s.send_messages(messages, **sampling)
            r = await s.send(QUESTION, **sampling)
            right = re.search(rf"\bline {line}\b", r.text) is not None
            out["variants"][name] = {"reply": r.text, "right": right}
            print(f"{name:32s} {'right' if right else 'wrong'}: {r.text[:100]!r}")
            await engine.delete_session(s.id)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", help="write the replies as JSON here")
    args = ap.parse_args(argv)
    out = asyncio.run(run(args.model, args.max_tokens))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
