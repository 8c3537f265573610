"""Load over HTTP: many concurrent sessions against one `kda-sessions serve` process for a bounded time.

    python bench/load_http.py [--seconds 60 | --quick] [--sessions 64] [--store disk:PATH] [--out FILE]

Starts the server as a child process (tiny-random, CPU, a fresh disk store in a temp dir unless --store is
given, a RAM tier of --ram-tier-mib), then runs --sessions workers through ``kda_sessions.client.Client``. Each
creates a session and loops until the deadline: send a message (max_tokens 8, greedy), then with probability
--p-save save it and with probability --p-resume resume it (``POST /v1/sessions/{id}/resume``, after at least
one save), and with probability --p-stateless send a stateless ``/v1/chat/completions`` (a short history, no
session_id: the server creates a session per request and must not keep them all). After --turns messages the
worker deletes its session and starts a new one, as agents finish tasks: the working set stays bounded, so
memory must too. Reports errors (must be zero), requests/s, p50/p99 latency per route, and the server's RSS
sampled every second: the first --warmup fraction of the run is warm-up, then growth = last sample - first
sample after warm-up. Prints JSON; the exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

from kda_sessions.client import Client

MESSAGES = ("run the tests", "open src/app.py", "what failed?", "fix the import and rerun", "summarise the diff")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


SERVE = """
import sys
from kda_sessions.engine.config import EngineConfig
from kda_sessions.server import ServerSettings, run_server
store, port, ram = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
run_server(ServerSettings(model="tiny-random", store=store, port=port, log_level="warning",
                          engine=EngineConfig(ram_tier_bytes=ram)))
"""


def start_server(store: str, port: int, ram_tier_bytes: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", SERVE, store, str(port), str(ram_tier_bytes)]
    # stderr to a file: a pipe nobody reads would block the server once its buffer filled
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("status") == "ok":
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy in 120 s")


class Recorder:
    def __init__(self) -> None:
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter[str] = Counter()
        self.first_errors: list[str] = []

    async def timed(self, route: str, call: Any) -> Any:
        t0 = time.perf_counter()
        try:
            result = await call
        except Exception as e:
            self.errors[f"{route}: {type(e).__name__}"] += 1
            if len(self.first_errors) < 5:
                self.first_errors.append(f"{route}: {type(e).__name__}: {e}")
            return None
        self.latency[route].append(time.perf_counter() - t0)
        return result


async def stateless_chat(http: httpx.AsyncClient, rng: random.Random) -> None:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": rng.choice(MESSAGES)}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": rng.choice(MESSAGES)})
    r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0.0})
    r.raise_for_status()


async def worker(client: Client, http: httpx.AsyncClient, rec: Recorder, rng: random.Random, deadline: float,
                 args: argparse.Namespace) -> None:
    while time.monotonic() < deadline:
        session = await rec.timed("create", client.create_session(system="You are a coding agent."))
        if session is None:
            return
        saved = False
        for _ in range(args.turns):
            if time.monotonic() >= deadline:
                return
            await rec.timed("messages", session.send(rng.choice(MESSAGES), max_tokens=8, temperature=0.0))
            if rng.random() < args.p_save:
                saved = await rec.timed("save", session.save()) is not None or saved
            if saved and rng.random() < args.p_resume:
                resumed = await rec.timed("resume", client.resume(session.id))
                session = resumed or session
            if rng.random() < args.p_stateless:
                await rec.timed("chat_stateless", stateless_chat(http, rng))
        await rec.timed("delete", client.delete_session(session.id))


async def sample_rss(pid: int, samples: list[tuple[float, float]], t0: float, deadline: float) -> None:
    while time.monotonic() < deadline + 0.5:
        samples.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
        await anyio.sleep(1.0)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def run(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    rec = Recorder()
    samples: list[tuple[float, float]] = []
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    limits = httpx.Limits(max_connections=args.sessions + 8)
    async with (
        Client(url, timeout=300, max_retries=0, transport=httpx.AsyncHTTPTransport(limits=limits)) as client,
        httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sample_rss, pid, samples, t0, deadline)
            for _ in range(args.sessions):
                tg.start_soon(worker, client, http, rec, random.Random(rng.random()), deadline, args)
        stats = await client.astats()
    wall = time.monotonic() - t0
    routes = {
        route: {"count": len(xs), "per_s": round(len(xs) / wall, 2), "p50_ms": round(1000 * percentile(xs, 0.5), 1),
                "p99_ms": round(1000 * percentile(xs, 0.99), 1), "mean_ms": round(1000 * statistics.fmean(xs), 1)}
        for route, xs in sorted(rec.latency.items())
    }
    warm = [mib for t, mib in samples if t >= args.warmup * args.seconds]
    total = sum(len(xs) for xs in rec.latency.values())
    return {
        "machine": common.machine(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "wall_s": round(wall, 1),
        "requests": total,
        "errors": sum(rec.errors.values()),
        "error_kinds": dict(rec.errors),
        "first_errors": rec.first_errors,
        "requests_per_s": round(total / wall, 2),
        "routes": routes,
        "rss_mib": {
            "start": samples[0][1] if samples else None,
            "after_warmup": warm[0] if warm else None,
            "end": warm[-1] if warm else None,
            "max_after_warmup": max(warm) if warm else None,
            "growth_after_warmup": round(warm[-1] - warm[0], 1) if warm else None,
            "samples": samples,
        },
        "engine_stats": {k: stats.get(k) for k in ("sessions_in_memory", "sessions_active", "saves", "resumes",
                                                  "tokens_decoded", "cache_hit_rate")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="10 s")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--p-save", type=float, default=0.2)
    ap.add_argument("--p-resume", type=float, default=0.1)
    ap.add_argument("--p-stateless", type=float, default=0.1, help="per message: also one stateless chat completion")
    ap.add_argument("--turns", type=int, default=16, help="messages per session before it is deleted and replaced")
    ap.add_argument("--ram-tier-mib", type=int, default=256, help="the server's RAM tier (EngineConfig.ram_tier_bytes)")
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of the run counted as warm-up")
    ap.add_argument("--store", default=None, help="default: disk: in a fresh temp dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.seconds = 10.0
    with tempfile.TemporaryDirectory(prefix="kda-load-") as tmp:
        store = args.store or f"disk:{tmp}/store"
        port = free_port()
        log = Path(tmp) / "server.log"
        proc = start_server(store, port, args.ram_tier_mib << 20, log)
        try:
            result = anyio.run(run, args, f"http://127.0.0.1:{port}", proc.pid)
            if result["errors"]:
                result["server_log_tail"] = log.read_text(errors="replace")[-6000:]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(text)
    sys.exit(1 if result["errors"] else 0)


if __name__ == "__main__":
    main()
