"""Start a throwaway redis-server for tests: free port, private tmp dir, no persistence.

Usable from any test folder: `start_redis_server(tmp_dir) -> (port, process)`, `stop_redis_server(process)`;
a 3-node Redis Cluster: `start_redis_cluster(tmp_dir) -> (ports, processes)`, `stop_redis_cluster(processes)`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = os.environ.get("KDA_REDIS_SERVER") or shutil.which("redis-server")
"""The redis-server binary: ``$KDA_REDIS_SERVER`` (a binary carried with its shared libraries in its own folder,
as on the GPU device) or else the one on PATH."""


def redis_env() -> dict[str, str] | None:
    """The environment to run a carried binary in: its folder first on LD_LIBRARY_PATH (None: inherit)."""
    if not os.environ.get("KDA_REDIS_SERVER"):
        return None
    folder = os.path.dirname(os.path.abspath(os.environ["KDA_REDIS_SERVER"]))
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [folder, os.environ.get("LD_LIBRARY_PATH")]))}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(
    tmp_dir: Path,
    *,
    attempts: int = 3,
    timeout_s: float = 10.0,
    port: int | None = None,
    appendfsync: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> tuple[int, subprocess.Popen[bytes]]:
    """Start redis-server on a free port with its files in `tmp_dir`; returns (port, process) once it answers PING.

    `port` reuses a given port (a restart); `appendfsync` ("always", "everysec") turns the append-only file on
    in `tmp_dir`, so a restart on the same dir reloads the data. Raises FileNotFoundError if the binary is
    absent, RuntimeError if it never comes up.
    """
    if REDIS_SERVER is None:
        raise FileNotFoundError("redis-server is not on PATH")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_dir / "redis.log"
    chosen = port
    for _ in range(attempts):  # the port can be taken between free_port() and bind; retry on another
        port = chosen if chosen is not None else free_port()
        aof = ["--appendonly", "yes", "--appendfsync", appendfsync] if appendfsync else ["--appendonly", "no"]
        proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *aof,
                *extra_args,
                "--dir",
                str(tmp_dir),
                "--logfile",
                str(log),
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=redis_env(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _pong(port):
                return port, proc
            time.sleep(0.02)
        stop_redis_server(proc)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"redis-server did not start after {attempts} attempts; log tail:\n{tail}")


def stop_redis_server(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the server started by `start_redis_server` and wait for it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


REDIS_CLI = shutil.which("redis-cli")


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def _cluster_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"CLUSTER INFO\r\n")
            return b"cluster_state:ok" in s.recv(4096)
    except OSError:
        return False


def start_redis_cluster(
    tmp_dir: Path, *, nodes: int = 3, timeout_s: float = 20.0, attempts: int = 3
) -> tuple[list[int], list[subprocess.Popen[bytes]]]:
    """Start a Redis Cluster of `nodes` primaries (no replicas) on free loopback ports, files in `tmp_dir`.

    Each node is a `start_redis_server` with `--cluster-enabled yes` and its own dir; `redis-cli --cluster create`
    assigns the 16384 slots, and this returns (ports, processes) once every node reports `cluster_state:ok`.
    Stop it with `stop_redis_cluster(processes)`. Raises FileNotFoundError without redis-server/redis-cli,
    RuntimeError if the cluster never forms (the node logs' tails are in the message).
    """
    if REDIS_SERVER is None or REDIS_CLI is None:
        raise FileNotFoundError("redis-server and redis-cli must be on PATH for a Redis Cluster")
    last_error = ""
    for attempt in range(attempts):  # a port can be taken between free_port() and bind; start over on others
        ports: list[int] = []
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(nodes):
                node_dir = tmp_dir / f"try{attempt}-node{i}"
                port, proc = start_redis_server(
                    node_dir,
                    port=_free_cluster_port(),
                    attempts=1,
                    extra_args=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout", "2000",
                    ),
                )
                ports.append(port)
                procs.append(proc)
            create = subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout_s,
            )
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-1000:]}{create.stderr}")
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if all(_cluster_ok(p) for p in ports):
                    return ports, procs
                time.sleep(0.05)
            raise RuntimeError(f"cluster on ports {ports} never reached cluster_state:ok")
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            last_error = str(e)
            stop_redis_cluster(procs)
    logs = "".join(
        f"\n--- {log}\n{log.read_text(errors='replace')[-600:]}" for log in sorted(tmp_dir.glob("*/redis.log"))
    )
    raise RuntimeError(f"Redis Cluster did not form after {attempts} attempts: {last_error}{logs}")


def stop_redis_cluster(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop every node started by `start_redis_cluster`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        stop_redis_server(proc)
