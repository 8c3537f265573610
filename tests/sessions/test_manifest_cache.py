"""SnapshotStore reuses the manifest it parsed or wrote when the stored bytes are the same: a manifest lists every page
of every checkpoint, so at long contexts its parse dominated a resume from the RAM tier. What a caller gets is its
own copy; other stored bytes (another writer's save, a flipped bit) are parsed and checked as before."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import kda_sessions as ks
from kda_sessions.storage import SnapshotStore
from kda_sessions.storage import snapshot as snapshot_mod
from kda_sessions.storage.errors import IntegrityError
from kda_sessions.storage.manifest import CheckpointRecord, ModelFingerprint, SessionManifest

FP = ModelFingerprint(model_id="m", config_hash="c", dtype="bfloat16", page_size=4)


def _d(i: int | str) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _manifest(sid: str, pages: int = 12, generation: int = 1) -> SessionManifest:
    ds = [_d(i) for i in range(pages)]
    cps = [CheckpointRecord(name=f"cp{k}", position=4 * k, state_blob=_d("s"), pages=ds[:k], created_at=1.0)
           for k in range(1, pages)]
    return SessionManifest(
        session_id=sid, fingerprint=FP, tokens_blob=_d("t"), num_tokens=4 * pages,
        head=CheckpointRecord(name="head", position=4 * pages, state_blob=_d("s"), pages=ds, created_at=1.0),
        checkpoints=cps, meta={"messages": [{"role": "user", "content": "hi"}]}, generation=generation, saved_at=2.0,
    )


@pytest.fixture
async def snaps(tmp_path: Path):
    s = await SnapshotStore.open(f"disk:{tmp_path / 'store'}", ram_bytes=1 << 20)
    yield s
    await s.close()


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts SessionManifest.loads calls (the parse the cache skips)."""
    calls: list[int] = []
    loads = SessionManifest.loads.__func__  # type: ignore[attr-defined]

    def counted(cls: type[SessionManifest], data: bytes | str) -> SessionManifest:
        calls.append(len(data))
        return loads(cls, data)

    monkeypatch.setattr(SessionManifest, "loads", classmethod(counted))
    return calls


async def test_same_bytes_parse_once_and_each_caller_gets_its_own_copy(snaps: SnapshotStore, parses: list[int]) -> None:
    m = _manifest("a")
    await snaps.store.put_manifest("a", m.dumps())  # as another process would have written it
    first = await snaps.load_manifest("a", FP)
    assert parses == [len(m.dumps())]
    kept = snaps._manifests["a"][1]  # what is kept holds each page digest once: checkpoints share the head's
    assert all(cp.pages[i] is kept.head.pages[i] for cp in kept.checkpoints[1:] for i in range(len(cp.pages) - 1))
    first.meta["messages"].append({"role": "assistant", "content": "changed"})
    first.head.pages.pop()
    first.checkpoints[0].pages.clear()
    second = await snaps.load_manifest("a", FP)
    assert parses == [len(m.dumps())]  # not parsed again
    assert second == m  # the caller's changes reached neither the cache nor the next caller
    assert second.head.pages is not first.head.pages and second.meta is not first.meta


async def test_a_save_is_remembered_as_the_stored_bytes_parse(snaps: SnapshotStore, parses: list[int]) -> None:
    m = _manifest("b", generation=1)
    live_messages = m.meta["messages"]
    blobs = {_d(x): str(x).encode() for x in [*range(12), "s", "t"]}  # each digest names its own bytes
    await snaps.save(m, blobs, expected_generation=0)
    live_messages.append({"role": "user", "content": "after the save"})  # the session goes on
    loaded = await snaps.load_manifest("b", FP)
    assert parses == []  # the save's own manifest, no parse
    raw = await snaps.store.get_manifest("b")
    assert loaded == SessionManifest.loads(raw)  # exactly what parsing the stored bytes gives
    assert loaded.meta["messages"] == [{"role": "user", "content": "hi"}]


async def test_other_bytes_are_parsed_and_checked(snaps: SnapshotStore, parses: list[int]) -> None:
    await snaps.store.put_manifest("c", _manifest("c", generation=1).dumps())
    assert (await snaps.load_manifest("c")).generation == 1
    newer = _manifest("c", pages=13, generation=2)
    await snaps.store.put_manifest("c", newer.dumps())  # another engine saved since
    got = await snaps.load_manifest("c")
    assert got.generation == 2 and got == newer and len(parses) == 2
    data = bytearray(newer.dumps())
    at = data.index(b'"saved_at":2.0') + len(b'"saved_at":')
    data[at] = ord("3")  # a flipped digit the schema accepts: only the checksum sees it
    await snaps.store.put_manifest("c", bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        await snaps.load_manifest("c")


async def test_remembered_bytes_are_bounded(snaps: SnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
    size = len(_manifest("d0").dumps())
    monkeypatch.setattr(snapshot_mod, "MANIFEST_CACHE_BYTES", 2 * size + size // 2)
    for i in range(4):
        await snaps.store.put_manifest(f"d{i}", _manifest(f"d{i}").dumps())
        await snaps.load_manifest(f"d{i}")
    assert list(snaps._manifests) == ["d2", "d3"] and snaps._manifest_bytes == 2 * size
    await snaps.delete_session("d3")
    assert list(snaps._manifests) == ["d2"] and snaps._manifest_bytes == size


async def test_engine_resume_after_save_skips_the_parse_and_keeps_the_chat(tmp_path: Path, parses: list[int]) -> None:
    async with await ks.Engine.open(store=f"disk:{tmp_path / 'e'}", page_size=16) as eng:
        s = await eng.create_session(system="be brief")
        await s.append(list(range(40, 140)))
        await s.save()
        sid, tokens = s.id, list(s.state.tokens)
        assert await eng.default.forget(sid)
        again = await eng.resume(sid)
        assert parses == []  # the manifest this engine committed
        assert list(again.state.tokens) == tokens and again.state.system == "be brief"
