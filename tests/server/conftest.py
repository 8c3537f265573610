"""Servers per test module: an open one and one that needs an API key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server_helpers import API_KEY, ServerThread, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """Open (no API key), memory store."""
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerThread]:
    """Needs API_KEY; small body limit."""
    srv = start_server(api_keys=[API_KEY], max_body_bytes=4096)
    yield srv
    srv.stop()
