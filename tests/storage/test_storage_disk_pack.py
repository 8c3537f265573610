"""Pack files of the disk store: round trip, dedup, corruption anywhere in a pack, faults and crashes at every
write step, garbage collection (tombstones, compaction, a reader racing a compaction), and an engine session
saved into a pack that resumes bit-identically in a new process."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_helpers import pack_files, synthetic_blobs

import kda_sessions as ks
from kda_sessions.storage import SnapshotStore, faults
from kda_sessions.storage.backends import disk as disk_mod
from kda_sessions.storage.backends.disk import TMP_PREFIX, DiskStore
from kda_sessions.storage.backends.disk_pack_format import ENTRY_BYTES, HEADER_BYTES, TRAILER_BYTES
from kda_sessions.storage.blobs import digest
from kda_sessions.storage.errors import BlobNotFound, IntegrityError, StoreUnavailable


def _blobs(n: int, size: int = 3000, seed: int = 0) -> dict[str, bytes]:
    return synthetic_blobs(n, size, seed)


_packs = pack_files


def _loose(root: Path) -> list[Path]:
    return [p for p in (root / "blobs").glob("??/*") if p.is_file()]


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TMP_PREFIX)]


async def test_batch_at_the_threshold_is_one_pack(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    few, many = _blobs(3, seed=1), _blobs(6, seed=2)
    assert await store.put_blobs(few) == set(few)
    assert len(_loose(tmp_path)) == 3 and _packs(tmp_path) == []
    assert await store.put_blobs(many) == set(many)
    assert len(_packs(tmp_path)) == 1 and len(_loose(tmp_path)) == 3
    assert await store.put_blobs({**few, **many}) == set()  # dedup across loose and packed
    assert await store.get_blobs([*many, *few]) == {**many, **few}
    assert set(await store.list_blobs()) == set(few) | set(many)
    assert await store.has_blobs([*many, digest(b"absent")]) == set(many)
    stats = await store.stats()
    assert stats.num_blobs == 9 and stats.blob_bytes >= 9 * 3000
    fresh = await DiskStore.open(tmp_path)  # another process sees the same
    assert await fresh.get_blob(next(iter(many))) == next(iter(many.values()))
    assert _temp_files(tmp_path) == []


async def test_wrong_digest_writes_nothing(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(4)
    d = next(iter(blobs))
    blobs[d] = b"other bytes"
    with pytest.raises(IntegrityError):
        await store.put_blobs(blobs)
    assert _packs(tmp_path) == [] and _temp_files(tmp_path) == []


MUTATIONS: dict[str, Callable[[bytearray, int], None]] = {
    "flip-bit": lambda b, at: b.__setitem__(at, b[at] ^ 0x10),
    "truncate": lambda b, at: b.__delitem__(slice(at, None)),
    "zero-page": lambda b, at: b.__setitem__(slice(at, at + 4096), bytes(len(b[at : at + 4096]))),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("where", ["header", "data", "index", "trailer"])
async def test_corruption_anywhere_in_a_pack_is_an_integrity_error(tmp_path: Path, where: str, mutation: str) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(8, size=9000)
    await store.put_blobs(blobs)
    (pack,) = _packs(tmp_path)
    raw = bytearray(pack.read_bytes())
    index = len(raw) - TRAILER_BYTES - ENTRY_BYTES * 8  # data [HEADER_BYTES, index), then index, then trailer
    at = {"header": 0 if mutation == "zero-page" else 4, "data": HEADER_BYTES + 9000 + 17,
          "index": index + ENTRY_BYTES * 3 + 5, "trailer": len(raw) - TRAILER_BYTES + (0 if mutation == "zero-page" else 9)}[where]
    MUTATIONS[mutation](raw, at)
    pack.write_bytes(bytes(raw))
    reader = await DiskStore.open(tmp_path)
    with pytest.raises(IntegrityError):
        await reader.get_blobs(list(blobs))
    if where != "data":  # an unusable index: its blobs count as absent, so the next save writes them again
        assert await reader.has_blobs(blobs) == set()
        await reader.put_blobs(blobs)
        assert await reader.get_blobs(list(blobs)) == blobs


async def test_forged_count_is_refused_before_allocating(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    await store.put_blobs(_blobs(3))
    (pack,) = _packs(tmp_path)
    raw = bytearray(pack.read_bytes())
    struct.pack_into("<I", raw, len(raw) - TRAILER_BYTES, 2**32 - 1)  # the trailer's count
    pack.write_bytes(bytes(raw))
    reader = await DiskStore.open(tmp_path)
    with pytest.raises(IntegrityError, match="corrupt"):
        await reader.get_blob(next(iter(_blobs(3))))
    assert [why for why in reader._packs.corrupt.values() if "4294967295 blobs" in why]


@pytest.mark.parametrize(
    "call, code", [("write", errno.ENOSPC), ("fsync", errno.EIO)], ids=["enospc-write", "eio-fsync"]
)
async def test_io_error_abandons_the_pack_and_keeps_what_was_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int
) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    old = _blobs(3, seed=5)
    await store.put_blobs(old)
    real = getattr(os, call)
    calls: Counter[str] = Counter()

    def failing(fd: int, *args: object) -> object:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if TMP_PREFIX in path and "/packs/" in path:
            calls[path] += 1
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    monkeypatch.setattr(disk_mod.os, call, failing)
    with pytest.raises(StoreUnavailable, match=errno.errorcode[code]):
        await store.put_blobs(_blobs(5, seed=6))
    monkeypatch.undo()
    assert calls and set(calls.values()) == {1}  # tried once, then the temp file was abandoned
    assert _temp_files(tmp_path) == [] and len(_packs(tmp_path)) == 1
    assert set(await store.list_blobs()) == set(old)
    assert await store.get_blobs(list(old)) == old


@pytest.mark.parametrize("point", ["disk.blob.written", "disk.blob.fsynced", "disk.blob.linked", "disk.blob.done"])
async def test_crash_at_each_step_leaves_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(6)

    def crash(name: str) -> None:
        if name == point:
            raise OSError(errno.EIO, "simulated crash")

    monkeypatch.setattr(faults, "hook", crash)
    with pytest.raises(StoreUnavailable):
        await store.put_blobs(blobs)
    monkeypatch.setattr(faults, "hook", None)
    # a real crash leaves the temp file behind; what open() finds must be none of the blobs or all of them
    after = await DiskStore.open(tmp_path)
    held = await after.has_blobs(blobs)
    assert held in (set(), set(blobs))
    assert held == set(blobs) or point in ("disk.blob.written", "disk.blob.fsynced")
    if held:
        assert await after.get_blobs(list(blobs)) == blobs
    assert _temp_files(tmp_path) == []


async def test_delete_tombstones_then_compacts_then_drops(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(8)
    keys = list(blobs)
    await store.put_blobs(blobs)
    (first,) = _packs(tmp_path)
    assert await store.delete_blob(keys[0]) is True
    assert await store.delete_blob(keys[0]) is False
    assert keys[0] not in await store.list_blobs() and await store.has_blobs([keys[0]]) == set()
    with pytest.raises(BlobNotFound):
        await store.get_blob(keys[0])
    assert _packs(tmp_path) == [first]  # only a tombstone so far
    other = await DiskStore.open(tmp_path)  # a second process with the old index cached
    assert await other.get_blob(keys[7]) == blobs[keys[7]]
    for d in keys[1:6]:
        await store.delete_blob(d)  # 6 of 8 dead: compacted into a new pack
    (second,) = _packs(tmp_path)
    assert second != first
    assert await store.get_blobs(keys[6:]) == {d: blobs[d] for d in keys[6:]}
    assert await other.get_blobs(keys[6:]) == {d: blobs[d] for d in keys[6:]}  # re-scans after the move
    await store.put_blobs({keys[0]: blobs[keys[0]]})  # a deleted blob can be stored again
    assert await store.get_blob(keys[0]) == blobs[keys[0]]
    for d in keys:
        await store.delete_blob(d)
    assert _packs(tmp_path) == [] and await store.list_blobs() == []


async def test_crash_inside_compaction_leaves_a_redundant_pack_that_open_removes(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    blobs = _blobs(4)
    await store.put_blobs(blobs)
    (pack,) = _packs(tmp_path)
    copy = pack.read_bytes()
    await store.delete_blob(next(iter(blobs)))
    dead = pack.with_suffix(".dead")
    tombstones = dead.read_bytes()
    store._packs._compact(store._packs.packs[pack.stem], TMP_PREFIX)
    pack.write_bytes(copy)  # as if the crash came before the old pack was unlinked
    dead.write_bytes(tombstones)
    assert len(_packs(tmp_path)) == 2
    reopened = await DiskStore.open(tmp_path)
    assert len(_packs(tmp_path)) == 1
    assert set(await reopened.list_blobs()) == set(list(blobs)[1:])


async def test_gc_spares_packed_blobs_of_live_and_in_flight_saves(tmp_path: Path) -> None:
    from storage_helpers import make_snapshot

    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    snaps = SnapshotStore(store, gc_grace_s=0)
    ma, ba = make_snapshot("a", 40)
    mb, bb = make_snapshot("b", 40, tokens=list(range(500, 540)))
    await snaps.save(ma, ba)
    await snaps.save(mb, bb)
    with snaps._pin(ba):  # as if a save of these blobs were in flight
        await snaps.delete_session("a")
        assert set(ba) <= set(await store.list_blobs())
    await snaps.delete_session("a")
    assert set(await store.list_blobs()) == set(bb)
    assert (await snaps.load_manifest("b")).blob_digests() == set(bb)
    assert await snaps.load_blobs(bb) == bb
    snaps2 = SnapshotStore(store, gc_grace_s=600)
    await snaps2.save(ma, ba)
    await snaps2.delete_session("a")  # within the grace period of the pack: nothing removed
    assert set(ba) <= set(await store.list_blobs())


async def test_engine_session_in_a_pack_resumes_bit_identically_in_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_mod, "PACK_MIN_BLOBS", 2)
    prompt = list(range(40, 240))
    async with await ks.Engine.open(store="memory:", page_size=16) as ref:
        s = await ref.create_session()
        await s.append(prompt)
        first = await s.generate(max_tokens=6, ignore_eos=True)
        want = await s.generate(max_tokens=6, ignore_eos=True)
    url = f"disk:{tmp_path / 'store'}"
    async with await ks.Engine.open(store=url, page_size=16) as eng:
        s = await eng.create_session()
        await s.append(prompt)
        assert (await s.generate(max_tokens=6, ignore_eos=True)).token_ids == first.token_ids
        await s.save()
        sid = s.id
    assert len(_packs(tmp_path / "store")) == 1 and _loose(tmp_path / "store") == []
    code = (
        "import json, anyio, kda_sessions as ks\n"
        "async def main():\n"
        f"    async with await ks.Engine.open(model='tiny-random', store={url!r}, page_size=16) as e:\n"
        f"        r = await (await e.resume({sid!r})).generate(max_tokens=6, ignore_eos=True)\n"
        "        print(json.dumps(r.token_ids))\n"
        "anyio.run(main)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want.token_ids
