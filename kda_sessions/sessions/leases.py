"""Lease renewal: a session this engine holds keeps its write lease for as long as the engine lives.

A lease in the store lasts ``lease_ttl_s`` and is renewed by each save; an engine that holds a session idle for
longer than that would otherwise let a second engine take it over. ``LeaseKeeper`` renews, every quarter of the
TTL, the lease of every session that is both held by the engine (resident, moved out, or being saved) and leased
by its store. It runs on a daemon thread that hands each round to the engine's event loop (the stores' clients
belong to that loop), so it works on any anyio backend and never delays the model step.

Failures never reach the engine: an unreachable store is logged and retried next round (the lease may then
expire, and another engine may take the session); a lease another engine now holds is dropped from the store's
set, so the next save of that session raises SessionBusy (or SnapshotConflict if the other engine saved) instead
of overwriting anything. A process that dies without closing its engine leaves its leases to expire.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import anyio
import anyio.from_thread

from ..errors import SessionBusy
from ..storage import SnapshotStore
from .manager import SessionManager

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.05


class LeaseKeeper:
    """Renews the write leases of the sessions ``manager`` holds, every ``lease_ttl_s / 4`` (see module doc).
    ``token`` is the event loop the stores belong to."""

    def __init__(self, manager: SessionManager, token: Any) -> None:
        self.manager = manager
        self._token = token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kda-lease-keeper", daemon=True)
        self.renewals = 0
        """Leases renewed so far (each session once per round)."""
        self.failures = 0
        """Renewals that failed (store unreachable, or the lease was lost to another engine)."""

    def interval_s(self) -> float:
        """A quarter of the shortest lease lifetime among the engine's stores: renewed well before expiry
        (a disk lease is only rewritten once less than half of it is left, so it is rewritten at about TTL/2)."""
        ttl = min(io.snapshots.lease_ttl_s for io in self.manager.stores().values())
        return max(MIN_INTERVAL_S, ttl / 4)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop renewing (a round in progress finishes first); leases stay until released or expired."""
        self._stop.set()
        if self._thread.is_alive():
            await anyio.to_thread.run_sync(self._thread.join)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s()):
            try:
                anyio.from_thread.run(self.renew_once, token=self._token)
            except RuntimeError:  # the event loop is gone (engine not closed before its loop ended)
                return
            except Exception:  # renew_once handles store errors; anything else must not end the renewals
                log.exception("lease renewal round failed")

    async def renew_once(self) -> int:
        """Renew the lease of every session this engine holds and its store has leased; how many were."""
        renewed = 0
        failed: list[tuple[str, Exception]] = []
        for tenant, io in self.manager.stores().items():
            snaps = io.snapshots
            for sid in sorted(snaps.leased):
                if self._stop.is_set():
                    return renewed
                if not self.manager.is_held(tenant, sid):
                    continue  # being resumed (not held yet) or forgotten: left to the next round or to expire
                try:
                    await snaps.acquire_lease(sid)
                except SessionBusy as e:
                    self.failures += 1
                    log.warning("session %s: write lease lost to another engine; its next save will raise "
                                "SessionBusy (%s)", sid, e)
                    await self._drop(snaps, sid)
                except Exception as e:  # StoreUnavailable and the like: try again next round
                    self.failures += 1
                    failed.append((sid, e))
                else:
                    renewed += 1
        if failed:  # one line per round, not one per session: a store outage would flood the log
            log.warning("lease renewal failed for %d sessions, retrying in %.1f s (first: %s: %s)",
                        len(failed), self.interval_s(), failed[0][0], failed[0][1])
        self.renewals += renewed
        return renewed

    @staticmethod
    async def _drop(snaps: SnapshotStore, sid: str) -> None:
        """Forget a lease another owner holds (release_lease only deletes a lease if it is ours)."""
        try:
            await snaps.release_lease(sid)
        except Exception as e:
            log.warning("session %s: could not forget the lost lease: %s", sid, e)
