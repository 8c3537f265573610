"""``tiny``'s agent loop on the CPU with each ``cpu_decode_threads`` setting, on a quiet machine and beside a busy one.

    python bench/cpu_threads.py [--settings auto,1,2] [--turns 6] [--reps 3] [--against REF] [--out FILE]

An agent loop: one session through the Engine, ``--turns`` times 512 tokens appended (a tool output) and 32 generated
(greedy, ``ignore_eos``); the wall time of the loop, in a fresh process per run (the OpenMP teams a process holds
decide what 2 threads cost: EngineConfig.cpu_decode_threads). Each setting runs ``--reps`` times quiet, then as many
times beside a busy process (a Python loop spinning on one core, as another program on a laptop would): medians.
``--against REF`` adds the library at git REF with its defaults (``bench/cpu_engine.py``'s export) as a setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

CHILD = """
import asyncio, json, sys, time
import {pkg} as ks
async def main():
    kw = {kw}
    async with await ks.Engine.open(model="tiny", store="memory:", **kw) as e:
        s = await e.create_session()
        toks = [(i * 31) % 250 for i in range(512)]
        t = time.perf_counter()
        for _ in range({turns}):
            await s.append(toks)
            await s.generate(max_tokens=32, ignore_eos=True)
        print(json.dumps({{"s": time.perf_counter() - t}}))
asyncio.run(main())
"""

SPIN = "while True:\n    pass\n"


def run_once(pkg: str, setting: str, turns: int, path: list[str]) -> float:
    kw = {} if setting in ("auto", "ref") else {"cpu_decode_threads": int(setting)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", CHILD.format(pkg=pkg, kw=kw, turns=turns)], env=env,
                         capture_output=True, text=True, check=True, cwd=common.REPO).stdout
    return float(json.loads(out.strip().splitlines()[-1])["s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="auto,1,2")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--against", default=None, metavar="REF")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    settings = args.settings.split(",")
    path: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            from cpu_engine import export_ref

            export_ref(args.against, Path(tmp))
            settings.append("ref")
            path.append(tmp)
        res: dict[str, Any] = {"machine": common.machine(), "command": " ".join(sys.argv),
                               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "turns": args.turns}
        for busy in (False, True):
            spin = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
            try:
                time.sleep(0.5 if busy else 0)
                for s in settings:
                    pkg = "kda_ref" if s == "ref" else "kda_sessions"
                    times = [run_once(pkg, s, args.turns, path) for _ in range(args.reps)]
                    key = f"{'busy' if busy else 'quiet'} {args.against if s == 'ref' else s}"
                    res[key] = {"median_s": round(statistics.median(times), 2), "runs_s": [round(t, 2) for t in times]}
                    print(f"{key}: {res[key]}", file=sys.stderr, flush=True)
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
