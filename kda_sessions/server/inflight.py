"""Which sessions are answering a request right now.

A second request on a session that is answering one gets 409 ``session_busy`` at once instead of queueing behind
it. This is tracked per request, not read from the session's lock: the engine also holds that lock briefly for
its own work (saving an idle session it evicts to free a slot, forking a new session from one of its checkpoints
for prefix reuse), and a request arriving then should wait those milliseconds, not fail.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from .errors import ApiError

Key = tuple[str | None, str]


class InFlight:
    def __init__(self) -> None:
        self._held: set[Key] = set()

    def check(self, tenant: str | None, session_id: str) -> None:
        """409 if the session is answering a request."""
        if (tenant, session_id) in self._held:
            raise ApiError(409, f"session {session_id!r} is answering another request", "session_busy")

    @contextmanager
    def claim(self, tenant: str | None, session_id: str) -> Iterator[None]:
        """Mark the session as answering a request for the block (409 if it already is)."""
        self.check(tenant, session_id)
        self._held.add((tenant, session_id))
        try:
            yield
        finally:
            self._held.discard((tenant, session_id))

    async def claimed_stream(self, tenant: str | None, session_id: str, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``events`` with the session claimed from the first chunk to the end of the stream (claimed inside the
        generator: a response whose body never starts must not leave the session claimed)."""
        with self.claim(tenant, session_id):
            async for chunk in events:
                yield chunk
