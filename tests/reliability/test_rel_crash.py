"""Crash atomicity: SIGKILL a process saving many sessions (at random moments and at injected points between
every write, fsync, rename and Redis command); every session then resumes bit-identically at its last acked
save or the one in flight, or is missing if none was acked; never a corrupt load, never a temp file left."""

from __future__ import annotations

import pytest
from rel_helpers import DISK_POINTS, REDIS_POINTS, dangling_references, random_plan, run_campaign, temp_files


def _report(name: str, v, kills: int) -> None:
    print(f"\n{name}: {kills} kills, counts {v.counts}, problems {len(v.problems)}")


async def test_disk_kills_leave_every_session_whole(tmp_path):
    root = tmp_path / "store"
    plan = random_plan(8, DISK_POINTS, 1, seed=1)
    v = run_campaign(f"disk:{root}", tmp_path, plan, seed=1)
    _report("disk", v, len(plan))
    assert v.problems == []
    assert v.counts["corrupt"] == 0
    assert v.counts["acks"] > len(plan)  # the workers did get to save between kills
    assert v.counts["resumed_at_ack"] + v.counts["resumed_in_flight"] > 0
    assert temp_files(root) == []  # the verify worker's open removed the killed workers' temp files
    assert await dangling_references(f"disk:{root}") == []


async def test_redis_kills_leave_every_session_whole(tmp_path, redis_url):
    url = f"{redis_url}?prefix=crash{tmp_path.name[-8:]}:&lease_ttl=0.5"
    plan = random_plan(4, REDIS_POINTS, 1, seed=2)
    v = run_campaign(url, tmp_path, plan, seed=2)
    _report("redis", v, len(plan))
    assert v.problems == []
    assert v.counts["acks"] > len(plan)
    assert await dangling_references(url) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
async def test_disk_kills_soak(tmp_path, seed):
    root = tmp_path / "store"
    plan = random_plan(20, DISK_POINTS, 3, seed=seed)
    v = run_campaign(f"disk:{root}", tmp_path, plan, seed=seed)
    _report("disk soak", v, len(plan))
    assert v.problems == [] and temp_files(root) == []
