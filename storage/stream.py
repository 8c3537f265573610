"""`BlobStream`: blobs handed from a producer thread to a store's writer while later ones are still being made.

A save's page blobs come out of a device-to-host copy and a hash a chunk at a time. Written only once every
chunk is made, the copy, the hash and the write run one after the other; through a stream, the store writes
chunk i while chunk i + 1 is copied and hashed (`BlobStore.put_blob_stream`). The producer announces how many
blobs it will put at most (`announce`, or `count` at construction: a disk store writes one pack from that many on,
loose files below; the writer waits for it with `wait_count`), puts chunks of ``(digest, bytes)`` where the digest
may still be a `Future` of the hash running on another thread, then calls `close` (or `fail`, which the writer
re-raises). A producer that learns only late that some blobs need no writing (a save's KDA states hashed after
its pages, one already stored) announces the bound at once and puts fewer. The stream keeps every blob it was given, so the
caller can still repair or cache them after the write.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

Digest = str | Future[str]
"""A blob's sha256 in hex, or the Future of a hash still running."""

_END = object()


class StreamAbandoned(Exception):
    """The writer stopped reading (its write failed): the producer's `put` says so instead of piling up chunks."""


class BlobStream:
    """A one-shot, thread-safe channel of blob chunks from one producer to one writer; see the module docstring."""

    def __init__(self, count: int | None = None) -> None:
        self.count: int | None = None
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._given: list[tuple[Digest, bytes]] = []
        self._abandoned = threading.Event()
        self._counted = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        if count is not None:
            self.announce(count)

    # --- producer ----------------------------------------------------------------------------------------

    def announce(self, count: int) -> None:
        """Say how many blobs the stream will carry at most, before the first `put`."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        assert self.count is None, "count announced twice"
        self.count = count
        self._counted.set()

    def put(self, chunk: Sequence[tuple[Digest, bytes]]) -> None:
        """Hand over one chunk; StreamAbandoned if the writer has given up."""
        if self._abandoned.is_set():
            raise StreamAbandoned("the store stopped writing this stream")
        assert self.count is not None and not self._closed, "put before announce or after close"
        self._given.extend(chunk)
        self._queue.put(list(chunk))

    def close(self) -> None:
        """No more chunks. ValueError if more blobs than `count` were put (the writer then fails too)."""
        if self._closed:
            return
        if self.count is None:
            self.announce(len(self._given))
        assert self.count is not None
        self._closed = True
        if len(self._given) > self.count:
            err = ValueError(f"a blob stream announced {self.count} blobs and was given {len(self._given)}")
            self._queue.put(err)
            raise err
        self._queue.put(_END)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``: the writer raises it (its partial write is abandoned)."""
        if not self._closed:
            self._closed = True
            self._error = error
            self._queue.put(error)
            self._counted.set()

    # --- writer ------------------------------------------------------------------------------------------

    def wait_count(self) -> int:
        """The announced count (blocks until the producer announces it); raises what the producer failed with."""
        self._counted.wait()
        if self.count is None:
            assert self._error is not None
            raise self._error
        return self.count

    def chunks(self) -> Iterator[list[tuple[str, bytes]]]:
        """The chunks in order, each digest resolved (waits for its hash); blocks until the producer puts the
        next one. Raises what the producer failed with. A writer that stops early calls `abandon`."""
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, list)
            yield [(resolve(d), data) for d, data in item]

    def abandon(self) -> None:
        """Called by a writer that stops reading: the producer's next `put` raises StreamAbandoned."""
        self._abandoned.set()

    # --- after the write ---------------------------------------------------------------------------------

    def blobs(self) -> dict[str, bytes]:
        """Every blob put so far, digest -> bytes (waits for hashes still running)."""
        return {resolve(d): data for d, data in self._given}

    def digests(self) -> set[str]:
        """The digests of every blob put so far whose hash has finished (for cleanup after a failure)."""
        return {
            d if isinstance(d, str) else d.result()
            for d, _ in self._given
            if isinstance(d, str) or (d.done() and not d.cancelled() and d.exception() is None)
        }


def resolve(digest: Digest) -> str:
    return digest if isinstance(digest, str) else digest.result()
