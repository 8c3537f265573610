"""The disk store's mutable side: one manifest file per session, and the session's write lease.

    ROOT/manifests/<session>.json  a session's manifest
    ROOT/leases/<session>.lock     the session's write lease: JSON {owner, fence, pid, host, expires_at}
    ROOT/leases/<session>.fence    the last fencing token handed out for the session
    ROOT/leases/<session>.guard    empty; flock()ed around every lease change and manifest commit

A manifest is written to a temp file, fsynced, renamed into place and its directory fsynced: readers see the
old or the new one, whole. A lease is stale once `expires_at` (wall clock) has passed, or at once if it names a
process of this host that no longer exists (a crashed engine). The guard's flock is released by the kernel when
its holder dies, so a crash never leaves a session locked beyond its lease. Every method here blocks: the store
runs them in worker threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .. import faults
from ..errors import IntegrityError, SessionBusy, SnapshotConflict
from .base import check_session_id, stored_generation
from .disk_files import (
    HOST,
    O_CLOEXEC,
    O_NOFOLLOW,
    TMP_PREFIX,
    fsync_dir,
    pid_alive,
    read_file,
    replace_durably,
    unlink,
    write_temp,
)

logger = logging.getLogger(__name__)


class ManifestFiles:
    """Manifests under ``manifests`` and leases under ``leases``; ``url`` names the store in errors."""

    def __init__(self, url: str, manifests: Path, leases: Path) -> None:
        self.url = url
        self.manifests = manifests
        self.leases = leases

    def path(self, session_id: str) -> Path:
        return self.manifests / f"{check_session_id(session_id)}.json"

    # --- manifests ---------------------------------------------------------------------------------------

    @staticmethod
    def write(path: Path, data: bytes) -> None:
        """Replace the manifest at ``path`` atomically and durably."""
        tmp = write_temp(path.parent, data, ("disk.manifest.written", "disk.manifest.fsynced"))
        replace_durably(tmp, path, ("disk.manifest.renamed", "disk.manifest.done"))

    def scan(self) -> dict[str, int]:
        """Session id -> manifest size, for every manifest."""
        out: dict[str, int] = {}
        for entry in os.scandir(self.manifests):
            sid, ext = os.path.splitext(entry.name)
            if ext == ".json" and not entry.name.startswith(TMP_PREFIX):
                try:
                    out[check_session_id(sid)] = entry.stat(follow_symlinks=False).st_size
                except (ValueError, FileNotFoundError):
                    continue
        return out

    def delete(self, path: Path) -> bool:
        existed = unlink(path)
        if existed:
            fsync_dir(path.parent)  # a deleted session must not come back after a crash
        return existed

    # --- leases ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, session_id: str) -> Iterator[None]:
        """Exclusive flock on the session's guard file (released by the kernel if this process dies)."""
        fd = os.open(self.leases / f"{session_id}.guard", os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_lease(self, session_id: str) -> dict[str, object] | None:
        """The live lease record of another or this owner, or None if there is none or it is stale."""
        try:
            rec = json.loads(read_file(self.leases / f"{session_id}.lock"))
            expires_at, pid, host = float(rec["expires_at"]), int(rec["pid"]), str(rec["host"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as e:  # torn or foreign: a lease nobody can prove it holds
            logger.warning("session %s: ignoring an unreadable lease file (%s)", session_id, e)
            return None
        if expires_at <= time.time() or (host == HOST and not pid_alive(pid)):
            return None
        return dict(rec)

    def _check_lease(self, session_id: str, owner: str) -> dict[str, object] | None:
        rec = self._read_lease(session_id)
        if rec is not None and rec.get("owner") != owner:
            raise SessionBusy(
                f"session {session_id!r} is held by another writer (pid {rec.get('pid')} on {rec.get('host')}, "
                f"lease token {rec.get('fence')}, expires in {float(str(rec['expires_at'])) - time.time():.1f} s)"
            )
        return rec

    def _take_lease(self, session_id: str, owner: str, ttl_s: float, rec: dict[str, object] | None) -> int:
        """Write our lease (caller holds the guard and checked `rec`, the current live lease or None)."""
        if rec is not None:
            fence = int(str(rec["fence"]))
            if float(str(rec["expires_at"])) - time.time() > ttl_s / 2:
                return fence  # fresh enough: skip a write on every save
        else:
            fence_path = self.leases / f"{session_id}.fence"
            try:
                fence = int(read_file(fence_path) or b"0") + 1
            except FileNotFoundError:
                fence = 1
            except ValueError as e:  # the server's file, not the client's input: a 5xx, never a 400
                raise IntegrityError(f"{self.url}: lease fence file {fence_path} is corrupt: {e}") from e
            tmp = write_temp(self.leases, str(fence).encode())
            os.replace(tmp, fence_path)
            fsync_dir(self.leases)
        body = {"owner": owner, "fence": fence, "pid": os.getpid(), "host": HOST, "expires_at": time.time() + ttl_s}
        # Never fsynced: after a power loss every lease is void anyway (its process is gone).
        tmp = write_temp(self.leases, json.dumps(body).encode(), sync=False)
        os.replace(tmp, self.leases / f"{session_id}.lock")
        faults.point("disk.lease.written")
        return fence

    def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        with self._guard(session_id):
            return self._take_lease(session_id, owner, ttl_s, self._check_lease(session_id, owner))

    def release_lease(self, session_id: str, owner: str) -> bool:
        with self._guard(session_id):
            rec = self._read_lease(session_id)
            if rec is None or rec.get("owner") != owner:
                return False
            return unlink(self.leases / f"{session_id}.lock")

    def commit(self, session_id: str, data: bytes, expected_generation: int, owner: str, ttl_s: float) -> int:
        """`BlobStore.commit_manifest` under the session's guard; returns the lease's fencing token."""
        path = self.path(session_id)
        with self._guard(session_id):
            rec = self._check_lease(session_id, owner)
            try:
                old: bytes | None = read_file(path)
            except FileNotFoundError:
                old = None
            stored = stored_generation(old)
            if stored != expected_generation and old != data:  # these very bytes stored: the commit landed already
                raise SnapshotConflict(
                    f"session {session_id!r}: stored generation is {stored}, this save expected {expected_generation}"
                )
            self.write(path, data)
            return self._take_lease(session_id, owner, ttl_s, rec)
