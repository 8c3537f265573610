"""Shared fixtures: one real redis-server per test run, started on a free port in a temp dir."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ holds helpers shared by all test folders (redis_server.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_server import REDIS_SERVER, start_redis_server, stop_redis_server


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0 of a redis-server started for this test session."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server binary not found on PATH; install redis-server to run the redis tests")
    port, proc = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis_server(proc)
