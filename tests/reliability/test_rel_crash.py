"""Crash atomicity: SIGKILL a process saving many sessions (at random moments and at injected points between
every write, fsync, rename and Redis command); every session then resumes bit-identically at its last acked
save or the one in flight, or is missing if none was acked; never a corrupt load, never a temp file left.

Two levels: engine workers (crash_worker.py: a model, real sessions, bit-identical continuation checked; ~2 s a
kill) and storage workers (crash_store_worker.py: the engine's save path, SnapshotStore, with synthetic
sessions whose every blob is checked; ~0.2 s a kill). Each campaign runs short by default (every fault point
still hit) and at full length, hundreds of kills, with -m slow."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_helpers import DISK_POINTS, REDIS_POINTS, dangling_references, random_plan, run_campaign, temp_files


def _report(name: str, v, kills: int, t0: float | None = None) -> None:
    took = f" in {time.monotonic() - t0:.0f} s" if t0 is not None else ""
    print(f"\n{name}: {kills} kills{took}, counts {v.counts}, points hit {len(v.points_hit)}, problems {len(v.problems)}")


# Each campaign runs short by default and long with -m slow. (kills per fault point, kills at random moments):
# short 9 * 2 + 4 = 22 and 3 * 2 + 3 = 9 at the storage level, 9 + 1 = 10 and 3 + 1 = 4 engine-level (45
# SIGKILLs); long 170, 40, 17 and 7 (234 SIGKILLs). Every fault point is hit in both, and every campaign kills
# at random moments too. The short engine-level workers save 4 sessions, the long ones 6.
SIZES = ["short", pytest.param("long", marks=pytest.mark.slow)]
STORE_KILLS_DISK = {"short": (2, 4), "long": (8, 98)}
STORE_KILLS_REDIS = {"short": (2, 3), "long": (8, 16)}
ENGINE_SESSIONS = {"short": 4, "long": 6}
ENGINE_KILLS_DISK = {"short": (1, 1), "long": (1, 8)}
ENGINE_KILLS_REDIS = {"short": (1, 1), "long": (1, 4)}
# The longest random delay before a random-moment kill of a redis engine worker: the long campaign's 2 s, the
# short one's 1 s (its one random kill still lands among saves: ~8 acks a second).
ENGINE_REDIS_MAX_DELAY_S = {"short": 1.0, "long": 2.0}
# How long an engine worker may run before it reaches its fault point's nth hit. `disk.lease.written` is hit once
# per session at startup, then only when a save rewrites the lease, half the lease TTL (~15 s) in: the short
# campaign draws its nth among the startup hits, the long one may wait for a rewrite.
ENGINE_FAULT_TIMEOUT_S = {"short": 5.0, "long": 30.0}
ENGINE_MAX_NTH = {"short": {"disk.lease.written": ENGINE_SESSIONS["short"]}, "long": {}}


@pytest.fixture
def shm_path(tmp_path) -> Iterator[Path]:
    """A fresh folder on tmpfs (/dev/shm) where there is one, else tmp_path. A SIGKILL loses nothing the kernel
    already holds, so for process crashes fsync only costs time (~4x per kill on this VM's disk); the fault
    points between write, fsync, rename and link are reached all the same. The engine-level campaigns above use
    the real disk."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and shutil.disk_usage(shm).free > 1 << 30):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="kda-crash-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("size", SIZES)
async def test_disk_store_level_kills(tmp_path, shm_path, store_zygote, size):
    root = shm_path / "store"
    per_point, n_random = STORE_KILLS_DISK[size]
    plan = random_plan(n_random, DISK_POINTS, per_point, seed=21)
    t0 = time.monotonic()
    v = run_campaign(f"disk:{root}", tmp_path, plan, seed=21, store_level=True, max_delay_s=0.15, fault_timeout_s=1.0,
                     zygote=store_zygote)
    _report("disk, storage level", v, len(plan), t0)
    assert len(plan) == len(DISK_POINTS) * per_point + n_random
    assert v.problems == [] and v.points_hit == set(DISK_POINTS)
    assert v.counts["corrupt"] == 0 and v.counts["temp_files"] == 0
    assert v.counts["acks"] > 2 * len(plan)
    assert v.counts["resumed_in_flight"] > 0  # some kills did land between a commit and its ack
    assert temp_files(root) == []
    assert await dangling_references(f"disk:{root}") == []


@pytest.mark.parametrize("size", SIZES)
async def test_redis_store_level_kills(tmp_path, redis_url, store_zygote, size):
    url = f"{redis_url}?prefix=crashs{tmp_path.name[-8:]}:&lease_ttl=0.1"
    per_point, n_random = STORE_KILLS_REDIS[size]
    plan = random_plan(n_random, REDIS_POINTS, per_point, seed=22)
    t0 = time.monotonic()
    v = run_campaign(url, tmp_path, plan, seed=22, store_level=True, max_delay_s=0.15, fault_timeout_s=1.0,
                     zygote=store_zygote)
    _report("redis, storage level", v, len(plan), t0)
    assert len(plan) == len(REDIS_POINTS) * per_point + n_random
    assert v.problems == [] and v.counts["corrupt"] == 0 and v.points_hit == set(REDIS_POINTS)
    assert v.counts["acks"] > 2 * len(plan)
    assert await dangling_references(url) == []


@pytest.mark.parametrize("size", SIZES)
async def test_disk_kills_leave_every_session_whole(tmp_path, engine_zygote, size):
    root = tmp_path / "store"
    per_point, n_random = ENGINE_KILLS_DISK[size]
    plan = random_plan(n_random, DISK_POINTS, per_point, seed=1, max_nth=ENGINE_MAX_NTH[size])
    v = run_campaign(f"disk:{root}", tmp_path, plan, seed=1, fault_timeout_s=ENGINE_FAULT_TIMEOUT_S[size],
                     sessions=ENGINE_SESSIONS[size], zygote=engine_zygote)
    _report("disk", v, len(plan))
    assert v.problems == [] and v.points_hit == set(DISK_POINTS)
    assert v.counts["corrupt"] == 0
    assert v.counts["acks"] > len(plan)  # the workers did get to save between kills
    assert v.counts["resumed_at_ack"] + v.counts["resumed_in_flight"] > 0
    assert temp_files(root) == []  # the verify worker's open removed the killed workers' temp files
    assert await dangling_references(f"disk:{root}") == []


@pytest.mark.parametrize("size", SIZES)
async def test_redis_kills_leave_every_session_whole(tmp_path, redis_url, engine_zygote, size):
    url = f"{redis_url}?prefix=crash{tmp_path.name[-8:]}:&lease_ttl=0.5"
    per_point, n_random = ENGINE_KILLS_REDIS[size]
    plan = random_plan(n_random, REDIS_POINTS, per_point, seed=2)
    # a restarted worker first waits out its dead predecessor's lease (0.5 s): give it time to save before a kill
    v = run_campaign(url, tmp_path, plan, seed=2, max_delay_s=ENGINE_REDIS_MAX_DELAY_S[size],
                     sessions=ENGINE_SESSIONS[size], zygote=engine_zygote)
    _report("redis", v, len(plan))
    assert v.problems == [] and v.points_hit == set(REDIS_POINTS)
    assert v.counts["acks"] > len(plan)
    assert await dangling_references(url) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
async def test_disk_kills_soak(tmp_path, engine_zygote, seed):
    root = tmp_path / "store"
    plan = random_plan(20, DISK_POINTS, 3, seed=seed)
    v = run_campaign(f"disk:{root}", tmp_path, plan, seed=seed, zygote=engine_zygote)
    _report("disk soak", v, len(plan))
    assert v.problems == [] and temp_files(root) == []
