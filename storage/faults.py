"""Test-only fault injection: the write paths of the disk and Redis backends call `point(name)` between every
write, fsync, rename and command, and `point` calls the installed hook, if any.

Off by default and then a single global read per point. A crash test installs a hook that SIGKILLs the
process at the n-th hit of a chosen point (see tests/reliability/crash_worker.py); a fault test installs one
that raises OSError. Points are named `<backend>.<object>.<step>`, e.g. `disk.manifest.renamed`.
"""

from __future__ import annotations

from collections.abc import Callable

hook: Callable[[str], None] | None = None
"""Installed by tests only; receives the name of each point reached."""

POINTS = (
    "disk.blob.written",  # temp file written, not yet fsynced
    "disk.blob.fsynced",  # temp file fsynced, not yet linked into place
    "disk.blob.linked",  # final name exists, directory not yet fsynced
    "disk.blob.done",
    "disk.manifest.written",
    "disk.manifest.fsynced",
    "disk.manifest.renamed",
    "disk.manifest.done",
    "disk.lease.written",
    "redis.blobs.sent",
    "redis.manifest.before",
    "redis.manifest.done",
)


def point(name: str) -> None:
    """Reached fault point `name` (one of POINTS)."""
    if hook is not None:
        hook(name)
