"""Pack format versions: packs of version 1 (index before the data) written by earlier releases still load, are
checked and compact into version 2 (index last); a version 2 pack is written from its first blob on whatever the
final count, and a stream that puts fewer blobs than it announced writes one pack of those (none if none). A pack
of a newer version than this release writes is IncompatibleSnapshot naming the version, never corrupt, and is left
alone: never dropped, compacted or stripped of its tombstones."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from storage_helpers import pack_files, synthetic_blobs

from kda_sessions.storage import BlobStream
from kda_sessions.storage.backends import disk_pack_format as fmt
from kda_sessions.storage.backends.disk import TMP_PREFIX, DiskStore
from kda_sessions.storage.errors import IncompatibleSnapshot, IntegrityError


def _v1_pack(blobs: dict[str, bytes]) -> bytes:
    """A pack as version 1 lays it out: b"KDAP" | 1 | 3 zero bytes | count u32 | sha256 of the index, then the
    index (sha256, offset u64, length u64 per blob), then the data."""
    start = 44 + 48 * len(blobs)
    entries = bytearray()
    for d, data in blobs.items():
        entries += struct.pack("<32sQQ", bytes.fromhex(d), start, len(data))
        start += len(data)
    header = struct.pack("<4sB3xI32s", b"KDAP", 1, len(blobs), hashlib.sha256(entries).digest())
    return header + bytes(entries) + b"".join(blobs.values())


def _v1_store(root: Path, blobs: dict[str, bytes]) -> Path:
    folder = root / "blobs" / "packs"
    folder.mkdir(parents=True)
    path = folder / "pack-1-00.pack"
    path.write_bytes(_v1_pack(blobs))
    return path


async def test_a_version_1_pack_still_loads(tmp_path: Path) -> None:
    blobs = synthetic_blobs(6, 3000, seed=11)
    _v1_store(tmp_path, blobs)
    store = await DiskStore.open(tmp_path)
    assert await store.has_blobs(blobs) == set(blobs)
    assert await store.get_blobs(list(blobs)) == blobs
    into = {d: memoryview(bytearray(len(data))) for d, data in blobs.items()}
    assert await store.get_blobs_into([(d, [v]) for d, v in into.items()]) == []
    assert all(bytes(into[d]) == data for d, data in blobs.items())


@pytest.mark.parametrize("at", [4, 9, 44 + 48 * 2 + 3, -17], ids=["version", "count", "index", "data"])
async def test_a_corrupt_version_1_pack_is_an_integrity_error(tmp_path: Path, at: int) -> None:
    blobs = synthetic_blobs(4, 3000, seed=12)
    path = _v1_store(tmp_path, blobs)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        await (await DiskStore.open(tmp_path)).get_blobs(list(blobs))


async def test_a_version_1_pack_compacts_into_version_2(tmp_path: Path) -> None:
    blobs = synthetic_blobs(8, 3000, seed=13)
    old = _v1_store(tmp_path, blobs)
    store = await DiskStore.open(tmp_path)
    keys = list(blobs)
    for d in keys[:6]:  # 6 of 8 dead: compacted
        await store.delete_blob(d)
    (new,) = pack_files(tmp_path)
    assert new != old and new.read_bytes()[:5] == b"KDAP\x02"
    assert await (await DiskStore.open(tmp_path)).get_blobs(keys[6:]) == {d: blobs[d] for d in keys[6:]}


def test_version_2_data_starts_after_the_header_and_the_index_ends_the_file() -> None:
    blobs = synthetic_blobs(3, 100, seed=14)
    data = fmt.encode_header() + b"".join(blobs.values())
    pack = data + fmt.encode_index([(d, len(b)) for d, b in blobs.items()])
    entries = fmt.parse_index(lambda off, n: pack[off : off + n], len(pack), "p")
    assert [pack[o : o + n] for o, n in entries.values()] == list(blobs.values())
    assert len(pack) == len(data) + fmt.ENTRY_BYTES * 3 + fmt.TRAILER_BYTES
    with pytest.raises(IntegrityError, match="truncated"):
        fmt.parse_index(lambda off, n: pack[off : off + n], len(pack) - 1, "p")


async def test_a_stream_puts_fewer_blobs_than_announced_into_one_pack(tmp_path: Path) -> None:
    """A save announces pages + small blobs, then drops small blobs the store holds: the pack holds the rest, and
    its first chunk is in the file before the producer knows how many follow."""
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    blobs = synthetic_blobs(12, 5000, seed=15)
    items = list(blobs.items())
    stream = BlobStream(20)
    sizes: list[int] = []

    def produce() -> None:
        stream.put(items[:8])
        for _ in range(500):  # the writer has the first chunk in its temp file while the count is still open
            sizes[:] = [p.stat().st_size for p in tmp_path.rglob(f"{TMP_PREFIX}*")]
            if sizes and max(sizes) >= 8 * 5000:
                break
            time.sleep(0.01)
        stream.put(items[8:])
        stream.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, produce)
        assert await store.put_blob_stream(stream) == set(blobs)
    assert sizes and max(sizes) >= 8 * 5000
    assert len(pack_files(tmp_path)) == 1
    assert await (await DiskStore.open(tmp_path)).get_blobs(list(blobs)) == blobs


async def test_a_stream_that_puts_nothing_writes_no_pack(tmp_path: Path) -> None:
    store = await DiskStore.open(tmp_path, pack_min_blobs=4)
    stream = BlobStream(10)
    stream.close()
    assert await store.put_blob_stream(stream) == set()
    assert pack_files(tmp_path) == [] and list(tmp_path.rglob(f"{TMP_PREFIX}*")) == []


def _v2_pack(blobs: dict[str, bytes]) -> bytes:
    return fmt.encode_header() + b"".join(blobs.values()) + fmt.encode_index([(d, len(b)) for d, b in blobs.items()])


@pytest.mark.parametrize("version", [1, 2])
def test_every_truncation_and_every_zeroed_tail_is_an_integrity_error(version: int) -> None:
    """A pack cut at any byte, or whose last bytes read as zeros (a file whose size reached the disk before its
    last blocks did: a torn index or trailer), never parses: the checks refuse it before any blob is read."""
    blobs = synthetic_blobs(3, 40, seed=16)
    pack = (_v1_pack if version == 1 else _v2_pack)(blobs)
    assert len(fmt.parse_index(lambda off, n: pack[off : off + n], len(pack), "p")) == 3
    tail = 48 * 3 + (44 if version == 1 else fmt.TRAILER_BYTES)  # the index and its checksum, header or trailer
    damaged = [pack[:cut] for cut in range(len(pack))]
    damaged += [pack[: len(pack) - k] + bytes(k) for k in range(1, tail + 1)] if version == 2 else []
    for raw in damaged:
        with pytest.raises(IntegrityError):
            fmt.parse_index(lambda off, n, raw=raw: raw[off : off + n], len(raw), "p")


@pytest.mark.parametrize("point", ["disk.blob.written", "disk.blob.fsynced", "disk.blob.linked", "disk.blob.done"])
async def test_a_version_1_compaction_interrupted_at_each_step_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The delete that makes a version 1 pack three quarters dead fails at each step of writing its version 2
    replacement: a new process reads every live blob, none of the deleted ones, and ends with one pack; the next
    delete finishes the move into version 2 when it had not happened."""
    from kda_sessions.storage import faults
    from kda_sessions.storage.errors import StoreUnavailable

    blobs = synthetic_blobs(8, 3000, seed=17)
    keys = list(blobs)
    old = _v1_store(tmp_path, blobs)
    store = await DiskStore.open(tmp_path)
    for d in keys[:5]:
        await store.delete_blob(d)

    def crash(name: str) -> None:
        if name == point:
            raise OSError(5, "simulated crash")

    monkeypatch.setattr(faults, "hook", crash)
    with pytest.raises(StoreUnavailable):
        await store.delete_blob(keys[5])  # 6 of 8 dead: compacts
    monkeypatch.setattr(faults, "hook", None)
    after = await DiskStore.open(tmp_path)
    assert await after.get_blobs(keys[6:]) == {d: blobs[d] for d in keys[6:]}
    assert set(await after.list_blobs()) == set(keys[6:]) and await after.has_blobs(keys[:6]) == set()
    (pack,) = pack_files(tmp_path)
    moved = point in ("disk.blob.linked", "disk.blob.done")
    assert (pack != old) == moved and pack.read_bytes()[4] == (2 if moved else 1)
    assert [p.name for p in pack.parent.glob("*.dead")] == ([] if moved else [f"{old.stem}.dead"])
    await after.delete_blob(keys[6])
    (pack,) = pack_files(tmp_path)
    assert pack.read_bytes()[4] == 2
    assert await (await DiskStore.open(tmp_path)).get_blobs([keys[7]]) == {keys[7]: blobs[keys[7]]}


def _newer(version: int = fmt.PACK_VERSION + 1, body: bytes = b"a layout this release does not know") -> bytes:
    """A pack of a later version: the framing every version keeps (magic first and last, the version byte at
    offset 4) around bytes this release cannot parse."""
    return b"KDAP" + bytes([version, 0, 0, 0]) + body + b"KDAP"


def _v2_pack(blobs: dict[str, bytes]) -> bytes:
    return fmt.encode_header() + b"".join(blobs.values()) + fmt.encode_index([(d, len(b)) for d, b in blobs.items()])


@pytest.mark.parametrize("version", [fmt.PACK_VERSION + 1, 255])
def test_a_newer_version_is_incompatible_and_names_it(version: int) -> None:
    pack = _newer(version)
    with pytest.raises(IncompatibleSnapshot, match=f"pack format version {version}, newer than this release") as e:
        fmt.parse_index(lambda off, n: pack[off : off + n], len(pack), "p")
    assert not isinstance(e.value, IntegrityError)
    cut = pack[:-1]  # its last magic lost: damage, not a newer pack
    with pytest.raises(IntegrityError, match="bad pack header"):
        fmt.parse_index(lambda off, n: cut[off : off + n], len(cut), "p")


@pytest.mark.parametrize("bit", range(8))
def test_a_flipped_version_bit_of_a_version_2_pack_is_an_integrity_error(bit: int) -> None:
    raw = bytearray(_v2_pack(synthetic_blobs(3, 100, seed=15)))
    raw[4] ^= 1 << bit
    with pytest.raises(IntegrityError, match="bad pack header"):
        fmt.parse_index(lambda off, n: bytes(raw[off : off + n]), len(raw), "p")


async def test_a_pack_of_a_newer_release_is_left_alone_and_its_blobs_are_incompatible(tmp_path: Path) -> None:
    """A newer release's pack (with a tombstone file) beside this release's packs: a blob missing here raises
    IncompatibleSnapshot naming the pack's version (it may hold it); opening (drop_redundant), deleting every
    blob this release holds (tombstones, compaction, drop) and reopening never change the newer pack's bytes
    nor remove its tombstones."""
    ours, missing = synthetic_blobs(8, 3000, seed=16), synthetic_blobs(1, 3000, seed=17)
    folder = tmp_path / "blobs" / "packs"
    folder.mkdir(parents=True)
    newer = folder / "pack-0-ff.pack"
    newer.write_bytes(_newer(body=b"".join(missing.values())))
    dead = newer.with_suffix(".dead")
    dead.write_bytes(bytes(32))  # a tombstone written by the newer release
    before = newer.read_bytes(), dead.read_bytes()
    store = await DiskStore.open(tmp_path, pack_min_blobs=2)
    await store.put_blobs(ours)
    with pytest.raises(IncompatibleSnapshot, match=f"pack-0-ff.pack: pack format version {fmt.PACK_VERSION + 1}"):
        await store.get_blobs(list(missing))
    into = [(d, [memoryview(bytearray(len(b)))]) for d, b in missing.items()]
    with pytest.raises(IncompatibleSnapshot):
        await store.get_blobs_into(into)
    assert await store.get_blobs(list(ours)) == ours  # this release's blobs read as ever
    assert await store.has_blobs([*ours, *missing]) == set(ours)
    for d in ours:
        await store.delete_blob(d)
    assert await store.list_blobs() == []
    await DiskStore.open(tmp_path)
    assert pack_files(tmp_path) == [newer] and (newer.read_bytes(), dead.read_bytes()) == before
