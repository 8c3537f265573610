"""One tenant's snapshot store as the session manager uses it: save and load sessions, pools <-> content-
addressed blobs + a manifest (blobs first, manifest last), and the tenant's prefix index.

Full KV pages never change, so each is encoded and hashed once (digest cached per pool page) and, once the
store holds it, never sent again: forks and equal prefixes share page blobs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import torch

from ..engine.config import EngineConfig
from ..engine.core import EngineCore
from ..engine.pool import on_host
from ..errors import SessionBusy, SessionNotFound
from ..storage import BlobStream, CheckpointRecord, SaveResult, SessionManifest, SnapshotStore
from ..storage.backends.registry import default_disk_root
from ..storage.blobs import HASH_THREADS, digest
from ..storage.errors import IntegrityError, ManifestNotFound
from ..storage.manifest import ModelFingerprint
from ..storage.stream import StreamAbandoned
from .codec import (
    decode_page,
    decode_state,
    decode_tokens,
    encode_page,
    encode_state,
    encode_tokens,
    expected_state_shapes,
    state_layout,
)
from .page_io import PageCodec
from .prefix_index import PrefixHit, PrefixIndex, PrefixKey, prefix_key
from .state import Checkpoint, SessionState

TENANT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def tenant_store_url(url: str, tenant: str) -> str:
    """The store URL of a tenant's namespace: a sub-folder on disk, a key prefix in Redis, its own memory."""
    if not re.match(TENANT_PATTERN, tenant):
        raise ValueError(f"tenant must match {TENANT_PATTERN}, got {tenant!r}")
    scheme, _, rest = url.partition(":")
    if scheme == "disk":
        root = rest or str(default_disk_root())
        return f"disk:{root.rstrip('/')}/tenants/{tenant}"
    if scheme in ("redis", "rediss"):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        query["prefix"] = f"{query.get('prefix', 'kda:')}t.{tenant}:"
        return urlunsplit(parts._replace(query=urlencode(query)))
    return url  # memory: every open is a new, separate store


_Add = Callable[[Callable[[], bytes]], "Future[tuple[str, bytes]]"]
"""How `StoreIO._build` queues a small blob: its encoder, run and hashed on a thread (the Future of both)."""


def _encode_hash(encode: Callable[[], bytes]) -> tuple[str, bytes]:
    data = encode()
    return digest(data), data


def _address(data: bytes | bytearray) -> int:
    """Where the bytes of ``data`` lie (valid while it lives)."""
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


async def open_snapshots(url: str, config: EngineConfig) -> SnapshotStore:
    """The snapshot store at ``url`` with the engine's RAM tier, GC grace and lease lifetime."""
    snapshots = await SnapshotStore.open(url, ram_bytes=config.ram_tier_bytes, gc_grace_s=config.gc_grace_s)
    if config.lease_ttl_s is not None:
        snapshots.lease_ttl_s = config.lease_ttl_s
    return snapshots


class StoreIO:
    def __init__(self, core: EngineCore, fingerprint: ModelFingerprint, snapshots: SnapshotStore) -> None:
        self.core = core
        self.pools = core.pools
        self.fingerprint = fingerprint
        self.snapshots = snapshots
        self.index = PrefixIndex(core.config.page_size)
        """This namespace's prefix index: prefix reuse never crosses tenants."""
        self._codec: PageCodec | None = None

    async def close(self) -> None:
        await self.snapshots.close()

    async def list_stored(self) -> list[str]:
        return await self.snapshots.list_sessions()

    # -- save ------------------------------------------------------------------------------------------------

    @property
    def codec(self) -> PageCodec:
        if self._codec is None:
            self._codec = PageCodec(self.pools.tensors, self.core.model.config, self.core.model.dtype)
        return self._codec

    def _partial_page(self, pages: list[int], state_pos: int, add: _Add) -> Future[tuple[str, bytes]] | None:
        """The blob of the partial last page of ``state_pos`` tokens (through ``add``), or None if it has none."""
        full, rows = divmod(state_pos, self.pools.page_size)
        if not rows:
            return None
        # read on a hashing thread before `_build` returns: the caller's lock holds the page until then
        return add(functools.partial(encode_page, self.pools.tensors, pages[full], rows))

    def _head_state(self, slot: int) -> bytes:
        """The state blob of slot ``slot`` (read from the pools on the calling thread; on CUDA the mutex is held
        only while the slot is copied on the device: ``Pools.read_slot_async``)."""
        with self.pools.mutex:
            state = self.pools.read_slot_async(slot)
        return encode_state(*on_host(state))

    def _page_digests(self, pages: list[int], state_pos: int, partial: str | None) -> list[str]:
        """Digests of the pages covering ``state_pos`` tokens: every full page's is cached once it was encoded."""
        digests = self.pools.pages.digests
        return [digests[p] for p in pages[: state_pos // self.pools.page_size]] + ([partial] if partial else [])

    def _pages_to_encode(self, s: SessionState) -> list[int]:
        """Full pool pages this save names whose blobs were never made (no cached digest), each once."""
        P = self.pools.page_size
        runs = [s.pages[: s.num_cached // P]] if s.resident else []
        runs += [cp.pages[: cp.state_pos // P] for cp in s.checkpoints.values() if cp.page_blobs is None]
        digests = self.pools.pages.digests
        return [p for p in dict.fromkeys(p for run in runs for p in run) if p not in digests]

    def _build(self, s: SessionState, stream: BlobStream) -> SessionManifest:
        """Runs in a worker thread: encode every blob the store may lack into ``stream`` and assemble the
        manifest. The small blobs (states, partial last pages, tokens) are queued first, each read, encoded and
        hashed on a thread of its own (a 42 MB state is one copy without the GIL: `encode_tensors`); the stream's
        bound is announced at once and the full pages go in a chunk at a time as they are made (page_io), so the
        store writes its first page while the states are still being read and hashed, and each chunk while the
        next is copied out and hashed; the small blobs follow, less those the store holds from this session's
        earlier saves. Every read of the session's pages and slot ends before this returns (the hashing threads
        are joined), while the caller's lock still holds them. Every full page's digest is cached in the pool, so
        a later save encodes only new pages."""
        hashing = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="blob-hash")
        made: list[Future[tuple[str, bytes]]] = []

        def add(encode: Callable[[], bytes]) -> Future[tuple[str, bytes]]:  # encoded and hashed on a thread
            made.append(hashing.submit(_encode_hash, encode))
            return made[-1]

        pages = self._pages_to_encode(s)
        chunks = self.codec.encode_chunks(pages)
        digests_made: list[str] = []
        try:
            head_partial: Future[tuple[str, bytes]] | None = None
            if s.resident:
                assert s.slot is not None
                head_state_f = add(functools.partial(self._head_state, s.slot))
                head_partial = self._partial_page(s.pages, s.num_cached, add)
            else:
                assert s.head_blobs is not None, "a session that is not resident was loaded from the store"
            partials: dict[str, Future[tuple[str, bytes]] | None] = {}
            states: dict[str, Future[tuple[str, bytes]]] = {}
            for cp in s.checkpoints.values():
                if cp.state_blob is None:
                    assert cp.state_id is not None
                    # a host state never changes once captured: encoded on a thread as it is
                    states[cp.name] = add(functools.partial(encode_state, *self.pools.host.get(cp.state_id)))
                if cp.page_blobs is None:
                    partials[cp.name] = self._partial_page(cp.pages, cp.state_pos, add)
            tokens_f = add(functools.partial(encode_tokens, s.tokens))
            stream.announce(len(made) + len(pages))  # a bound: the writer starts with the first chunk of pages
            for chunk in chunks:
                stream.put(chunk)
                digests_made.extend(d for d, _ in chunk)
            tokens_blob = tokens_f.result()[0]
            known = s.stored_digests
            blobs = {d: data for d, data in (f.result() for f in made) if d not in known}
            for name, f in states.items():
                s.checkpoints[name].state_blob = f.result()[0]
            if blobs:
                stream.put(list(blobs.items()))
            stream.close()
        except BaseException as e:
            stream.fail(e)
            raise
        finally:
            chunks.close()
            hashing.shutdown(wait=True, cancel_futures=True)
        for page, d in zip(pages, digests_made, strict=True):
            self.pools.pages.digests[page] = d
        if s.resident:
            head_state = head_state_f.result()[0]
            head_pages = self._page_digests(s.pages, s.num_cached, None if head_partial is None else head_partial.result()[0])
        else:
            assert s.head_blobs is not None
            head_state, head_pages = s.head_blobs
        records = []
        for cp in s.checkpoints.values():
            if cp.page_blobs is None:
                partial = partials[cp.name]
                cp.page_blobs = self._page_digests(cp.pages, cp.state_pos, None if partial is None else partial.result()[0])
            assert cp.state_blob is not None
            records.append(CheckpointRecord(
                name=cp.name, position=cp.position, state_position=cp.state_pos, state_blob=cp.state_blob,
                pages=cp.page_blobs, created_at=cp.created_at,
                num_messages=cp.num_messages, turn_open=cp.turn_open,
            ))
        return SessionManifest(
            session_id=s.id,
            fingerprint=self.fingerprint,
            tokens_blob=tokens_blob,
            num_tokens=s.num_tokens,
            head=CheckpointRecord(
                name="head", position=s.num_tokens, state_position=s.num_cached, state_blob=head_state,
                pages=head_pages, created_at=time.time(), num_messages=len(s.messages), turn_open=s.turn_open,
            ),
            checkpoints=records,
            meta={
                "system": s.system, "tools": s.tools, "messages": s.messages, "next_message_index": s.next_message_index,
                # lets a restarted engine index stored prefixes from manifests alone (see prefix_index)
                "prefix_keys": {cp.name: self._key(s, cp).to_json() for cp in s.checkpoints.values() if cp.position > 0},
            },
            parent=s.parent,
            generation=s.generation + 1,
            saved_at=time.time(),
        )

    async def save(self, s: SessionState) -> SaveResult:
        """Make the session's current state durable. Caller holds ``s.lock``. Shielded from cancellation: a save
        cancelled between its commit and its bookkeeping would leave the session naming a generation and blobs
        the store no longer agrees with (its next save a SnapshotConflict, or a manifest naming blobs never
        sent), and an eviction's save runs inside whatever request needed the slot, which its caller may cancel.
        A cancelled caller waits for the save to end (its blobs and one manifest write).

        The blobs are written while they are made (`_build` into a `BlobStream`, `SnapshotStore.put_stream`),
        then the manifest commits: compare-and-set on the generation this engine last loaded or saved, under the
        session's lease: SessionBusy if another engine holds the lease, SnapshotConflict if another engine saved
        it since."""
        with anyio.CancelScope(shield=True):
            return await self._save(s)

    async def _save(self, s: SessionState) -> SaveResult:
        # the head's pages may not change while they are encoded: the caller's lock keeps works off the session
        stream = BlobStream()
        streamed: set[str] = set()
        built: list[SessionManifest] = []
        errors: list[Exception] = []

        async def write() -> None:
            try:
                streamed.update(await self.snapshots.put_stream(stream))
            except Exception as e:  # re-raised below as itself, not wrapped in an ExceptionGroup
                errors.append(e)

        async def build() -> None:
            try:
                built.append(await anyio.to_thread.run_sync(self._build, s, stream))
            except Exception as e:
                stream.fail(e)  # a no-op if `_build` ended the stream; else its writer would wait forever
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            tg.start_soon(build)
        try:
            if errors:  # the cause first: a producer told that the writer gave up says only that
                raise next((e for e in errors if not isinstance(e, StreamAbandoned)), errors[0])
            manifest, given = built[0], stream.blobs()
            # every blob was named by hashing its bytes: no second hash pass in the store
            result = await self.snapshots.save(
                manifest, given, expected_generation=s.generation, verified=True, streamed=streamed
            )
        except BaseException:
            # a state blob named before the build failed may not have reached the stream: forget it too
            named = {cp.state_blob for cp in s.checkpoints.values() if cp.state_blob is not None}
            self._forget_unsaved(s, stream.digests() | (named - s.stored_digests))
            raise
        result = dataclasses.replace(
            result,
            blobs_written=result.blobs_written + len(streamed),
            bytes_written=result.bytes_written + sum(len(given[d]) for d in streamed),
            blobs_reused=result.blobs_reused - len(streamed),
        )
        s.generation = result.generation
        s.stored_digests = manifest.blob_digests()
        s.head_blobs = (manifest.head.state_blob, list(manifest.head.pages))
        unfiled = [cp for cp in s.checkpoints.values() if self.index.key_of(s.id, cp.name, cp.position) is None]
        self.index.add_many(s.tokens, [PrefixHit(s.id, cp.name, cp.position) for cp in unfiled])
        return result

    async def index_stored(self, limit: int = 100_000) -> int:
        """Add every stored checkpoint to the prefix index (at startup), from manifests alone."""
        n = 0
        for sid in (await self.list_stored())[:limit]:
            try:
                m = await self.snapshots.load_manifest(sid, self.fingerprint)
            except Exception:  # another model's or an unreadable manifest is simply not reusable here
                continue
            keys = m.meta.get("prefix_keys") or {}
            for cp in m.checkpoints:
                key = PrefixKey.from_json(keys.get(cp.name)) if isinstance(keys, dict) else None
                if key is not None:
                    self.index.add_key(key, PrefixHit(sid, cp.name, cp.position))
                    n += 1
        return n

    def _key(self, s: SessionState, cp: Checkpoint) -> PrefixKey:
        """The checkpoint's prefix key: from the index when it is filed there (no hashing), else computed."""
        key = self.index.key_of(s.id, cp.name, cp.position)
        return key if key is not None else prefix_key(s.tokens, cp.position, self.pools.page_size)

    def _forget_unsaved(self, s: SessionState, unsaved: set[str]) -> None:
        """After a failed save, drop cached digests of blobs it built: the store may not have them, so the
        next save must encode and send them again (else its manifest would name blobs nobody stored)."""
        for cp in s.checkpoints.values():
            if cp.state_blob in unsaved and cp.state_id is not None:
                cp.state_blob = None
            if cp.page_blobs is not None and unsaved.intersection(cp.page_blobs) and cp.pages:
                cp.page_blobs = None
        with self.pools.mutex:
            digests = self.pools.pages.digests
            for page in [p for p, d in digests.items() if d in unsaved]:
                del digests[page]

    # -- load ------------------------------------------------------------------------------------------------

    async def load_session(self, sid: str) -> SessionState:
        """The session's bookkeeping from its manifest (state not yet in the pools: see ``restore_head``)."""
        # Another engine holding the lease may still be read from (resume, fork); our saves then raise
        # SessionBusy until its lease is released or expires, and compare-and-set keeps them from losing its saves
        # (so the lease is taken while the manifest and tokens are read: a new lease's fsync costs a disk resume
        # 10-20 ms). Errors are re-raised as themselves, the lease's first, not wrapped in an ExceptionGroup.
        errors: list[Exception] = []
        read: list[tuple[SessionManifest, list[int]]] = []

        async def lease() -> None:
            try:
                await self.snapshots.acquire_lease(sid)
            except SessionBusy:
                pass
            except Exception as e:
                errors.insert(0, e)

        async def manifest() -> None:
            try:
                m = await self.snapshots.load_manifest(sid, self.fingerprint)
                data = await self.snapshots.load_blob(m.tokens_blob)
                read.append((m, decode_tokens(data, m.num_tokens, self.core.model.config.vocab_size, f"session {sid!r}")))
            except Exception as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lease)
            tg.start_soon(manifest)
        if errors:
            if isinstance(errors[0], ManifestNotFound):
                await self.snapshots.release_lease(sid)
                raise SessionNotFound(f"no session {sid!r} in this engine or its store") from None
            raise errors[0]
        m, tokens = read[0]
        meta: dict[str, Any] = m.meta
        messages = meta.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(x, dict) for x in messages):
            raise IntegrityError(f"session {sid!r}: manifest meta.messages is not a list of messages")
        s = SessionState(
            id=sid, tokens=tokens, num_cached=m.head.state_pos, system=meta.get("system"),
            tools=meta.get("tools"), messages=messages, turn_open=m.head.turn_open, parent=m.parent,
            generation=m.generation, stored_digests=m.blob_digests(),
            head_blobs=(m.head.state_blob, list(m.head.pages)),
            next_message_index=int(meta.get("next_message_index", len(messages))),
        )
        for r in m.checkpoints:
            s.checkpoints[r.name] = Checkpoint(
                name=r.name, position=r.position, state_pos=r.state_pos, state_blob=r.state_blob,
                page_blobs=list(r.pages), num_messages=r.num_messages, turn_open=r.turn_open, created_at=r.created_at,
            )
        # filed under the keys the manifest stores (as at startup, `index_stored`): no page chain on the resume path
        keys = meta.get("prefix_keys")
        keys = keys if isinstance(keys, dict) else {}
        unfiled = []
        for r in m.checkpoints:
            key = PrefixKey.from_json(keys.get(r.name))
            if key is None:
                unfiled.append(PrefixHit(sid, r.name, r.position))
            else:
                self.index.add_key(key, PrefixHit(sid, r.name, r.position))
        self.index.add_many(s.tokens, unfiled)
        return s

    async def _load_pages(self, digests: list[str], state_pos: int, where: str) -> list[int]:
        """Load page blobs into newly allocated pool pages; returns the page ids. Full pages are read and
        verified by the store straight into the pool (page_io); on CUDA through pinned staging buffers on a side
        stream, synchronized before this returns."""
        pools, codec = self.pools, self.codec
        full, rows = divmod(state_pos, pools.page_size)
        if len(digests) != full + (1 if rows else 0):
            raise IntegrityError(f"{where}: {len(digests)} KV pages stored for {state_pos} tokens of pages of {pools.page_size}")
        with pools.mutex:
            pages = pools.pages.alloc(len(digests))
        stream = torch.cuda.Stream(codec.device) if codec.device.type == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(codec.device))
        try:
            await codec.restore(self.snapshots, pages[:full], digests[:full], where, stream)
            if rows:
                t = decode_page(await self.snapshots.load_blob(digests[full]), codec.cfg, codec.dtype, rows, where)
                await pools.run_locked(lambda: pools.write_rows(pages[full], t))
            if stream is not None:
                await anyio.to_thread.run_sync(stream.synchronize)
        except BaseException:
            if stream is not None:
                stream.synchronize()
            with pools.mutex:
                pools.pages.decref(pages)
            raise
        with pools.mutex:
            for page, d in zip(pages[:full], digests):
                pools.pages.digests[page] = d
            if rows:
                pools.pages.digests.pop(pages[full], None)
        return pages

    async def restore_head(self, s: SessionState) -> None:
        """Put the head state of a session loaded from the store into its slot and fresh pages (the caller made
        sure that enough pages are free). The state (42 MB at Kimi-Linear's shape) is read and copied to the
        device while the pages are: two tasks, the state's error first if both fail."""
        assert s.slot is not None and s.head_blobs is not None
        state_d, page_ds = s.head_blobs
        where = f"session {s.id!r}"
        slot = s.slot
        state_error: list[Exception] = []
        pages_error: list[Exception] = []
        loaded: list[list[int]] = []

        async def state() -> None:
            try:
                await self._restore_state(state_d, slot, where)
            except Exception as e:  # re-raised below as itself, not wrapped in an ExceptionGroup
                state_error.append(e)

        async def pages() -> None:
            try:
                loaded.append(await self._load_pages(page_ds, s.num_cached, where))
            except Exception as e:
                pages_error.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(state)
            tg.start_soon(pages)
        if state_error or pages_error:
            if loaded:
                with self.pools.mutex:
                    self.pools.pages.decref(loaded[0])
            raise (state_error or pages_error)[0]
        s.pages = loaded[0]

    async def _restore_state(self, digest_: str, slot: int, where: str) -> None:
        """The state blob ``digest_`` into state slot ``slot``. On CUDA its payload is copied once into pinned
        memory, sent to the device in one copy on a side stream and spread over the layers there; on the CPU
        it is decoded and written as is."""
        cfg, dtype, device = self.codec.cfg, self.codec.dtype, self.codec.device
        data = await self.snapshots.load_blob(digest_)
        if not isinstance(data, bytes | bytearray):
            data = bytes(data)
        if device.type != "cuda":
            kda, conv = decode_state(data, cfg, dtype, where)
            await self.pools.run_locked(lambda: self.pools.write_slot(slot, kda, conv))
            return
        offset, (ka, kb), (ca, cb) = state_layout(data, cfg, dtype, where)
        want_kda, want_conv = expected_state_shapes(cfg)
        tensors = self.pools.tensors

        def copy() -> None:
            host = torch.empty(len(data) - offset, dtype=torch.uint8, pin_memory=True)
            ctypes.memmove(host.data_ptr(), _address(data) + offset, host.numel())  # releases the GIL
            stream = torch.cuda.Stream(device)
            with self.pools.mutex:  # after the slot's zeroing, queued on the current stream
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    dev = host.to(device, non_blocking=True)
                    kda = dev[ka:kb].view(torch.float32).view(want_kda)
                    conv = dev[ca:cb].view(dtype).view(want_conv)
                    for i, (st, cv) in enumerate(zip(tensors.kda, tensors.conv, strict=True)):
                        st[slot].copy_(kda[i])
                        cv[slot].copy_(conv[i])
            stream.synchronize()

        await anyio.to_thread.run_sync(copy)

    async def materialize(self, cp: Checkpoint) -> None:
        """Make a checkpoint's state (host pool) and pages (KV pool) resident, from the store if needed."""
        where = f"checkpoint {cp.name!r}"
        if cp.state_id is None:
            if cp.state_blob is None:
                raise IntegrityError(f"{where} has neither a state in memory nor a stored state")
            state = decode_state(await self.snapshots.load_blob(cp.state_blob), self.codec.cfg, self.codec.dtype, where)
            with self.pools.mutex:
                cp.state_id = self.pools.host.put(*state)
        if len(cp.pages) < self.core.pages_for(cp.state_pos):
            if cp.page_blobs is None:
                raise IntegrityError(f"{where} has neither pages in memory nor stored pages")
            cp.pages = await self._load_pages(cp.page_blobs, cp.state_pos, where)
