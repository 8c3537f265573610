"""Fixtures of the reliability tests: the crash workers' zygotes, shared by every test of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rel_helpers import STORE_WORKER, WORKER, Zygote


class Zygotes:
    """One live zygote per worker script, started on first use; a closed one (a campaign that failed midway
    closes its zygote) is replaced by a fresh one."""

    def __init__(self) -> None:
        self._live: dict[Path, Zygote] = {}

    def get(self, worker: Path) -> Zygote:
        z = self._live.get(worker)
        if z is None or z.closed:
            z = self._live[worker] = Zygote(worker)
        return z

    def close(self) -> None:
        for z in self._live.values():
            z.close()


@pytest.fixture(scope="session")
def zygotes() -> Iterator[Zygotes]:
    zs = Zygotes()
    try:
        yield zs
    finally:
        zs.close()


@pytest.fixture
def engine_zygote(zygotes: Zygotes) -> Zygote:
    """The zygote of crash_worker.py (engine workers: a model, real sessions)."""
    return zygotes.get(WORKER)


@pytest.fixture
def store_zygote(zygotes: Zygotes) -> Zygote:
    """The zygote of crash_store_worker.py (storage workers: SnapshotStore, synthetic sessions)."""
    return zygotes.get(STORE_WORKER)
