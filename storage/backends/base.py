"""The `BlobStore` ABC every backend implements, plus the checks they share.

A store holds two kinds of objects:
- blobs, named by the sha256 of their bytes, immutable: `put_blob` never overwrites, `get_blob` verifies the
  hash of what it read before returning it;
- manifests, one small mutable document per session id (the commit point of a snapshot).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import anyio
import anyio.to_thread

from ..blobs import HASH_THREADS, check_digest
from ..errors import BlobNotFound, IntegrityError
from ..manifest import SESSION_ID_PATTERN
from ..stream import BlobStream

_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
# Hashing releases the GIL; above this size it runs in a worker thread so the event loop stays responsive.
_THREAD_HASH_BYTES = 1 << 20
_VERIFY_BATCH = 64  # blobs read back at a time by verify_blobs, which bounds the bytes it holds
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_LEASE_TTL_S = 30.0
"""How long a session's write lease lasts without a save or a renewal."""


@dataclass(frozen=True)
class StoreStats:
    """What a store holds right now (read from the store, so other processes' writes count too)."""

    num_blobs: int
    blob_bytes: int
    num_manifests: int
    manifest_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.blob_bytes + self.manifest_bytes


def check_session_id(session_id: object) -> str:
    """Return `session_id` if it matches `[A-Za-z0-9_-]{1,128}`, else raise ValueError naming it."""
    if not isinstance(session_id, str) or _SESSION_ID_RE.fullmatch(session_id) is None:
        raise ValueError(f"session id must match {SESSION_ID_PATTERN}, got {session_id!r:.140}")
    return session_id


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


async def verify_blob(digest: str, data: bytes | memoryview, *, where: str) -> None:
    """Raise IntegrityError if sha256(data) is not `digest`."""
    if len(data) >= _THREAD_HASH_BYTES:
        actual = await anyio.to_thread.run_sync(_sha256, data)
    else:
        actual = _sha256(data)
    if actual != digest:
        raise IntegrityError(
            f"{where}: blob {digest} has sha256 {actual} ({len(data)} bytes); corrupt or truncated"
        )


def scatter(data: bytes, bufs: Sequence[memoryview]) -> bool:
    """Copy ``data`` into ``bufs`` back to back if their sizes add up to its length; False (nothing copied)
    otherwise. memmove through ctypes, which releases the GIL: several threads scatter in parallel."""
    if sum(len(b) for b in bufs) != len(data):
        return False
    src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    for b in bufs:
        if len(b):
            ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(b)), src, len(b))
            src += len(b)
    return True


def scatter_all(items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int]:
    """`scatter` of every (data, buffers) pair, on up to HASH_THREADS threads for large batches; the indices
    whose sizes did not add up (nothing copied there)."""
    nbytes = sum(len(data) for data, _ in items)
    threads = min(HASH_THREADS, max(1, nbytes // (8 << 20)))  # about 8 MiB a thread at least
    if threads <= 1:
        return [i for i, (data, bufs) in enumerate(items) if not scatter(data, bufs)]
    step = -(-len(items) // threads)

    def run(lo: int) -> list[int]:
        return [i for i in range(lo, min(len(items), lo + step)) if not scatter(*items[i])]

    with ThreadPoolExecutor(threads, thread_name_prefix="scatter") as ex:
        return [i for part in ex.map(run, range(0, len(items), step)) for i in part]


def stored_generation(data: bytes | None) -> int | None:
    """The `generation` of a stored manifest's bytes for compare-and-set: 0 if absent, None if unreadable."""
    if data is None:
        return 0
    try:
        gen = json.loads(data).get("generation", 0)
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else None


class BlobStore(ABC):
    """A persistent (or volatile) home for blobs and manifests; every method is async and anyio-compatible."""

    url: str = ""
    """How `open_store` names this store; for logs and errors."""

    # --- blobs -------------------------------------------------------------------------------------------

    @abstractmethod
    async def put_blob(self, digest: str, data: bytes) -> bool:
        """Store `data` under `digest` unless present; True if written, False if it already existed.

        ValueError if `digest` is malformed, IntegrityError if it is not the sha256 of `data`.
        """

    @abstractmethod
    async def get_blob(self, digest: str) -> bytes:
        """The verified bytes of a blob; BlobNotFound if absent, IntegrityError if corrupt or truncated."""

    @abstractmethod
    async def has_blobs(self, digests: Iterable[str]) -> set[str]:
        """The subset of `digests` that is stored (complete blobs only)."""

    @abstractmethod
    async def delete_blob(self, digest: str) -> bool:
        """Remove a blob; True if it existed. Idempotent."""

    @abstractmethod
    async def list_blobs(self) -> list[str]:
        """Every stored blob digest."""

    @abstractmethod
    async def touch_blobs(self, digests: Iterable[str]) -> None:
        """Mark blobs as just used, so garbage collection spares them for a grace period (see `recent_blobs`)."""

    @abstractmethod
    async def recent_blobs(self, within_s: float) -> set[str]:
        """Blobs written or touched in the last `within_s` seconds (by any process)."""

    async def recently_touched(self, digests: Iterable[str], within_s: float) -> set[str]:
        """The subset of `digests` written or touched in the last `within_s` seconds (by any process). Backends
        answer for just these digests, cheaply, so a garbage collection can ask again right before deleting."""
        return set(digests) & await self.recent_blobs(within_s)

    async def put_blobs(
        self, blobs: Mapping[str, bytes], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        """Store many blobs, at most `max_in_flight` at once; returns the digests actually written.

        `verified=True` says the caller computed every digest from these very bytes (the engine names each blob
        by hashing it): a backend may then skip its own hash pass. Loads always verify."""
        written: set[str] = set()
        limit = anyio.Semaphore(max(1, max_in_flight))

        errors: list[Exception] = []

        async def one(d: str, data: bytes) -> None:
            async with limit:
                if errors:
                    return
                try:
                    if await self.put_blob(d, data):
                        written.add(d)
                except Exception as e:  # re-raised below as itself, not wrapped in an ExceptionGroup
                    errors.append(e)

        async with anyio.create_task_group() as tg:
            for d, data in blobs.items():
                tg.start_soon(one, d, data)
        if errors:
            raise errors[0]
        return written

    async def put_blob_stream(
        self, stream: BlobStream, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, verified: bool = False
    ) -> set[str]:
        """Store the blobs of ``stream`` as its producer hands them over, writing one chunk while the next is
        made; returns the digests actually written. Raises what the producer failed with, or what `put_blobs`
        raises (the stream is then abandoned). This default writes each chunk with `put_blobs`; a disk store
        writes the whole stream into one pack."""
        written: set[str] = set()
        chunks = stream.chunks()
        try:
            while (chunk := await anyio.to_thread.run_sync(next, chunks, None)) is not None:
                written |= await self.put_blobs(dict(chunk), max_in_flight=max_in_flight, verified=verified)
        except BaseException:
            stream.abandon()
            raise
        return written

    async def get_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> dict[str, bytes]:
        """Verified bytes of many blobs, at most `max_in_flight` reads at once."""
        out: dict[str, bytes] = {}
        limit = anyio.Semaphore(max(1, max_in_flight))

        errors: list[Exception] = []

        async def one(d: str) -> None:
            async with limit:
                if errors:
                    return
                try:
                    out[d] = await self.get_blob(d)
                except Exception as e:  # re-raised below as itself (IntegrityError, ...), not as a group
                    errors.append(e)

        async with anyio.create_task_group() as tg:
            for d in dict.fromkeys(digests):
                tg.start_soon(one, d)
        if errors:
            raise errors[0]
        return out

    async def get_blobs_into(
        self, targets: Sequence[tuple[str, Sequence[memoryview]]], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> list[int]:
        """Read blob ``targets[i][0]`` into the writable byte buffers ``targets[i][1]``, back to back (its first
        bytes fill the first buffer, and so on), verified against its digest. Returns the indices ``i`` whose
        stored size is not the buffers' total: nothing is written to those (the caller reads them with
        `get_blob` to learn why). BlobNotFound / IntegrityError as `get_blobs`; after an error the buffers hold
        garbage. This default copies out of `get_blobs`; a backend that reads files reads into the buffers."""
        data = await self.get_blobs([d for d, _ in targets], max_in_flight=max_in_flight)
        items = [(data[d], bufs) for d, bufs in targets]
        return await anyio.to_thread.run_sync(scatter_all, items)

    async def verify_blobs(
        self, digests: Iterable[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    ) -> set[str]:
        """The subset of `digests` whose stored bytes are missing, corrupt or truncated: each blob is read from
        the persistent store (never from a cache in front of it) and hashed, a batch at a time."""
        wanted = list(dict.fromkeys(digests))
        bad: set[str] = set()
        for i in range(0, len(wanted), _VERIFY_BATCH):
            batch = wanted[i : i + _VERIFY_BATCH]
            try:
                await self.get_blobs(batch, max_in_flight=max_in_flight)
                continue
            except (IntegrityError, BlobNotFound):
                pass
            for d in batch:  # a batch read stops at its first bad blob: find every one
                try:
                    await self.get_blob(d)
                except (IntegrityError, BlobNotFound):
                    bad.add(d)
        return bad

    # --- manifests ---------------------------------------------------------------------------------------

    @abstractmethod
    async def put_manifest(self, session_id: str, data: bytes) -> None:
        """Write (or replace) a session's manifest atomically: readers see the old or the new one, whole."""

    @abstractmethod
    async def get_manifest(self, session_id: str) -> bytes:
        """A session's manifest bytes; ManifestNotFound if absent."""

    @abstractmethod
    async def list_manifests(self) -> list[str]:
        """Every session id that has a manifest."""

    @abstractmethod
    async def delete_manifest(self, session_id: str) -> bool:
        """Remove a session's manifest; True if it existed. Idempotent."""

    # --- leases and compare-and-set ----------------------------------------------------------------------

    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    """Lifetime of a write lease taken through this store (SnapshotStore passes it to the calls below)."""

    @abstractmethod
    async def acquire_lease(self, session_id: str, owner: str, ttl_s: float) -> int:
        """Hold the write lease of `session_id` as `owner` for `ttl_s` seconds; returns its fencing token.

        Renews (same token) if `owner` holds it already; a new holder gets a token larger than every earlier
        one of this session. SessionBusy if another owner holds an unexpired lease.
        """

    @abstractmethod
    async def release_lease(self, session_id: str, owner: str) -> bool:
        """Give the lease back if `owner` holds it; True if it did."""

    @abstractmethod
    async def commit_manifest(
        self, session_id: str, data: bytes, *, expected_generation: int, owner: str, ttl_s: float
    ) -> int:
        """Atomically: check that the lease is free, expired or `owner`'s (else SessionBusy) and that the
        stored manifest has generation `expected_generation` (0 = none stored; else SnapshotConflict), write
        `data` as the manifest (atomically, like put_manifest) and hold the lease for `ttl_s` more seconds.
        Returns the lease's fencing token. Idempotent: where the stored manifest is already `data` (this commit
        landed and its reply was lost, and the client sent it again), it commits again whatever the generation."""

    # --- accounting and lifetime -------------------------------------------------------------------------

    @abstractmethod
    async def stats(self) -> StoreStats:
        """Counts and bytes currently stored."""

    async def bytes_stored(self) -> int:
        """Bytes of all blobs plus all manifests currently stored."""
        return (await self.stats()).total_bytes

    async def close(self) -> None:  # noqa: B027 - optional hook; most backends hold nothing to release
        """Release connections and handles; the store is unusable afterwards."""

    async def __aenter__(self) -> BlobStore:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "BlobStore",
    "StoreStats",
    "check_digest",
    "check_session_id",
    "scatter",
    "scatter_all",
    "stored_generation",
    "verify_blob",
]
