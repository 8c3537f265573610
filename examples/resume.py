"""Save a session, then resume it in a brand-new engine (or client) without re-prefilling.

In process by default, or against a running server with --url (same methods either way):
    python examples/resume.py [--store disk:/tmp/kda-example] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import anyio

import kda_sessions as ks


async def open_engine(args: argparse.Namespace) -> ks.Engine | ks.Client:
    """A new engine on the store, or a new connection to the server: either one can resume the session."""
    if args.url:
        return ks.Client(args.url)
    return await ks.Engine.open(model="tiny", store=args.store)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=f"disk:{tempfile.mkdtemp(prefix='kda-example-')}")
    ap.add_argument("--url", help="a kda-sessions server; default: an in-process engine on --store")
    args = ap.parse_args()
    history = "def add(a, b):\n    return a + b\n" * 200  # a long tool output
    async with await open_engine(args) as engine:
        s = await engine.create_session(system="You review code.")
        r = await s.send(f"Review this file:\n{history}", max_tokens=8)
        print(f"first turn: prefilled {r.usage.prefill_tokens} tokens")
        await s.save()
        sid = s.id
    async with await open_engine(args) as engine:  # e.g. after a restart
        t0 = time.perf_counter()
        s = await engine.resume(sid)
        r = await s.send("Any bugs?", max_tokens=8)
        print(f"resumed {sid} ({s.num_tokens} tokens): {time.perf_counter() - t0:.3f} s to the reply, "
              f"prefilled {r.usage.prefill_tokens} new tokens, reused {r.usage.cached_tokens}")


if __name__ == "__main__":
    anyio.run(main)
