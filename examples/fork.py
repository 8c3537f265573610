"""Several forks explore alternatives from one shared prefix, in parallel, without re-prefilling it.

    python examples/fork.py
"""

from __future__ import annotations

import anyio

import kda_sessions as ks


async def main() -> None:
    async with await ks.Engine.open(model="tiny", store="memory:") as engine:
        root = await engine.create_session(system="You are a planning agent.")
        await root.send("Here is a large codebase summary. " * 100, max_tokens=4)
        await root.checkpoint("plan")
        options = ["Refactor the parser.", "Add tests first.", "Profile the hot path.", "Rewrite in Rust."]
        forks = [await engine.fork(root.id, checkpoint="plan") for _ in options]
        results: dict[str, ks.Reply] = {}

        async def explore(child: ks.Session, option: str) -> None:
            results[option] = await child.send(option, max_tokens=16, temperature=0.8, seed=len(option))

        async with anyio.create_task_group() as tg:  # decoded together in one batch
            for child, option in zip(forks, options):
                tg.start_soon(explore, child, option)
        for option in options:
            u = results[option].usage
            print(f"{option:24s} prefilled {u.prefill_tokens:4d}, reused {u.cached_tokens:5d} of the shared prefix")
        print(engine.stats()["pages_free"], "KV pages free: full prefix pages are shared, not copied")


if __name__ == "__main__":
    anyio.run(main)
