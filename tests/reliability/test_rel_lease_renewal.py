"""Lease renewal: a session an engine holds keeps its write lease while the engine lives, however long it idles;
after the engine closes (release) or dies (no release) another engine can take the session, at once or once the
TTL has passed; a renewal that fails does not hurt the engine, and a lease lost meanwhile surfaces as SessionBusy
on the next save instead of overwriting anything."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
from pydantic import ValidationError

import kda_sessions as ks
from kda_sessions.engine.config import EngineConfig

TTL = 0.5  # the least EngineConfig allows: the waits below are multiples of it
ENGINE_ARGS = {"page_size": 16, "max_active_sessions": 4, "num_pages": 256, "ram_tier_bytes": 0, "lease_ttl_s": TTL}


@pytest.fixture(params=["disk", "redis"])
def store_url(request, tmp_path) -> str:
    if request.param == "disk":
        return f"disk:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url") + f"?prefix=renew{tmp_path.name[-8:]}:"


@pytest.fixture
async def engines(store_url) -> AsyncIterator[tuple[ks.Engine, ks.Engine]]:
    a = await ks.Engine.open(model="tiny-random", store=store_url, **ENGINE_ARGS)
    b = await ks.Engine.open(model="tiny-random", store=store_url, **ENGINE_ARGS)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def _saved_session(eng: ks.Engine) -> ks.Session:
    s = await eng.create_session(system="lease test")
    await s.append([40, 41, 42, 43, 44])
    await s.save()
    return s


def _crash(eng: ks.Engine) -> None:
    """What a SIGKILL does to the leases: renewals stop and nothing is released."""
    eng.leases._stop.set()


async def test_idle_session_stays_leased_past_the_ttl_then_is_taken_after_a_crash(engines):
    a, b = engines
    s = await _saved_session(a)
    t0 = time.monotonic()
    await anyio.sleep(2.5 * TTL)  # idle well past the TTL: only the renewals keep the lease
    assert a.leases.renewals >= 2 and a.leases.failures == 0
    s_b = await b.resume(s.id)  # reading a held session is allowed
    with pytest.raises(ks.SessionBusy):
        await s_b.save()
    with pytest.raises(ks.SessionBusy):
        await b.io.snapshots.acquire_lease(s.id)
    assert time.monotonic() - t0 > 2 * TTL

    _crash(a)
    t_crash = time.monotonic()
    deadline = t_crash + 5 * TTL
    while True:  # the dead engine's lease expires within one TTL (renewed at most TTL ago)
        try:
            await b.io.snapshots.acquire_lease(s.id)
            break
        except ks.SessionBusy:
            assert time.monotonic() < deadline, "the crashed engine's lease never expired"
            await anyio.sleep(0.05)
    took_after = time.monotonic() - t_crash
    assert took_after <= TTL + 0.5
    await s_b.save()  # b loaded the latest generation: its save commits
    print(f"\nlease taken over {took_after:.2f} s after the holder stopped renewing (TTL {TTL} s)")

    # a's lease is gone: its next save says so instead of overwriting b's
    await s.append([45])
    with pytest.raises(ks.SessionBusy):
        await s.save()


async def test_close_releases_at_once(engines):
    a, b = engines
    s = await _saved_session(a)
    await anyio.sleep(1.5 * TTL)
    with pytest.raises(ks.SessionBusy):
        await b.io.snapshots.acquire_lease(s.id)
    await a.close()
    s_b = await b.resume(s.id)
    await b.io.snapshots.acquire_lease(s.id)  # no wait for the TTL
    await s_b.append([50, 51])
    await s_b.save()


async def test_failed_renewals_do_not_hurt_the_engine_and_a_lost_lease_is_session_busy(engines, monkeypatch):
    a, b = engines
    s = await _saved_session(a)
    snaps = a.io.snapshots

    async def unreachable(session_id: str) -> int:
        raise ks.StoreUnavailable("injected: store unreachable")

    monkeypatch.setattr(snaps, "acquire_lease", unreachable)
    await anyio.sleep(1.6 * TTL)  # renewals fail and the lease expires
    assert a.leases.failures >= 2
    r = await s.generate(max_tokens=2, ignore_eos=True)  # the engine still serves the session
    assert len(r.token_ids) == 2

    s_b = await b.resume(s.id)  # the lease expired: b takes it over and saves
    await b.io.snapshots.acquire_lease(s.id)
    await s_b.append([60])
    await s_b.save()

    monkeypatch.undo()  # the store is back: a's renewal finds the lease held by b and drops it
    deadline = time.monotonic() + 5 * TTL
    while s.id in snaps.leased:
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)
    with pytest.raises(ks.SessionBusy):  # never a silent overwrite of b's save
        await s.save()


def test_lease_ttl_is_validated():
    assert EngineConfig(lease_ttl_s=2.0).lease_ttl_s == 2.0
    assert EngineConfig().lease_ttl_s is None
    for bad in (0, 0.1, -1.0):
        with pytest.raises(ValidationError):
            EngineConfig(lease_ttl_s=bad)


async def test_lease_ttl_reaches_the_store(tmp_path):
    async with await ks.Engine.open(model="tiny-random", store=f"disk:{tmp_path}", lease_ttl_s=7.0) as eng:
        assert eng.io.snapshots.lease_ttl_s == 7.0
        assert eng.leases.interval_s() == pytest.approx(7.0 / 4)
        t = await eng.for_tenant("acme")
        assert t.io.snapshots.lease_ttl_s == 7.0
