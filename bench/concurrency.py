"""Decode throughput with many sessions generating at once (continuous batching), and time to first token of a
new message in a long session vs a stateless resend of the whole history.

    python bench/concurrency.py [--quick] [--out FILE]

decode: N sessions (N = 1, 4, 16, 64) each holding a ``--prompt``-token context, then ``generate(max_tokens=
--tokens, ignore_eos=True)`` on all of them at once in one anyio task group; tokens/s = N x tokens / wall time.
ttft: a session holding ``--history`` tokens receives ``send(message, max_tokens=1)`` (prefill of the new
message only); the stateless resend is a fresh session that appends the same full prompt (history + message,
identical token ids) and calls ``generate(max_tokens=1)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import Timer

MESSAGE = "Please run the failing test again and tell me which assertion breaks."


async def decode_concurrent(eng, n: int, prompt: int, tokens: int) -> dict[str, Any]:
    sessions = []
    for i in range(n):
        s = await eng.create_session()
        await s.append(common.random_tokens(prompt, seed=1000 * n + i))
        sessions.append(s)
    replies: list[Any] = []

    async def one(s) -> None:
        replies.append(await s.generate(max_tokens=tokens, ignore_eos=True))

    steps0 = eng.runner.steps
    quiet = common.wait_quiet()
    with Timer() as t:
        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(one, s)
    generated = sum(r.usage.completion_tokens for r in replies)
    out = {"sessions": n, "tokens_each": tokens, "generated": generated, "wall_s": t.s,
           "tok_per_s": generated / t.s, "engine_steps": eng.runner.steps - steps0, "cores": t.cores, "quiet": quiet}
    for s in sessions:
        await eng.delete_session(s.id)
    return out


async def ttft_history(eng, history: int) -> dict[str, Any]:
    s = await eng.create_session()
    await s.append(common.random_tokens(history, seed=7))
    quiet = common.wait_quiet()
    with Timer() as t:
        r = await s.send(MESSAGE, max_tokens=1, ignore_eos=True)
    prompt = s.state.tokens[: r.usage.prompt_tokens]
    fresh = await eng.create_session()
    quiet2 = common.wait_quiet()
    with Timer() as t2:
        u = await fresh.append(prompt)
        r2 = await fresh.generate(max_tokens=1, ignore_eos=True)
    return {
        "history_tokens": history,
        "prompt_tokens": r.usage.prompt_tokens,
        "session_ttft_s": t.s,
        "session_prefill_tokens": r.usage.prefill_tokens,
        "session_cached_tokens": r.usage.cached_tokens,
        "stateless_ttft_s": t2.s,
        "stateless_prefill_tokens": u.prefill_tokens + r2.usage.prefill_tokens,
        "speedup": t2.s / t.s,
        "same_first_token": r.token_ids == r2.token_ids,
        "stateless_cores": t2.cores,
        "quiet": [quiet, quiet2],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    notes: list[str] = []
    result: dict[str, Any] = {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "notes": notes}
    async with await common.open_engine("tiny-random", "memory:", notes, max_active_sessions=max(64, *args.sessions)) as eng:
        await decode_concurrent(eng, 1, args.prompt, 4)  # warm-up
        result["decode"] = [await decode_concurrent(eng, n, args.prompt, args.tokens) for n in args.sessions]
        for row in result["decode"]:
            print(f"# decode {row}", file=sys.stderr, flush=True)
        result["ttft"] = await ttft_history(eng, args.history)
        print(f"# ttft {result['ttft']}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1, 4, 16 sessions x 8 tokens, 2K history")
    p.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--tokens", type=int, default=32, help="tokens each session generates")
    p.add_argument("--prompt", type=int, default=128, help="context tokens of each decoding session")
    p.add_argument("--history", type=int, default=16384)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.quick:
        common.MAX_WAIT_S = 5.0
        args.sessions, args.tokens, args.history = [1, 4, 16], 8, 2048
    common.emit(anyio.run(run, args), args.out)


if __name__ == "__main__":
    main()
