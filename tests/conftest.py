"""Shared fixtures: one real redis-server per test run, started on a free port in a temp dir, and (for the
cluster tests) one 3-node Redis Cluster on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# One intra-op thread unless the caller chose: the tests run a tiny model, where a second OpenMP thread gains
# little, and on a shared 2-core machine its spin-waits made CPU steps ~10x slower (test_cuda_graph_decode.py:
# 150 s against 19 s under load). Set before torch is imported; subprocesses (new-process resumes, crash
# workers, servers) inherit it, so a parent and its child compute with the same thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Where a test does run more than one (EngineConfig.cpu_threads, say), idle OpenMP threads sleep instead of
# spinning: a count that leaked to later tests' step threads made them 5-7x slower here (tool_choice's module
# 45-54 s against 6-7 s with PASSIVE). Also read once, when torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Triton kernels run on the CPU through Triton's interpreter. Set here, before any test module is collected,
# because triton reads the variable once at import: tests outside tests/kernels (the graphed decode's Triton
# path, say) would otherwise find triton imported without it and skip. Not on a machine with a GPU.
if not torch.cuda.is_available():  # (importing torch does not import triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from redis_server import (
    REDIS_CLI,
    REDIS_SERVER,
    start_redis_cluster,
    start_redis_server,
    stop_redis_cluster,
    stop_redis_server,
)


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


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0?cluster=1 of a 3-node Redis Cluster (3 primaries, no replicas) started on free
    loopback ports for this test session; the url names one node, the client discovers the others."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli not found on PATH; install redis-server to run the cluster tests")
    ports, procs = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield f"redis://127.0.0.1:{ports[0]}/0?cluster=1"
    finally:
        stop_redis_cluster(procs)
