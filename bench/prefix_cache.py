"""Prefix cache across conversations: N coding agents sharing a system prompt and tools, through the openai SDK.

    python bench/prefix_cache.py [--agents 6] [--turns 8] [--system-tokens 3300] [--file-chars 1500] [--out FILE]

Starts ``kda-sessions serve --model tiny-random`` (CPU, a fresh disk store in a temp dir) as a child process and
runs --agents agents at once, each a stateless client that resends its full history every turn (as agent
frameworks do): the same system prompt (about --system-tokens tokens, the repository's own docs) and four tools,
a task of its own, then --turns turns where the model's reply (16 tokens, greedy) is followed by a message
holding --file-chars characters of real files of this repository (a tool's output, sent as a user message because
tiny-random's replies are not tool calls; long ones span several of the engine's interval checkpoints). Turns of
different agents interleave; the first agent's first turn goes first.

Reports, over all requests: prompt tokens, cached tokens (``prompt_tokens_details.cached_tokens``) and what perfect
reuse would give (for each request, its longest token prefix in common with any earlier request's prompt plus
reply, as the server's template renders them), the cached share against perfect, and how much of the shared head
each conversation after the first reused on its first turn. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kda_sessions.tokenizer import ByteTokenizer, builtin_template, encode_chat

TOOLS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "repository-relative path"}},
        "required": ["path"]}}}
    for name, text in (
        ("read_file", "Read a file of the repository and return its text."),
        ("list_dir", "List the entries of a folder of the repository."),
        ("grep", "Search the repository for a pattern; return matching lines with their paths."),
        ("run_tests", "Run the tests under a path and return the summary."),
    )
]
TASKS = (
    "The snapshot manifest check rejects valid files; find out why.",
    "Add a --quiet flag to the CLI.",
    "Why does the prefix index miss on resent histories?",
    "Document the lease renewal policy.",
    "Make the scheduler's prefill chunk configurable per request.",
    "Find where the KV page allocator can leak a page.",
)
FILES = sorted(p for p in (common.REPO / "kda_sessions").rglob("*.py") if p.stat().st_size > 2000)


def system_prompt(tokens: int) -> str:
    """About ``tokens`` byte tokens of the repository's own docs: a realistic, stable agent instruction."""
    text = "You are a coding agent working in this repository. Its design notes follow.\n\n"
    for doc in ("README.md", "docs/server.md", "docs/storage.md", "docs/reliability.md"):
        text += (common.REPO / doc).read_text()
    return text[:tokens]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kda_sessions.cli", "serve", "--model", "tiny-random", "--store", store,
           "--port", str(port), "--chat-session-idle", "600"]
    with open(log, "wb") as err:  # a pipe nobody reads would block the server once full
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in 180 s")


class Trace:
    """Every request's token counts, and the token sequences seen so far (for perfect reuse)."""

    def __init__(self) -> None:
        self.tok, self.tpl = ByteTokenizer(), builtin_template()
        self.seen: list[list[int]] = []
        self.rows: list[dict[str, Any]] = []

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return encode_chat(self.tok, messages, TOOLS, add_generation_prompt=True, template=self.tpl)

    def perfect(self, ids: list[int]) -> int:
        return max((common_prefix(ids, s) for s in self.seen), default=0)


def tool_output(start: int, chars: int) -> str:
    """``chars`` characters of the repository's source files, from the ``start``-th file on."""
    text = ""
    for k in range(len(FILES)):
        path = FILES[(start + k) % len(FILES)]
        text += f"read_file {path.relative_to(common.REPO)}:\n{path.read_text()}\n"
        if len(text) >= chars:
            break
    return text[:chars]


async def agent(
    i: int, oai: openai.AsyncOpenAI, system: str, args: argparse.Namespace, trace: Trace, start: anyio.Event
) -> None:
    turns = args.turns
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": TASKS[i % len(TASKS)]}]
    if i:
        await start.wait()  # the first agent's first turn goes first, as when agents start one after another
    for turn in range(turns):
        ids = trace.prompt(messages)
        perfect = trace.perfect(ids)
        r = await oai.chat.completions.create(
            model="tiny-random", messages=messages, tools=TOOLS, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )
        if i == 0 and turn == 0:
            start.set()
        reply = r.choices[0].message.content or ""
        trace.rows.append({"agent": i, "turn": turn, "prompt": r.usage.prompt_tokens,
                           "cached": r.usage.prompt_tokens_details.cached_tokens, "perfect": perfect})
        messages.append({"role": "assistant", "content": reply})
        trace.seen.append(encode_chat(trace.tok, messages, TOOLS, add_generation_prompt=False, template=trace.tpl))
        messages.append({"role": "user", "content": tool_output(i * turns + turn, args.file_chars)})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    system = system_prompt(args.system_tokens)
    trace = Trace()
    head = len(encode_chat(trace.tok, [{"role": "system", "content": system}], TOOLS, add_generation_prompt=False,
                           template=trace.tpl))
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_server(f"disk:{tmp}/store", port, Path(tmp) / "server.log")
        try:
            t0 = time.perf_counter()
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600,
                                          max_retries=0) as oai:
                start = anyio.Event()
                async with anyio.create_task_group() as tg:
                    for i in range(args.agents):
                        tg.start_soon(agent, i, oai, system, args, trace, start)
            seconds = time.perf_counter() - t0
            stats = httpx.get(f"http://127.0.0.1:{port}/v1/stats", timeout=10).json()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    rows = trace.rows
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    perfect = sum(r["perfect"] for r in rows)
    first_turns = [r["cached"] / head for r in rows if r["turn"] == 0 and r["agent"] > 0]
    return {
        "bench": "prefix_cache", "agents": args.agents, "turns": args.turns, "file_chars": args.file_chars,
        "shared_head_tokens": head,
        "requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached, "perfect_cached_tokens": perfect,
        "cached_share": round(cached / prompt, 4), "perfect_share": round(perfect / prompt, 4),
        "cached_vs_perfect": round(cached / perfect, 4) if perfect else None,
        "first_turn_head_reuse_min": round(min(first_turns), 4) if first_turns else None,
        "prefix_cache": {k: stats.get(k) for k in ("prefix_cache_lookups", "prefix_cache_hits", "prefix_cache_hit_tokens",
                                                   "prefix_index_entries", "checkpoint_states_in_memory")},
        "seconds": round(seconds, 1), "machine": common.machine(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=3300)
    ap.add_argument("--file-chars", type=int, default=1500, help="characters of each tool output")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = anyio.run(run, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
