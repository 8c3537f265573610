"""LeaseKeeper (sessions/leases.py) over a memory store and a fake manager: a held session's lease is renewed with
its fencing token kept, an unheld one is left to expire, a lease lost to another owner (the holder looked dead) is
dropped, an unreachable store is retried, and the keeper's thread renews on its own until stopped."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import pytest

import kda_sessions as ks
from kda_sessions.errors import StoreUnavailable
from kda_sessions.sessions.leases import MIN_INTERVAL_S, LeaseKeeper
from kda_sessions.storage import SnapshotStore, open_store


@dataclass
class FakeIO:
    snapshots: SnapshotStore


@dataclass
class FakeManager:
    """The two methods LeaseKeeper uses: the stores by tenant, and which sessions the engine holds."""

    io: dict[str | None, FakeIO]
    held: set[tuple[str | None, str]] = field(default_factory=set)

    def stores(self) -> dict[str | None, FakeIO]:
        return self.io

    def is_held(self, tenant: str | None, session_id: str) -> bool:
        return (tenant, session_id) in self.held


async def two_owners(ttl_s: float = 60.0) -> tuple[SnapshotStore, SnapshotStore]:
    """Two lease owners (two engines) over one memory store."""
    backend = await open_store("memory:")
    a, b = SnapshotStore(backend), SnapshotStore(backend)
    a.lease_ttl_s = b.lease_ttl_s = ttl_s
    return a, b


def keeper(manager: FakeManager) -> LeaseKeeper:
    return LeaseKeeper(manager, anyio.lowlevel.current_token())  # type: ignore[arg-type]


async def test_renew_keeps_the_fence_of_held_sessions_and_skips_unheld_ones() -> None:
    a, b = await two_owners(ttl_s=0.5)
    fence = await a.acquire_lease("s_held")
    await a.acquire_lease("s_gone")
    k = keeper(FakeManager({None: FakeIO(a)}, held={(None, "s_held")}))
    assert k.interval_s() == pytest.approx(0.5 / 4)
    time.sleep(0.3)
    assert await k.renew_once() == 1 and k.renewals == 1 and k.failures == 0
    time.sleep(0.3)  # 0.6 s after the first acquire: only the renewed lease is still live
    with pytest.raises(ks.SessionBusy):
        await b.acquire_lease("s_held")
    assert await b.acquire_lease("s_gone") > 1  # expired: taken over, with a larger fencing token
    assert await a.acquire_lease("s_held") == fence  # renewal never changes the token


async def test_a_lease_lost_to_another_owner_is_dropped_and_saves_are_fenced() -> None:
    a, b = await two_owners(ttl_s=0.1)
    f1 = await a.acquire_lease("s1")
    time.sleep(0.15)  # a's process stalled (or died) past its TTL: b takes the session
    f2 = await b.acquire_lease("s1")
    assert f2 > f1
    k = keeper(FakeManager({None: FakeIO(a)}, held={(None, "s1")}))
    assert await k.renew_once() == 0 and k.failures == 1
    assert "s1" not in a.leased  # dropped: a's next save must not look like it holds the lease
    with pytest.raises(ks.SessionBusy):
        await a.acquire_lease("s1")
    assert await b.acquire_lease("s1") == f2  # b's lease untouched by a's drop


class DownStore:
    """A SnapshotStore whose backend is unreachable."""

    lease_ttl_s = 1.0
    leased = frozenset({"s1", "s2"})

    async def acquire_lease(self, session_id: str) -> int:
        raise StoreUnavailable("connection refused")

    async def release_lease(self, session_id: str) -> bool:
        raise AssertionError("an unreachable store's lease is retried, not dropped")


async def test_an_unreachable_store_counts_failures_and_keeps_the_leases_for_the_next_round() -> None:
    a, _ = await two_owners()
    await a.acquire_lease("s1")
    m = FakeManager({None: FakeIO(a), "t": FakeIO(DownStore())},  # type: ignore[arg-type]
                    held={(None, "s1"), ("t", "s1"), ("t", "s2")})
    k = keeper(m)
    assert k.interval_s() == pytest.approx(0.25)  # the shortest TTL of all stores
    assert await k.renew_once() == 1 and k.failures == 2
    assert await k.renew_once() == 1 and k.failures == 4 and k.renewals == 2


async def test_the_thread_renews_until_stopped() -> None:
    a, b = await two_owners(ttl_s=MIN_INTERVAL_S * 4)
    await a.acquire_lease("s1")
    k = keeper(FakeManager({None: FakeIO(a)}, held={(None, "s1")}))
    k.start()
    with anyio.fail_after(5):
        while k.renewals < 6:
            await anyio.sleep(0.01)
    with pytest.raises(ks.SessionBusy):  # older than one TTL, still held
        await b.acquire_lease("s1")
    await k.stop()
    done = k.renewals
    await anyio.sleep(3 * MIN_INTERVAL_S)
    assert k.renewals == done
