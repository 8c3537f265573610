"""Save a session, then resume it in a brand-new engine without re-prefilling.

    python examples/resume.py [--store disk:/tmp/kda-example]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import anyio

import kda_sessions as ks


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=f"disk:{tempfile.mkdtemp(prefix='kda-example-')}")
    args = ap.parse_args()
    history = "def add(a, b):\n    return a + b\n" * 200  # a long tool output
    async with await ks.Engine.open(model="tiny", store=args.store) as engine:
        s = await engine.create_session(system="You review code.")
        r = await s.send(f"Review this file:\n{history}", max_tokens=8)
        print(f"first turn: prefilled {r.usage.prefill_tokens} tokens")
        await s.save()
        sid = s.id
    async with await ks.Engine.open(model="tiny", store=args.store) as engine:  # e.g. after a restart
        t0 = time.perf_counter()
        s = await engine.resume(sid)
        r = await s.send("Any bugs?", max_tokens=8)
        print(f"resumed {sid} in a new engine: {time.perf_counter() - t0:.3f} s to the reply, "
              f"prefilled {r.usage.prefill_tokens} new tokens, reused {r.usage.cached_tokens}")


if __name__ == "__main__":
    anyio.run(main)
