"""``kda-sessions demo``: a coding-agent loop on the embedded defaults (built-in ``tiny`` model, disk store).

It asks three questions about a real folder that need real tools (the model makes the calls; a scripted call
stands in when it makes none), checkpoints, asks a recall question, saves, resumes the session in a NEW engine,
forks two alternatives from one checkpoint, and prints time to first token: resumed vs re-prefilled.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .api import Engine
from .engine.config import EngineConfig
from .tools import TOOL_SCHEMAS, Tools

SYSTEM = "You are a careful coding agent. Use the tools to look at the project before you answer."


def _call(name: str, args: dict[str, Any], index: int) -> dict[str, Any]:
    return {"id": f"functions.{name}:{index}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


async def run_demo(
    folder: str | Path | None = None,
    model: str = "tiny",
    store: str = "disk:",
    say: Callable[[str], None] = print,
    max_tokens: int | None = None,
    config: EngineConfig | None = None,
    device: str = "cpu",
    dtype: Any = None,
) -> dict[str, Any]:
    root = Path(folder) if folder else Path(__file__).resolve().parent
    where: dict[str, Any] = {"device": device} | ({} if dtype is None else {"dtype": dtype})
    tools = Tools(root)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    # files with top-level defs or classes (the kinds of question tiny was trained on: it answers "first def or
    # class" by grepping the file for definitions, "which line" by grepping for the definition)
    defs = [(f, m) for f in files if (m := re.findall(r"^((?:async def|def|class) \w+)",
                                                      (root / f).read_text(errors="replace"), re.M))]
    d_file = defs[0][0] if defs else (files[0] if files else "README.md")
    g_file, g_pats = defs[1] if len(defs) > 1 else defs[0] if defs else (d_file, ["def main"])
    g_pat = g_pats[len(g_pats) // 2]
    turns = [
        ("What is the first entry of the project root?", "list_dir", {"path": "."}),
        (f"What is the first function or class defined in {d_file}?", "grep",
         {"pattern": "^(async def|def|class) ", "path": d_file}),
        (f"On which line of {g_file} is `{g_pat}` defined?", "grep", {"pattern": g_pat, "path": g_file}),
    ]
    say(f"model: {model}   store: {store}   folder: {root}")
    if model == "tiny-random":
        say("(tiny-random has random weights: its words are noise; the tool calls below are scripted when the "
            "model makes none, and every tool result is real)")
    elif model == "tiny":
        say("(tiny: a 9M-parameter byte-level model trained to call these tools; its calls and answers are its "
            "own, a scripted call stands in when it makes none; its scores are in docs/tiny.md)")
    # a byte-level tool call takes 60-150 tokens; random weights rarely make one, so they get short turns
    sampling = {"max_tokens": max_tokens or (16 if model == "tiny-random" else 160), "temperature": 0.0}
    outputs: list[str] = []
    async with await Engine.open(model=model, store=store, config=config, **where) as engine:
        s = await engine.create_session(system=SYSTEM, tools=TOOL_SCHEMAS)
        for i, (question, name, args) in enumerate(turns):
            r = await s.send(question, **sampling)
            say(f"[{s.id}] user: {question}")
            if r.tool_calls:
                call, who = r.tool_calls[0].model_dump(), "model"
                messages: list[dict[str, Any]] = []
            else:
                call, who = _call(name, args, i), "scripted"
                messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
            try:
                output = tools.call(call["function"]["name"], call["function"]["arguments"])
            except Exception as e:  # a bad call from the model becomes an error result, as an agent would do
                output = f"error: {e}"
            outputs.append(output)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
            r = await s.send_messages(messages, **sampling)
            say(f"  tool ({who}) {call['function']['name']}({call['function']['arguments']}) -> {len(output)} chars; "
                f"context {s.num_tokens} tokens; prefilled {r.usage.prefill_tokens}, reused {r.usage.cached_tokens}")
            say(f"  assistant: {r.text[:100]!r}")
        await s.checkpoint("explored")
        r = await s.send(f"Earlier you searched {g_file} for `{g_pat}`. Which line was it on?", **sampling)
        # the line the search showed (a call of the model's may have searched elsewhere: then there is no check)
        found = re.match(rf"(?:{re.escape(g_file)}:)?(\d+): ", outputs[-1])
        recall_right = None if found is None else re.search(rf"\bline {found.group(1)}\b", r.text) is not None
        verdict = "" if found is None else f" (the search showed line {found.group(1)}: {'right' if recall_right else 'wrong'})"
        say(f"  recall, {s.num_tokens} tokens in: {r.text[:100]!r}{verdict}")
        t0 = time.perf_counter()
        await s.save()
        say(f"checkpoint 'explored', one more turn, saved in {time.perf_counter() - t0:.3f} s ({s.num_tokens} tokens)")
        sid, context = s.id, s.num_tokens
        tokens = list(s.state.tokens)

    # a NEW engine: the session comes back from the store, no prefill
    async with await Engine.open(model=model, store=store, config=config, **where) as engine:
        t0 = time.perf_counter()
        s2 = await engine.resume(sid)
        r = await s2.send("What next?", max_tokens=1)
        resumed = time.perf_counter() - t0
        say(f"new engine resumed {sid}: first token after {resumed * 1000:.1f} ms, "
            f"prefilled {r.usage.prefill_tokens} tokens, reused {r.usage.cached_tokens}")
        a = await engine.fork(sid, "explored")
        b = await engine.fork(sid, "explored")
        ra = await a.send("Focus on the tests.", **sampling)
        rb = await b.send("Focus on the kernels.", **sampling)
        for child, rr in ((a, ra), (b, rb)):
            say(f"  fork {child.id} from 'explored': prefilled {rr.usage.prefill_tokens}, reused {rr.usage.cached_tokens}")
        await a.save()
        await b.save()

    # the same context re-prefilled from scratch, in an engine with nothing stored
    async with await Engine.open(model=model, store="memory:", config=config, **where) as engine:
        fresh = await engine.create_session()
        t0 = time.perf_counter()
        await fresh.append(tokens)
        await fresh.generate(max_tokens=1)
        reprefill = time.perf_counter() - t0
    say("")
    say("| context tokens | TTFT resumed | TTFT re-prefilled | speedup |")
    say("|---:|---:|---:|---:|")
    say(f"| {context} | {resumed * 1000:.1f} ms | {reprefill * 1000:.1f} ms | {reprefill / resumed:.1f}x |")
    return {"session_id": sid, "context_tokens": context, "ttft_resumed_s": resumed, "ttft_reprefill_s": reprefill,
            "recall_right": recall_right}
