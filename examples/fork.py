"""Several forks explore alternatives from one shared prefix, in parallel, without re-prefilling it.

In process by default, or against a running server with --url (same methods either way):
    python examples/fork.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse

import anyio

import kda_sessions as ks
from kda_sessions.protocol import EngineLike, SessionLike


async def explore_forks(engine: EngineLike) -> None:
    root = await engine.create_session(system="You are a planning agent.")
    await root.send("Here is a large codebase summary. " * 100, max_tokens=4)
    await root.checkpoint("plan")
    options = ["Refactor the parser.", "Add tests first.", "Profile the hot path.", "Rewrite in Rust."]
    forks = [await engine.fork(root.id, checkpoint="plan") for _ in options]
    results: dict[str, ks.Reply] = {}

    async def explore(child: SessionLike, option: str) -> None:
        results[option] = await child.send(option, max_tokens=16, temperature=0.8, seed=len(option))

    async with anyio.create_task_group() as tg:  # decoded together in one batch
        for child, option in zip(forks, options):
            tg.start_soon(explore, child, option)
    for option in options:
        u = results[option].usage
        print(f"{option:24s} prefilled {u.prefill_tokens:4d}, reused {u.cached_tokens:5d} of the shared prefix")
    print(engine.stats()["pages_free"], "KV pages free: full prefix pages are shared, not copied")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a kda-sessions server; default: an in-process engine")
    args = ap.parse_args()
    if args.url:
        async with ks.Client(args.url) as client:
            await explore_forks(client)
    else:
        async with await ks.Engine.open(model="tiny", store="memory:") as engine:
            await explore_forks(engine)


if __name__ == "__main__":
    anyio.run(main)
