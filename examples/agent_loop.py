"""An agent loop over real tools, driven through the async client interface.

Runs against an in-process engine by default, or a running server with --url (same methods either way):
    python examples/agent_loop.py [--url http://127.0.0.1:8000] [--dir PATH]
The built-in `tiny` model (9M parameters, trained on such loops) calls the tools itself; see docs/tiny.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

import kda_sessions as ks
from kda_sessions.tools import TOOL_SCHEMAS, Tools


async def run(engine, tools: Tools, task: str, max_turns: int = 4) -> None:
    s = await engine.create_session(system="You are a coding agent. Call tools to inspect files.", tools=TOOL_SCHEMAS)
    reply = await s.send(task, max_tokens=160)
    for _ in range(max_turns):
        print(f"assistant ({reply.finish_reason}): {reply.text[:80]!r}")
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                output = tools.call(call.function.name, call.function.arguments)
            except Exception as e:  # the model sees the error and can try again
                output = f"error: {e}"
            print(f"  tool {call.function.name}({call.function.arguments}) -> {len(output)} chars")
            reply = await s.send_tool_result(call.id, output, max_tokens=160)
    print(f"session {s.id}: {s.num_tokens} tokens; last usage {reply.usage}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a kda-sessions server; default: an in-process engine")
    ap.add_argument("--dir", default=str(Path(ks.__file__).parent))
    args = ap.parse_args()
    tools = Tools(args.dir)
    task = "List the project files, read the main module and tell me what it exports."
    if args.url:
        async with ks.Client(args.url) as client:
            await run(client, tools, task)
    else:
        async with await ks.Engine.open(model="tiny", store="memory:") as engine:
            await run(engine, tools, task)


if __name__ == "__main__":
    anyio.run(main)
