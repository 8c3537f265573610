"""Bulk blob traffic for RedisStore: SET NX, GET and EXISTS of many keys over blocking sockets in worker threads.

redis.asyncio spends most of a save or load on copies and framing in Python (it joins every pipeline into one
bytes object, its reader copies each reply into a buffer and out again, and the event loop pauses and resumes
the socket every 128 KiB). Here each *lane* is one connection made and authenticated by redis-py's own (sync)
`Connection` (AUTH, SELECT, HELLO as the url says); its socket is then driven directly, one thread per lane:

- a command is framed by hand (RESP) and sent with `sendmsg` of [header, value, trailer], the value a
  memoryview of the caller's bytes: no copy in Python, the kernel takes the bytes straight from the blob;
- a reply header is read by peeking for its CRLF; a value is received with `MSG_WAITALL` into a fresh bytes
  object of its exact length: one copy (kernel to Python), and nothing to join or slice after;
- sha256 runs in the same thread (hashlib releases the GIL), so lanes hash and move bytes in parallel.

Timeouts are the socket's own (SO_RCVTIMEO / SO_SNDTIMEO) so a dead server fails as fast as through redis-py.
Plain TCP only: TLS and unix-socket stores keep redis-py's pipelines (`Lanes.for_client` returns None). A lane
that saw any error is closed, never reused (redis_io.py gives an idle pooled lane whose server dropped it one
retry on a new connection: every lane command is idempotent). A MOVED or ASK reply (a cluster resharding) is not an error here:
the item is reported as redirected and the store sends it again through redis-py, which follows the redirect.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.asyncio.connection import Connection as AsyncConnection
from redis.connection import Connection as SyncConnection

from ..errors import IntegrityError, StoreUnavailable

REDIRECTED = "redirected"
"""The per-item result of a command answered with MOVED or ASK."""
_IOV_MAX = 512  # buffers per sendmsg; Linux allows 1024
_PEEK = 64


Item = tuple[str, bytes | memoryview, str | None, bool]
"""A value to SET: key, value, the digest to check it against first (or None), NX."""


class ReplyError(Exception):
    """An error reply ("-ERR ...") other than a redirect."""


def frame(name: bytes, key: bytes, *rest: bytes | memoryview) -> list[bytes | memoryview]:
    """The RESP array of one command, as buffers for `sendmsg` (values are passed through, not copied)."""
    out: list[bytes | memoryview] = [b"*%d\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (2 + len(rest), len(name), name, len(key), key)]
    for r in rest:
        out.append(b"$%d\r\n" % len(r))
        out.append(r)
        out.append(b"\r\n")
    return out


class Lane:
    """One blocking connection, used by one thread at a time."""

    def __init__(self, conn: SyncConnection, timeout_s: float) -> None:
        conn.connect()  # redis-py's handshake: AUTH, SELECT, HELLO
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            conn.disconnect()
            raise StoreUnavailable(f"redis-py {type(conn).__name__} exposes no socket")
        self.conn = conn
        self.sock = sock
        self.rest = b""  # bytes received past the replies read so far (line_replies only)
        sock.settimeout(None)  # blocking; the kernel enforces the timeouts below (MSG_WAITALL needs this)
        tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def close(self) -> None:
        self.conn.disconnect()

    def send(self, bufs: list[bytes | memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        i = 0
        while i < len(views):
            n = self.sock.sendmsg(views[i : i + _IOV_MAX])
            while n and i < len(views):
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    def _recv(self, n: int, flags: int = 0) -> bytes:
        data = self.sock.recv(n, flags)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def header(self) -> bytes:
        """The next reply's first line, without its CRLF."""
        p = self._recv(_PEEK, socket.MSG_PEEK)
        while (j := p.find(b"\r\n")) < 0:  # a header split across segments: wait for one more byte
            p = self._recv(len(p) + 1, socket.MSG_PEEK | socket.MSG_WAITALL)
        self._exact(j + 2)
        return p[:j]

    def _exact(self, n: int) -> bytes:
        if n == 0:
            return b""
        data = self._recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        parts = [data]  # a signal or a slow sender cut MSG_WAITALL short
        got = len(data)
        while got < n:
            parts.append(self._recv(n - got, socket.MSG_WAITALL))
            got += len(parts[-1])
        return b"".join(parts)

    def reply(self) -> bytes | str | int | None:
        """One reply: a bulk string's bytes, None for nil, an integer, "OK"-like status text, or REDIRECTED.
        Raises ReplyError for any other error reply."""
        h = self.header()
        if h[:1] == b"$" and (n := int(h[1:])) >= 0:
            data = self._exact(n)
            self._exact(2)
            return data
        return parse_line(h)

    def line_replies(self, count: int) -> list[bytes | str | int | None]:
        """`count` replies that are one line each (status, integer, nil, error: the replies of SET and EXISTS),
        read in as few system calls as the socket allows. What arrived of later replies is kept for the next
        call (`self.rest`); an operation ends with it empty, so `reply()` never misses bytes."""
        buf = self.rest
        while len(lines := buf.split(b"\r\n")) <= count:  # the last element is an unfinished line
            buf += self._recv(1 << 16)
        self.rest = b"\r\n".join(lines[count:])
        return [parse_line(h) for h in lines[:count]]

    def set_many(self, items: Sequence[Item], batch_bytes: int) -> list[Any]:
        """SET key value [NX] for each (key, value, digest to check first or None, nx): True written, False
        present (NX), or REDIRECTED. A batch of about `batch_bytes` is hashed before any of it is sent; replies
        are read one batch behind, so the server stores one batch while the next is hashed and sent."""
        out: list[Any] = []
        pending = 0
        start = 0
        while start < len(items):
            stop, size = start, 0
            while stop < len(items) and (stop == start or size + len(items[stop][1]) <= batch_bytes):
                size += len(items[stop][1])
                stop += 1
            batch = items[start:stop]
            check_digests([(d, v) for _, v, d, _ in batch if d is not None], where="put")
            bufs: list[bytes | memoryview] = []
            for key, value, _, nx in batch:
                bufs += frame(b"SET", key.encode(), value, *((b"NX",) if nx else ()))
            self.send(bufs)
            out += self.line_replies(pending)
            pending = len(batch)
            start = stop
        out += self.line_replies(pending)
        self._done()
        return [r if r == REDIRECTED else r is not None for r in out]

    def _done(self) -> None:
        if self.rest:
            raise ReplyError(f"more replies than commands sent: {self.rest[:64]!r}")

    def exists(self, groups: Sequence[tuple[str, ...]]) -> list[Any]:
        """One EXISTS per group of keys (keys of one slot, in a cluster): how many exist, or REDIRECTED."""
        out: list[Any] = []
        for start in range(0, len(groups), 4096):
            batch = groups[start : start + 4096]
            self.send([b for g in batch for b in frame(b"EXISTS", *(k.encode() for k in g))])
            out += self.line_replies(len(batch))
        self._done()
        return out

    def get(self, keys: Sequence[str], digests: Sequence[str | None], batch_bytes: int, where: str) -> list[Any]:
        """GET of each key: the value (checked against its digest unless None), None if absent, or REDIRECTED.
        Batches hold about `batch_bytes` of values (sized by the values read so far); the GETs of the next
        batch go out before the replies of this one are read, so the server never waits for the client."""
        out: list[Any] = []
        seen = [0, 0]  # values read, their bytes

        def batch_end(start: int) -> int:
            avg = seen[1] // seen[0] if seen[0] else batch_bytes // 8
            return min(len(keys), start + max(1, batch_bytes // max(1, avg)))

        for i in self._pipelined_gets(keys, batch_end):
            value = self.reply()
            if isinstance(value, bytes):
                seen[0] += 1
                seen[1] += len(value)
                d = digests[i]
                if d is not None:
                    check_digests([(d, value)], where=where)
            out.append(value)
        return out

    def _pipelined_gets(self, keys: Sequence[str], batch_end: Callable[[int], int]) -> Iterator[int]:
        """Send the GETs of keys[start:batch_end(start)] batch by batch, the next batch's before this one's replies
        are read; yields each key's index when its reply is the next on the wire (the caller reads it)."""
        start = 0
        stop = batch_end(0) if keys else 0
        if stop:
            self.send([b for i in range(0, stop) for b in frame(b"GET", keys[i].encode())])
        while start < stop:
            ahead = batch_end(stop) if stop < len(keys) else stop
            if ahead > stop:
                self.send([b for i in range(stop, ahead) for b in frame(b"GET", keys[i].encode())])
            yield from range(start, stop)
            start, stop = stop, ahead

    def get_into(
        self, keys: Sequence[str], targets: Sequence[Sequence[memoryview]], digests: Sequence[str], batch_bytes: int,
        where: str,
    ) -> list[Any]:
        """GET of each key received straight into its buffers ``targets[i]`` (back to back) and checked there
        against ``digests[i]`` while the bytes are in the CPU's cache: no bytes object in between. Per key: True
        (written, verified), False (the value's size is not the buffers' total: read and dropped, nothing
        written), None (absent), or REDIRECTED. Pipelined as `get`."""
        sizes = [sum(len(b) for b in bufs) for bufs in targets]
        out: list[Any] = []

        def batch_end(start: int) -> int:
            stop, size = start, 0
            while stop < len(keys) and (stop == start or size + sizes[stop] <= batch_bytes):
                size += sizes[stop]
                stop += 1
            return stop

        for i in self._pipelined_gets(keys, batch_end):
            h = self.header()
            if h[:1] != b"$" or (n := int(h[1:])) < 0:
                out.append(parse_line(h))
                continue
            if n != sizes[i]:
                self._exact(n + 2)
                out.append(False)
                continue
            sha = hashlib.sha256()
            for buf in targets[i]:
                self._exact_into(buf)
                sha.update(buf)
            self._exact(2)
            if sha.hexdigest() != digests[i]:
                raise IntegrityError(
                    f"{where}: blob {digests[i]} has sha256 {sha.hexdigest()} ({n} bytes); corrupt or truncated"
                )
            out.append(True)
        return out

    def _exact_into(self, buf: memoryview) -> None:
        view = memoryview(buf).cast("B")
        while view:
            n = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
            if not n:
                raise ConnectionError("the server closed the connection")
            view = view[n:]


def parse_line(h: bytes) -> str | int | None:
    """A one-line reply without its CRLF: status text, an integer, None (nil), or REDIRECTED; ReplyError for
    another error or a bulk string that is not nil."""
    kind = h[:1]
    if kind == b"+":
        return h[1:].decode()
    if kind == b":":
        return int(h[1:])
    if h in (b"$-1", b"_"):  # RESP2 / RESP3 nil
        return None
    if kind == b"-":
        if h.startswith((b"-MOVED ", b"-ASK ")):
            return REDIRECTED
        raise ReplyError(h[1:].decode(errors="replace"))
    raise ReplyError(f"unexpected reply {h[:64]!r}")


def check_digests(items: Sequence[tuple[str, bytes | memoryview]], *, where: str) -> None:
    """IntegrityError for the first item whose sha256 is not its digest (as `base.verify_blob` words it)."""
    for d, data in items:
        actual = hashlib.sha256(data).hexdigest()
        if actual != d:
            raise IntegrityError(f"{where}: blob {d} has sha256 {actual} ({len(data)} bytes); corrupt or truncated")


class Lanes:
    """A pool of lanes per server address ("host:port"), shared by the threads of one store."""

    def __init__(self, connection_kwargs: dict[str, Any], timeout_s: float) -> None:
        self.kwargs = connection_kwargs
        self.timeout_s = timeout_s
        self._free: dict[str, list[Lane]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def for_client(cls, connection_class: object, kwargs: dict[str, Any], timeout_s: float) -> Lanes | None:
        """Lanes for a client whose connections are plain TCP (`redis.asyncio.connection.Connection` exactly),
        else None: TLS and unix sockets stay on redis-py's pipelines."""
        if connection_class is not AsyncConnection:
            return None
        if kwargs.get("credential_provider") is not None:
            return None
        keep = ("db", "username", "password", "protocol", "client_name")
        return cls({k: kwargs[k] for k in keep if kwargs.get(k) is not None}, timeout_s)

    def take(self, host: str, port: int, *, fresh: bool = False) -> tuple[Lane, bool]:
        """A lane to `host:port`, and whether it was idle in the pool (its server may have closed it since)."""
        with self._lock:
            free = self._free.get(f"{host}:{port}")
            if free and not fresh:
                return free.pop(), True
        conn = SyncConnection(
            host=host, port=port, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, **self.kwargs
        )
        return Lane(conn, self.timeout_s), False

    def give(self, host: str, port: int, lane: Lane) -> None:
        with self._lock:
            if not self._closed:
                self._free.setdefault(f"{host}:{port}", []).append(lane)
                return
        lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = [lane for free in self._free.values() for lane in free]
            self._free.clear()
        for lane in lanes:
            lane.close()
