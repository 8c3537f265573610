"""The prefill schedule through the Engine on the CPU (tiny-random): long prompts alone, and while others decode.

    python bench/prefill_schedule.py [--prompts 4096,8192,16384] [--decoders 2] [--reps 1] [--out FILE]

For each schedule (``--schedules``, each ``BUSY:IDLE`` = EngineConfig's prefill_chunk_tokens and
prefill_chunk_tokens_idle; ``before`` 2048:2048 is the schedule without an idle budget, ``after`` 2048:8192 the
default, ``big`` 8192:8192 the larger chunk with decoders running too), in one engine:
- ``alone``: the ``--prompts`` appended by as many sessions at once; tokens/s over all of them, the model calls.
- ``with_decode``: ``--decoders`` sessions (512 tokens of context each) generate throughout while the same
  prompts are appended; prefill tokens/s, decode tokens/s, and the decoders' inter-token latency: the time
  between the ends of consecutive decode model calls while the prompts run (the step a token waits for,
  without the hand-over to the event loop), p50 / p99 / max; beside it the same decoders' step with nothing
  prefilling (``decode_only_ms``, p50).

Schedules run in turns (``--reps`` rounds), one torch thread each (``--threads``); the 1-minute load average is
recorded with every figure: the machine is shared.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import kda_sessions as ks
from kda_sessions.model import ForwardBatch

SCHEDULES = {"before": (2048, 2048), "after": (2048, 8192), "big": (8192, 8192)}
CONTEXT = 512
"""Tokens of each decoder's context before it starts generating."""


class Calls:
    """Every model call of an engine: (end time, num_new of each row, seconds)."""

    def __init__(self, eng: ks.Engine) -> None:
        self.log: list[tuple[float, list[int], float]] = []
        step = eng.model.step

        def recorded(batch: ForwardBatch, pools: Any) -> Any:
            t = time.perf_counter()
            out = step(batch, pools)
            end = time.perf_counter()
            self.log.append((end, list(batch.num_new), end - t))
            return out

        eng.model.step = recorded  # type: ignore[method-assign]

    def since(self, t0: float, t1: float = float("inf")) -> list[tuple[float, list[int], float]]:
        return [c for c in self.log if t0 <= c[0] <= t1]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def decode_gaps(calls: list[tuple[float, list[int], float]]) -> list[float]:
    ends = [t for t, rows, _ in calls if all(n == 1 for n in rows)]
    return [b - a for a, b in itertools.pairwise(ends)]


async def append_all(sessions: list[Any], prompts: list[list[int]]) -> None:
    async with anyio.create_task_group() as tg:
        for s, p in zip(sessions, prompts):
            tg.start_soon(s.append, p)


async def run_schedule(busy: int, idle: int, prompts: list[list[int]], decoders: int) -> dict[str, Any]:
    total = sum(len(p) for p in prompts)
    async with await ks.Engine.open(model="tiny-random", store="memory:", prefill_chunk_tokens=busy,
                                    prefill_chunk_tokens_idle=idle) as eng:
        calls = Calls(eng)
        warm = await eng.create_session()
        await warm.append(common.random_tokens(300, seed=99))
        await warm.generate(max_tokens=4, ignore_eos=True)
        await eng.delete_session(warm.id)

        out: dict[str, Any] = {"busy": busy, "idle": idle}
        sessions = [await eng.create_session() for _ in prompts]
        load, t0 = os.getloadavg()[0], time.perf_counter()
        await append_all(sessions, prompts)
        wall = time.perf_counter() - t0
        out["alone"] = {"tok_per_s": round(total / wall), "s": round(wall, 2), "model_calls": len(calls.since(t0)),
                        "load": round(load, 2)}
        for s in sessions:
            await eng.delete_session(s.id)

        gens = [await eng.create_session() for _ in range(decoders)]
        for i, g in enumerate(gens):
            await g.append(common.random_tokens(CONTEXT, seed=50 + i))
        sessions = [await eng.create_session() for _ in prompts]
        decoded = {"n": 0}

        async def generate(g: Any) -> None:
            r = await g.generate(max_tokens=100_000 // max(1, decoders), ignore_eos=True)
            decoded["n"] += len(r.token_ids)

        async with anyio.create_task_group() as tg:
            for g in gens:
                tg.start_soon(generate, g)
            t_dec = time.perf_counter()
            while decoders and len(decode_gaps(calls.since(t_dec))) < 10:
                await anyio.sleep(0.01)
            quiet = decode_gaps(calls.since(t_dec))
            load, t0 = os.getloadavg()[0], time.perf_counter()
            await append_all(sessions, prompts)
            t1 = time.perf_counter()
            tg.cancel_scope.cancel()
        during = calls.since(t0, t1)
        gaps = decode_gaps(during)
        steps = sum(1 for _, rows, _ in during if all(n == 1 for n in rows))
        out["with_decode"] = {
            "prefill_tok_per_s": round(total / (t1 - t0)), "s": round(t1 - t0, 2), "model_calls": len(during),
            "decode_tok_per_s": round(steps * decoders / (t1 - t0), 1),
            "itl_ms": {"p50": round(1000 * pct(gaps, 0.5), 1), "p99": round(1000 * pct(gaps, 0.99), 1),
                       "max": round(1000 * max(gaps, default=float("nan")), 1), "samples": len(gaps)},
            "decode_only_ms": round(1000 * statistics.median(quiet), 1) if quiet else None,
            "load": round(load, 2),
        }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    prompts = [common.random_tokens(n, seed=i) for i, n in enumerate(args.prompts)]
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for name in args.schedules:
            busy, idle = SCHEDULES[name] if name in SCHEDULES else map(int, name.split(":"))
            res = await run_schedule(busy, idle, prompts, args.decoders)
            runs.append({"schedule": name, "rep": rep, **res})
            print(runs[-1], file=sys.stderr, flush=True)
    return {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "prompts": args.prompts,
            "decoders": args.decoders, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384])
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES),
                   help="names (before, after, big) or BUSY:IDLE token budgets")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    common.emit(anyio.run(main_async, args), args.out)


if __name__ == "__main__":
    main()
