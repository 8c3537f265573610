"""Concurrency: one write lease per session in the store (Redis SET PX + INCR fencing token; a lock file on
disk) and compare-and-set commits on the manifest generation, so two writers never lose each other's saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from rel_helpers import tiny_snapshot

import kda_sessions as ks
from kda_sessions.errors import SnapshotConflict
from kda_sessions.storage import SnapshotStore, open_store


@pytest.fixture(params=["memory", "disk", "redis"])
async def two_stores(request, tmp_path) -> AsyncIterator[tuple[SnapshotStore, SnapshotStore]]:
    """Two SnapshotStores (two lease owners) over the same stored data."""
    if request.param == "memory":
        a = await open_store("memory:")
        b = a
    else:
        url = (
            f"disk:{tmp_path / 'store'}"
            if request.param == "disk"
            else request.getfixturevalue("redis_url") + f"?prefix=lease{tmp_path.name[-8:]}:"
        )
        a, b = await open_store(url), await open_store(url)
    sa, sb = SnapshotStore(a), SnapshotStore(b)
    yield sa, sb
    await sa.close()
    if b is not a:
        await sb.close()


async def test_second_writer_gets_session_busy_until_release(two_stores):
    a, b = two_stores
    f1 = await a.acquire_lease("s1")
    assert await a.acquire_lease("s1") == f1  # renewal keeps the token
    with pytest.raises(ks.SessionBusy):
        await b.acquire_lease("s1")
    m, blobs = tiny_snapshot("s1", 1)
    with pytest.raises(ks.SessionBusy):
        await b.save(m, blobs, expected_generation=0)
    assert await a.release_lease("s1")
    f2 = await b.acquire_lease("s1")
    assert f2 > f1  # fencing tokens only grow
    await b.save(m, blobs, expected_generation=0)


async def test_expired_lease_is_taken_over_and_the_old_holder_cannot_save(two_stores):
    a, b = two_stores
    a.lease_ttl_s = 0.2
    await a.acquire_lease("s2")
    time.sleep(0.3)
    await b.acquire_lease("s2")
    m, blobs = tiny_snapshot("s2", 1)
    with pytest.raises(ks.SessionBusy):
        await a.save(m, blobs, expected_generation=0)


async def test_a_commit_sent_again_after_it_landed_commits_again(two_stores):
    """A commit whose reply was lost and that the client sends again (redis-py sends a command again after a
    connection error; with Redis killed after the write and before the reply, the second run found generation 2
    where it expected 1, and the worker stopped on a SnapshotConflict) finds its own bytes stored and commits
    again; other bytes with that stale generation are still a conflict, and the stored manifest stays."""
    a, _ = two_stores
    m1, blobs1 = tiny_snapshot("s5", 1, fill=1.0)
    await a.save(m1, blobs1, expected_generation=0)
    data = await a.store.get_manifest("s5")
    fence = await a.store.commit_manifest("s5", data, expected_generation=0, owner=a.owner, ttl_s=5.0)
    assert isinstance(fence, int) and await a.store.get_manifest("s5") == data
    other, _ = tiny_snapshot("s5", 1, fill=2.0)
    assert other.dumps() != data
    with pytest.raises(SnapshotConflict):
        await a.store.commit_manifest("s5", other.dumps(), expected_generation=0, owner=a.owner, ttl_s=5.0)
    assert await a.store.get_manifest("s5") == data
    await a.release_lease("s5")


async def test_compare_and_set_refuses_a_stale_generation(two_stores):
    a, b = two_stores
    m1, blobs1 = tiny_snapshot("s3", 1, fill=1.0)
    await a.save(m1, blobs1, expected_generation=0)
    await a.release_lease("s3")
    # b saw nothing (generation 0) and tries to create the same session: refused, a's save survives
    stale, blobs = tiny_snapshot("s3", 1, fill=2.0)
    with pytest.raises(SnapshotConflict):
        await b.save(stale, blobs, expected_generation=0)
    assert (await b.load_manifest("s3")).head.state_blob == m1.head.state_blob
    m2, blobs2 = tiny_snapshot("s3", 2, fill=3.0)
    r = await b.save(m2, blobs2, expected_generation=1)
    assert r.generation == 2
    await b.release_lease("s3")
    # and a, still at generation 1, cannot overwrite b's newer save
    old, blobs_old = tiny_snapshot("s3", 2, fill=4.0)
    with pytest.raises(SnapshotConflict):
        await a.save(old, blobs_old, expected_generation=1)
    assert (await a.load_manifest("s3")).head.state_blob == m2.head.state_blob


async def test_disk_lease_of_a_dead_process_is_stale_at_once(tmp_path):
    root = tmp_path / "store"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = await open_store(f"disk:{root}")
    (root / "leases" / "s4.lock").write_text(json.dumps(
        {"owner": "x", "fence": 7, "pid": int(dead.stdout), "host": os.uname().nodename, "expires_at": time.time() + 60}
    ))
    snaps = SnapshotStore(store)
    assert await snaps.acquire_lease("s4") == 1  # the fence file was never written by "x"
    await snaps.close()


CHILD = """
import sys, anyio, kda_sessions as ks
async def main():
    async with await ks.Engine.open(model="tiny-random", store=sys.argv[1], page_size=16) as e:
        s = await e.resume(sys.argv[2])
        await s.append([5, 6, 7])
        await s.save()
        print("held", s.state.generation, flush=True)
        sys.stdin.read()  # hold the session until the test closes our stdin
anyio.run(main)
"""


async def test_two_engine_processes_one_writer(tmp_path):
    url = f"disk:{tmp_path / 'store'}"
    async with await ks.Engine.open(model="tiny-random", store=url, page_size=16) as eng:
        s = await eng.create_session(session_id="shared")
        await s.append(list(range(40, 80)))
        await s.save()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, "shared"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.startswith("held 2"), line
        async with await ks.Engine.open(model="tiny-random", store=url, page_size=16) as eng:
            s = await eng.resume("shared")  # reading is allowed
            assert s.state.generation == 2
            await s.append([9])
            with pytest.raises(ks.SessionBusy) as busy:
                await s.save()
            assert not isinstance(busy.value, SnapshotConflict)
            child.stdin.close()
            assert child.wait(timeout=60) == 0  # released its lease on close
            s.state.generation = 1  # pretend we had loaded before the child's save
            with pytest.raises(SnapshotConflict):
                await s.save()
            s.state.generation = 2
            assert (await s.save()).generation == 3
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
