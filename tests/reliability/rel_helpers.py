"""Helpers of the reliability tests: drive crash_worker.py's zygote and check what workers logged."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("crash_worker.py")
STORE_WORKER = Path(__file__).with_name("crash_store_worker.py")


class Zygote:
    """One crash_worker.py process; `start(job)` forks a worker, `kill`/`wait` end it. Its start-up (imports, a
    warm model: ~2 s) is paid once per test session where the tests share it (`zygotes` in conftest.py)."""

    def __init__(self, worker: Path = WORKER) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def start(self, job: dict[str, Any]) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("pid "), f"zygote answered {line!r}"
        return int(line.split()[1])

    def wait(self, pid: int) -> int:
        """Wait until the zygote reaped worker `pid` (so its pid is gone); its wait status."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(f"exit {pid} "), f"zygote answered {line!r}"
        return int(line.split()[2])

    def kill(self, pid: int) -> int:
        with contextlib.suppress(ProcessLookupError):  # already gone (an injected fault, or done)
            os.kill(pid, signal.SIGKILL)
        return self.wait(pid)

    @property
    def closed(self) -> bool:
        return self.proc.stdin is None or self.proc.stdin.closed

    def close(self) -> None:
        assert self.proc.stdin is not None
        if self.proc.stdin.closed:
            return
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Whole JSON lines of a worker log (a SIGKILL may leave one partial last line, which is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def wait_for(path: Path, ev: str, pid: int, timeout_s: float = 60.0) -> bool:
    """Poll a worker log until it holds an `ev` event; False if worker `pid` ended first or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.get("ev") == ev for e in read_log(path)):
            return True
        if _gone(pid):
            return False
        time.sleep(0.02)
    return False


@dataclass
class Verifier:
    """Checks resumes against the last acknowledged save of each session, across many killed workers.

    After a kill a session must resume at its last acked generation g with the same token ids and the same
    next greedy tokens, or at g + 1 (the save in flight had committed) with a history extending the acked one;
    it may be missing only if no save of it was ever acked. Anything else is a problem.
    """

    base: dict[str, tuple[int, list[int], list[int]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    points_hit: set[str] = field(default_factory=set)
    """Fault points where a worker killed itself (a worker still short of its nth hit is killed where it is)."""
    counts: dict[str, int] = field(
        default_factory=lambda: {"acks": 0, "resumed_at_ack": 0, "resumed_in_flight": 0, "missing": 0, "corrupt": 0}
    )

    def feed(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            ev, sid = e.get("ev"), e.get("sid", "")
            if ev == "ack":
                self.counts["acks"] += 1
                self.base[sid] = (e["gen"], e["tokens"], e["next"])
            elif ev == "missing":
                self.counts["missing"] += 1
                if sid in self.base:
                    self.problems.append(f"{sid}: missing after an acked save at generation {self.base[sid][0]}")
            elif ev == "error":
                self.counts["corrupt"] += 1
                self.problems.append(f"{sid}: load failed: {e['type']}: {e['msg']}")
            elif ev == "resumed":
                self._check_resume(sid, e["gen"], e["tokens"], e["next"])
                self.base[sid] = (e["gen"], e["tokens"], e["next"])
            elif ev == "crash":
                self.problems.append(f"worker crashed: {e['type']}: {e['msg']}")
            elif ev == "fault":
                self.points_hit.add(e["point"])

    def _check_resume(self, sid: str, gen: int, tokens: list[int], nxt: list[int]) -> None:
        if sid not in self.base:
            return  # its first save was in flight when the worker died, and it committed
        g, want, want_next = self.base[sid]
        if gen == g:
            self.counts["resumed_at_ack"] += 1
            if tokens != want or nxt != want_next:
                self.problems.append(f"{sid}: resumed at generation {g} but does not continue bit-identically")
        elif gen == g + 1:
            self.counts["resumed_in_flight"] += 1
            if tokens[: len(want) + len(want_next)] != want + want_next:
                self.problems.append(f"{sid}: generation {gen} does not extend acked generation {g}")
        else:
            self.problems.append(f"{sid}: resumed at generation {gen}, last acked {g}")


@dataclass
class StoreVerifier:
    """Checks the storage-level campaign (crash_store_worker.py): after a kill each session loads at its last
    acked generation g or at g + 1 (the save in flight committed), with exactly the manifest and blobs that
    generation must have (the worker compares them, `error` otherwise); missing only if no save was acked;
    no temp file survives a worker's start."""

    acked: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    points_hit: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {
        "acks": 0, "resumed_at_ack": 0, "resumed_in_flight": 0, "missing": 0, "corrupt": 0, "temp_files": 0,
    })

    def feed(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            ev, sid = e.get("ev"), e.get("sid", "")
            if ev == "ack":
                self.counts["acks"] += 1
                self.acked[sid] = e["gen"]
            elif ev == "temps":
                self.counts["temp_files"] += e["n"]
                if e["n"]:
                    self.problems.append(f"{e['n']} temp files left after the store was opened")
            elif ev == "missing":
                self.counts["missing"] += 1
                if sid in self.acked:
                    self.problems.append(f"{sid}: missing after an acked save at generation {self.acked[sid]}")
            elif ev == "error":
                self.counts["corrupt"] += 1
                self.problems.append(f"{sid}: load failed: {e['type']}: {e['msg']}")
            elif ev == "resumed":
                g, gen = self.acked.get(sid, 0), e["gen"]
                if gen == g:
                    self.counts["resumed_at_ack"] += 1
                elif gen == g + 1:
                    self.counts["resumed_in_flight"] += 1
                else:
                    self.problems.append(f"{sid}: resumed at generation {gen}, last acked {g}")
                self.acked[sid] = gen
            elif ev == "crash":
                self.problems.append(f"worker crashed: {e['type']}: {e['msg']}")
            elif ev == "fault":
                self.points_hit.add(e["point"])


def temp_files(root: Path) -> list[Path]:
    """Temp files of the disk store left anywhere under `root`."""
    return [p for p in root.rglob(".tmp-*")]


DISK_POINTS = [
    "disk.blob.written",
    "disk.blob.fsynced",
    "disk.blob.linked",
    "disk.blob.done",
    "disk.manifest.written",
    "disk.manifest.fsynced",
    "disk.manifest.renamed",
    "disk.manifest.done",
    "disk.lease.written",
]
REDIS_POINTS = ["redis.blobs.sent", "redis.manifest.before", "redis.manifest.done"]


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def run_campaign(
    store: str,
    tmp: Path,
    plan: list[tuple[str, int] | None],
    *,
    seed: int = 0,
    sessions: int = 6,
    max_delay_s: float = 0.8,
    store_level: bool = False,
    fault_timeout_s: float = 30.0,
    zygote: Zygote | None = None,
) -> Any:
    """Kill a worker saving `sessions` sessions once per entry of `plan` (None: SIGKILL after a random delay
    once it is ready; (point, nth): it SIGKILLs itself at that fault point), then run a last verify-only
    worker. Returns the Verifier that checked every resume. `store_level`: workers of crash_store_worker.py
    (no model; checked by a StoreVerifier) instead of crash_worker.py; every other one writes its saves as disk
    packs (pack_min_blobs 2). A worker that has not reached its fault point's nth hit after `fault_timeout_s`
    is killed where it is: some points are hit rarely, like `disk.lease.written`, hit at startup and then only
    when a save rewrites the lease, about half the lease TTL in. `zygote`: a shared one of the right worker
    (kept open unless the campaign fails midway, when it is closed: its answers may be out of step), else one of
    the campaign's own."""
    import random

    rng = random.Random(seed)
    z = zygote if zygote is not None else Zygote(STORE_WORKER if store_level else WORKER)
    v: Verifier | StoreVerifier = StoreVerifier() if store_level else Verifier()
    ok = False
    try:
        for i, fault in enumerate([*plan, "verify"]):
            log = tmp / f"worker{i}.log"
            job = {"store": store, "log": str(log), "sessions": sessions, "rounds": 0, "seed": seed * 1000 + i,
                   "fault": None if fault in (None, "verify") else list(fault), "verify_only": fault == "verify",
                   "gc_every": 7, "pack_min_blobs": 2 if i % 2 else None}
            pid = z.start(job)
            if fault == "verify":
                z.wait(pid)
            elif fault is None:
                wait_for(log, "ready", pid)
                time.sleep(rng.uniform(0.0, max_delay_s))
                z.kill(pid)
            else:
                deadline = time.monotonic() + fault_timeout_s
                while not _gone(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                z.kill(pid)
            v.feed(read_log(log))
        ok = True
    finally:
        if zygote is None or not ok:
            z.close()
    return v


def random_plan(
    n_random: int, points: list[str], per_point: int, seed: int, max_nth: dict[str, int] | None = None
) -> list[tuple[str, int] | None]:
    """`n_random` random-moment kills plus `per_point` injected kills at each point (nth hit drawn at random from
    1..10, or 1..max_nth[point] for a point a worker reaches only that often before it would time out)."""
    import random

    rng = random.Random(seed)
    caps = max_nth or {}
    plan: list[tuple[str, int] | None] = [None] * n_random
    plan += [(p, rng.randint(1, caps.get(p, 10))) for p in points for _ in range(per_point)]
    rng.shuffle(plan)
    return plan


async def dangling_references(store_url: str) -> list[str]:
    """Manifests that do not load or reference a blob the store lacks."""
    from kda_sessions.storage import SnapshotStore, StoreError

    out = []
    async with await SnapshotStore.open(store_url) as snaps:
        for sid in await snaps.list_sessions():
            try:
                m = await snaps.load_manifest(sid)
            except StoreError as e:
                out.append(f"{sid}: {e}")
                continue
            missing = m.blob_digests() - await snaps.store.has_blobs(m.blob_digests())
            if missing:
                out.append(f"{sid}: references {len(missing)} missing blobs")
    return out


def tiny_snapshot(session_id: str, generation: int, fill: float = 0.0) -> tuple[Any, dict[str, bytes]]:
    """A valid manifest of 3 tokens (page size 4) at `generation`, and its blobs (depend on `fill`)."""
    import torch

    from kda_sessions.storage import CheckpointRecord, ModelFingerprint, SessionManifest
    from kda_sessions.storage.blobs import digest, encode_tensor, encode_tensors

    blobs = {}
    for data in (
        encode_tensor(torch.tensor([1, 2, 3], dtype=torch.int32)),
        encode_tensors({"kda.0": torch.full((2, 3), fill)}),
        encode_tensor(torch.full((8,), fill)),
    ):
        blobs[digest(data)] = data
    tokens_d, state_d, page_d = list(blobs)
    m = SessionManifest(
        session_id=session_id,
        fingerprint=ModelFingerprint(model_id="t", config_hash="c", dtype="float32", page_size=4),
        tokens_blob=tokens_d,
        num_tokens=3,
        head=CheckpointRecord(name="head", position=3, state_blob=state_d, pages=[page_d], created_at=0.0),
        generation=generation,
        saved_at=0.0,
    )
    return m, blobs
