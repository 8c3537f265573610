"""The fork-server both crash workers share: one JSON job per stdin line, each run in a forked child.

    serve(work)   # for every line: fork; the child runs ``anyio.run(work, job, log_fd)``; prints "pid N", then
                  # "exit N STATUS" once the child is gone (killed by the test, by a fault point, or done)

A job may carry "fault": [point, nth], which SIGKILLs the child at the nth hit of that storage fault point, and
must carry "log": the file the child appends its JSON events to.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kda_sessions.storage import faults

Work = Callable[[dict[str, Any], int], Awaitable[None]]


def log(fd: int, **event: Any) -> None:
    os.write(fd, (json.dumps(event) + "\n").encode())


def install_fault(point: str, nth: int, fd: int) -> None:
    """SIGKILL this process at the nth time the storage layer passes `point` (logged first, so that the test knows
    the point was reached rather than the worker killed where it was)."""
    hits = 0

    def hook(name: str) -> None:
        nonlocal hits
        if name == point:
            hits += 1
            if hits >= nth:
                log(fd, ev="fault", point=point)
                os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = hook


def run_worker(job: dict[str, Any], work: Work) -> None:
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if job.get("fault"):
        install_fault(*job["fault"], fd)
    try:
        anyio.run(work, job, fd)
    except BaseException as e:
        log(fd, ev="crash", type=type(e).__name__, msg=str(e)[:300])
        os._exit(3)
    os._exit(0)


def serve(work: Work) -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_worker(job, work)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)
