"""Start a throwaway redis-server for tests: free port, private tmp dir, no persistence.

Usable from any test folder: `start_redis_server(tmp_dir) -> (port, process)`, `stop_redis_server(process)`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")


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
