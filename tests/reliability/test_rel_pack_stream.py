"""A save streamed into one pack file (disk store, pack format 2) killed part-way: SIGKILL while its first
blobs are in the temp file and its index is not, or once the pack is in place but no manifest names it. The
session then resumes bit-identically at its last acked save, no temp file is left and nothing dangles. And a save
whose blob builder fails before it announced the stream raises that error instead of waiting forever."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rel_helpers import dangling_references, temp_files

import kda_sessions as ks
from kda_sessions.sessions import store_io
from kda_sessions.storage import BlobStream

ENGINE = {"model": "tiny-random", "page_size": 16, "ram_tier_bytes": 0}
PROMPT, MORE = list(range(40, 240)), list(range(100, 260))

# Saves once (generation 1, one pack), appends, then SIGKILLs itself during the second save's pack: "data" after
# the first blob after the header (no index yet), "linked" once the pack has its name (no manifest yet).
_WORKER = """
import json, os, signal, sys, anyio, kda_sessions as ks
from kda_sessions.storage import faults
from kda_sessions.storage.backends import disk, disk_pack
disk.PACK_MIN_BLOBS = 2
url, where = sys.argv[1], sys.argv[2]

def kill(*_):
    os.kill(os.getpid(), signal.SIGKILL)

async def main():
    async with await ks.Engine.open(store=url, model="tiny-random", page_size=16, ram_tier_bytes=0) as e:
        s = await e.create_session()
        await s.append(list(range(40, 240)))
        await s.save()
        print(json.dumps(s.id), flush=True)
        await s.append(list(range(100, 260)))
        if where == "data":
            real, calls = disk_pack.write_all, []
            def write_all(fd, data):
                real(fd, data)
                calls.append(len(data))
                if len(calls) == 2:  # the header, then one blob
                    kill()
            disk_pack.write_all = write_all
        else:
            faults.hook = lambda name: kill() if name == "disk.blob.linked" else None
        await s.save()
        print("saved", flush=True)

anyio.run(main)
"""


@pytest.mark.parametrize("where", ["data", "linked"])
async def test_a_save_killed_inside_its_pack_resumes_at_the_last_ack(tmp_path: Path, where: str) -> None:
    root = tmp_path / "store"
    url = f"disk:{root}"
    out = subprocess.run([sys.executable, "-c", _WORKER, url, where], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    sid = json.loads(out.stdout.splitlines()[0])
    assert "saved" not in out.stdout
    packs = sorted((root / "blobs" / "packs").glob("pack-*.pack"))
    left = temp_files(root)
    assert (len(packs), len(left)) == ((1, 1) if where == "data" else (2, 0))
    async with await ks.Engine.open(store="memory:", **ENGINE) as ref:
        s = await ref.create_session()
        await s.append(PROMPT)
        want = (await s.generate(max_tokens=6, ignore_eos=True)).token_ids
    async with await ks.Engine.open(store=url, **ENGINE) as eng:
        assert temp_files(root) == []  # the killed writer's half pack is gone
        s = await eng.resume(sid)
        assert s.state.generation == 1
        assert (await s.generate(max_tokens=6, ignore_eos=True)).token_ids == want
        await s.append(MORE)
        await s.save()  # the blobs of the killed save are written (or found) again
    assert await dangling_references(url) == []
    async with await ks.Engine.open(store=url, **ENGINE) as eng:
        s = await eng.resume(sid)
        assert (s.state.generation, s.state.num_tokens) == (2, len(PROMPT) + 6 + len(MORE))


async def test_a_save_whose_builder_fails_before_announcing_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's writer waits for the stream's count in a thread no cancellation reaches: a builder that fails
    before it announced one must fail the stream, or the save never returns."""
    streams: list[BlobStream] = []

    class Watched(BlobStream):
        def __init__(self, count: int | None = None) -> None:
            super().__init__(count)
            streams.append(self)

    def failing(self: store_io.StoreIO, s: object) -> list[int]:
        raise RuntimeError("no pages today")

    monkeypatch.setattr(store_io, "BlobStream", Watched)
    hung = threading.Event()

    def unblock() -> None:  # only a hung save gets here: end it, so the test fails instead of hanging
        hung.set()
        for st in streams:
            st.fail(TimeoutError("the save hung"))

    watchdog = threading.Timer(30, unblock)
    watchdog.start()
    try:
        async with await ks.Engine.open(store=f"disk:{tmp_path / 'store'}", **ENGINE) as eng:
            s = await eng.create_session()
            await s.append(PROMPT)
            await s.save()
            await s.append(MORE)
            real = store_io.StoreIO._pages_to_encode
            monkeypatch.setattr(store_io.StoreIO, "_pages_to_encode", failing)
            with pytest.raises(RuntimeError, match="no pages today"):
                await s.save()
            assert not hung.is_set()
            monkeypatch.setattr(store_io.StoreIO, "_pages_to_encode", real)
            await s.save()
            assert s.state.generation == 2
    finally:
        watchdog.cancel()
    assert len(streams) == 3
