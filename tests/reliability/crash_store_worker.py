"""Zygote for the fast crash campaign: SIGKILLs at the storage level, hundreds per test run.

    python crash_store_worker.py    # reads one JSON job per stdin line; prints "pid N", then "exit N STATUS"

Same protocol as crash_worker.py, but a worker runs no model: it saves synthetic sessions through
`SnapshotStore` (the engine's exact save path: blobs, then the manifest by compare-and-set under the lease), so a
worker starts in milliseconds and a kill costs ~0.1 s instead of ~2 s. What a session holds at generation g is a
pure function of (session, g) (`expected`), so a resume is checked completely by comparing digests: every blob
the manifest names loads (verified against its hash) and is the one generation g must have.

A job is {"store": url, "log": path, "sessions": n, "fault": [point, nth] | null, "verify_only": bool,
"gc_every": k, "pack_min_blobs": m | null}. The worker opens the store (which must remove temp files of killed writers: it logs how many
are left), takes each session's lease (waiting out a dead writer's), loads and checks every session (events
`resumed`, `missing`, `error`), logs `ready`, then saves generation g+1 of each session in turn forever,
logging `ack` after each, and runs a garbage collection (grace 0) every `gc_every` saves.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import zygote  # a sibling: this file runs as a script

from kda_sessions.storage import CheckpointRecord, ModelFingerprint, SessionManifest, SnapshotStore
from kda_sessions.storage.blobs import digest, encode_tensor, encode_tensors
from kda_sessions.storage.errors import (
    ManifestNotFound,
    SessionBusy,
    SnapshotConflict,
    StoreError,
    StoreUnavailable,
)

PAGE = 4  # tokens per page
WINDOW = 6  # pages a manifest names at most: older pages become garbage
FINGERPRINT = ModelFingerprint(model_id="crash", config_hash="c", dtype="float32", page_size=PAGE)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def _state(sid: str, gen: int) -> bytes:
    g = torch.Generator().manual_seed(_seed(sid, gen))
    return encode_tensors({"kda.0": torch.rand(16, 64, generator=g), "conv.0": torch.rand(3, 32, generator=g)})


def _page(i: int) -> bytes:
    """Full page i: the same in every session and generation (shared, deduplicated blobs)."""
    return encode_tensor(torch.full((PAGE, 256), float(i)))


def expected(sid: str, gen: int) -> tuple[SessionManifest, dict[str, bytes]]:
    """Generation `gen` of session `sid`: 3 tokens per generation, a head state unique to (sid, gen), a
    sliding window of full pages shared by all sessions, and a checkpoint naming generation gen-1's state."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = digest(data)
        blobs[d] = data
        return d

    n = 3 * gen
    tokens = add(encode_tensor(torch.tensor([(_seed(sid) + 7 * i) % 250 for i in range(n)], dtype=torch.int32)))
    first = max(0, n // PAGE - WINDOW)
    state_pos = n // PAGE * PAGE  # whole pages only: the window's pages are all full
    pages = [add(_page(i)) for i in range(first, n // PAGE)]
    head = CheckpointRecord(name="head", position=n, state_position=state_pos - first * PAGE, state_blob=add(_state(sid, gen)),
                            pages=pages, created_at=0.0)
    checkpoints = []
    if gen > 1:
        checkpoints.append(CheckpointRecord(name="prev", position=n - 3, state_position=0,
                                            state_blob=add(_state(sid, gen - 1)), pages=[], created_at=0.0))
    m = SessionManifest(session_id=sid, fingerprint=FINGERPRINT, tokens_blob=tokens, num_tokens=n, head=head,
                        checkpoints=checkpoints, generation=gen, saved_at=0.0, meta={"gen": gen})
    return m, blobs


async def _with_retry(fn: Any) -> Any:
    """Call fn(), retrying while a killed writer's lease has not expired (or the store is briefly down)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await fn()
        except (SessionBusy, StoreUnavailable) as e:
            if isinstance(e, SnapshotConflict) or time.monotonic() > deadline:
                raise
            await anyio.sleep(0.01)


async def _check(snaps: SnapshotStore, sid: str) -> tuple[int, str | None]:
    """(stored generation, None if it is exactly what that generation must be, else what differs)."""
    m = await snaps.load_manifest(sid, FINGERPRINT)
    data = await snaps.load_blobs(m.blob_digests())  # each verified against its digest
    want, want_blobs = expected(sid, m.generation)
    if m.model_dump(exclude={"checksum"}) != want.model_dump(exclude={"checksum"}):
        return m.generation, "manifest differs from the one its generation must have"
    if set(data) != set(want_blobs):
        return m.generation, "blob set differs"
    return m.generation, None


def _temp_files(store: str) -> int:
    if not store.startswith("disk:"):
        return 0
    return sum(1 for _ in Path(store[5:]).rglob(".tmp-*"))


async def _work(job: dict[str, Any], fd: int) -> None:
    snaps = await SnapshotStore.open(job["store"], gc_grace_s=0.0)
    if job.get("pack_min_blobs") and hasattr(snaps.store, "pack_min_blobs"):
        snaps.store.pack_min_blobs = job["pack_min_blobs"]  # disk: most saves then write one pack file
    zygote.log(fd, ev="temps", n=_temp_files(job["store"]))
    gens: dict[str, int] = {}
    for i in range(job["sessions"]):
        sid = f"sess{i}"
        await _with_retry(lambda sid=sid: snaps.acquire_lease(sid))
        try:
            gen, problem = await _check(snaps, sid)
        except ManifestNotFound:
            zygote.log(fd, ev="missing", sid=sid)
            gens[sid] = 0
            continue
        except StoreError as e:  # IntegrityError included: a corrupt load
            zygote.log(fd, ev="error", sid=sid, type=type(e).__name__, msg=str(e)[:300])
            return
        if problem is not None:
            zygote.log(fd, ev="error", sid=sid, type="WrongContent", msg=f"generation {gen}: {problem}")
            return
        zygote.log(fd, ev="resumed", sid=sid, gen=gen)
        gens[sid] = gen
    zygote.log(fd, ev="ready")
    if job.get("verify_only"):
        return
    saves = 0
    while True:
        for sid, gen in gens.items():
            m, blobs = expected(sid, gen + 1)
            result = await _with_retry(lambda m=m, blobs=blobs, gen=gen: snaps.save(m, blobs, expected_generation=gen))
            gens[sid] = result.generation
            zygote.log(fd, ev="ack", sid=sid, gen=result.generation)
            saves += 1
            if job.get("gc_every") and saves % job["gc_every"] == 0:
                await snaps.collect_garbage()


def main() -> None:
    torch.set_num_threads(1)
    expected("warm", 3)  # import and initialise lazily loaded parts once, in the zygote
    zygote.serve(_work)


if __name__ == "__main__":
    main()
