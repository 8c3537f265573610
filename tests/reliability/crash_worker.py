"""Zygote for the crash tests: imports torch and the engine once, then forks one worker per job.

    python crash_worker.py        # reads one JSON job per stdin line; prints "pid N", then "exit N STATUS"

A job is {"store": url, "log": path, "sessions": n, "rounds": r, "seed": s, "fault": [point, nth] | null,
"verify_only": bool, "pack_min_blobs": n | null}. The worker opens an engine on the store and, for sessions sess0..sess{n-1}, resumes each
(logging what it found: generation, token ids and the next 4 greedy tokens) or creates it if missing; then, for
`rounds` rounds (0 = forever), appends 8 random tokens to each session, saves it and logs an ack with the
generation, the token ids and the next 4 greedy tokens. Log lines are JSON, one os.write each (a SIGKILL leaves
whole lines plus at most one partial last line). With `fault`, the worker SIGKILLs itself at the nth time it
reaches that storage fault point (see kda_sessions.storage.faults). With `pack_min_blobs` on a disk store, saves
of that many new blobs or more stream into a pack (the sessions here save a few blobs each: with 2, every save).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

torch.set_num_threads(1)  # before any op: no OpenMP thread pool exists when we fork

import anyio  # noqa: E402
import zygote  # noqa: E402  (a sibling: this file runs as a script)

import kda_sessions as ks  # noqa: E402
from kda_sessions.errors import SnapshotConflict  # noqa: E402
from kda_sessions.model import load_model  # noqa: E402

# Pools big enough that the engine never evicts a session (an eviction is a save nobody acks, which the
# verifier would rightly report as a generation skipped): 8192 pages hold ~2,000 saves of 6 sessions.
ENGINE_ARGS: dict[str, Any] = {"page_size": 16, "max_active_sessions": 16, "num_pages": 8192, "ram_tier_bytes": 0}


async def _retry(fn: Any, fd: int, sid: str) -> Any:
    """Call fn(), retrying while the store is down or a dead writer's lease has not expired yet."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await fn()
        except SnapshotConflict:
            raise
        except (ks.StoreUnavailable, ks.SessionBusy) as e:
            if time.monotonic() > deadline:
                raise
            zygote.log(fd, ev="retry", sid=sid, type=type(e).__name__)
            await anyio.sleep(0.05)


async def _work(job: dict[str, Any], fd: int) -> None:
    rng = random.Random(job["seed"])
    async with await ks.Engine.open(model="tiny-random", store=job["store"], **ENGINE_ARGS) as eng:
        store = eng.io.snapshots.store
        if job.get("pack_min_blobs") and hasattr(store, "pack_min_blobs"):  # every other worker's saves as packs
            store.pack_min_blobs = job["pack_min_blobs"]
        sessions = []
        for i in range(job["sessions"]):
            sid = f"sess{i}"
            try:
                s = await _retry(lambda sid=sid: eng.resume(sid), fd, sid)
            except ks.SessionNotFound:
                zygote.log(fd, ev="missing", sid=sid)
                sessions.append(await eng.create_session(session_id=sid))
                continue
            except Exception as e:  # a corrupt load: the verifier counts it as a failure
                zygote.log(fd, ev="error", sid=sid, type=type(e).__name__, msg=str(e)[:300])
                continue
            tokens, gen = list(s.state.tokens), s.state.generation
            nxt = (await s.generate(max_tokens=4, ignore_eos=True)).token_ids
            zygote.log(fd, ev="resumed", sid=sid, gen=gen, tokens=tokens, next=nxt)
            sessions.append(s)
        zygote.log(fd, ev="ready")
        if job.get("verify_only"):
            return
        r = 0
        while job["rounds"] == 0 or r < job["rounds"]:
            r += 1
            for s in sessions:
                await s.append([rng.randrange(32, 250) for _ in range(8)])
                await _retry(s.save, fd, s.id)
                tokens, gen = list(s.state.tokens), s.state.generation
                nxt = (await s.generate(max_tokens=4, ignore_eos=True)).token_ids
                zygote.log(fd, ev="ack", sid=s.id, gen=gen, tokens=tokens, next=nxt)
        zygote.log(fd, ev="done")


def main() -> None:
    load_model("tiny-random")  # warm lazy initialisation once, in the zygote
    zygote.serve(_work)


if __name__ == "__main__":
    main()
