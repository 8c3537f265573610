"""Save, resume in a new process, fork: token ids equal an uninterrupted run (greedy, tiny-random, CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

import kda_sessions as ks

PROMPT = list(range(40, 240))  # 200 byte tokens: spans several KV pages and KDA chunks
N, M = 12, 10

# The module's tests share one event loop, so that they can share the reference engine below.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref() -> AsyncIterator[ks.Engine]:
    """An engine that never saves or restores: what an uninterrupted run generates (each test makes its own
    sessions on it)."""
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        yield eng


@pytest.fixture(params=["disk", "redis"])
def store_url(request, tmp_path) -> str:
    if request.param == "disk":
        return f"disk:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url") + f"?prefix=t{tmp_path.name[-12:]}:"


async def test_resume_in_new_process_is_bit_identical(store_url, other_process, ref):
    s = await ref.create_session()
    await s.append(PROMPT)
    first = await s.generate(max_tokens=N, ignore_eos=True)
    want = await s.generate(max_tokens=M, ignore_eos=True)
    async with await ks.Engine.open(store=store_url, page_size=16) as eng:
        s = await eng.create_session()
        await s.append(PROMPT)
        got_first = await s.generate(max_tokens=N, ignore_eos=True)
        await s.save()
        sid = s.id
    assert got_first.token_ids == first.token_ids
    # page size is part of the snapshot: the child must open with the same one
    out = other_process.generate(store_url, sid, M)
    assert out["tokens"] == want.token_ids
    assert out["usage"]["prefill_tokens"] == 1  # only the pending last token, no re-prefill
    assert out["usage"]["cached_tokens"] == len(PROMPT) + N - 1


CHILD = """
import json, sys, anyio, kda_sessions as ks
async def job(store, sid, n, checkpoint):
    async with await ks.Engine.open(model="tiny-random", store=store, page_size=16) as e:
        s = await (e.fork(sid, checkpoint) if checkpoint else e.resume(sid))
        r = await s.generate(max_tokens=n, ignore_eos=True)
        return {"tokens": r.token_ids, "usage": r.usage.model_dump()}
for line in sys.stdin:
    try:
        out = anyio.run(job, *json.loads(line))
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
"""


class Child:
    """One other Python process (torch imported once) that opens a fresh engine per job: resume or fork a stored
    session there and generate. It never held the sessions it is given, as a restarted process would not."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def generate(self, store: str, sid: str, n: int, checkpoint: str | None = None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([store, sid, n, checkpoint]) + "\n")
        out = json.loads(self.proc.stdout.readline() or '{"error": "the child process died"}')
        assert "error" not in out, out["error"]
        return out

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def other_process() -> Iterator[Child]:
    c = Child()
    yield c
    c.close()


async def test_fork_from_mid_conversation_checkpoint(store_url, other_process, ref):
    async with await ks.Engine.open(store=store_url, page_size=16) as eng:
        p = await eng.create_session()
        await p.append(PROMPT)
        await p.generate(max_tokens=N, ignore_eos=True)
        await p.checkpoint("mid")
        prefix = list(p.state.tokens)
        await p.append(list(range(60, 90)))
        await p.save()
        # the child, in this process and in a new one
        child = await eng.fork(p.id, "mid")
        child_tokens = (await child.generate(max_tokens=M, ignore_eos=True)).token_ids
        parent_after = (await p.generate(max_tokens=M, ignore_eos=True)).token_ids
        remote = other_process.generate(store_url, p.id, M, checkpoint="mid")
    assert remote["tokens"] == child_tokens
    assert remote["usage"]["prefill_tokens"] == 1
    # a fresh session fed the same prefix the same way gives the same tokens
    f = await ref.create_session()
    await f.append(PROMPT)
    await f.generate(max_tokens=N, ignore_eos=True)
    assert f.state.tokens == prefix
    assert (await f.generate(max_tokens=M, ignore_eos=True)).token_ids == child_tokens
    # the parent's continuation is the same as if no child had ever existed
    g = await ref.create_session()
    await g.append(PROMPT)
    await g.generate(max_tokens=N, ignore_eos=True)
    await g.append(list(range(60, 90)))
    assert (await g.generate(max_tokens=M, ignore_eos=True)).token_ids == parent_after


async def test_forks_share_full_pages_and_copy_the_partial_one(ref):
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        p = await eng.create_session()
        await p.append([*list(range(50)), 7])  # 50 tokens cached: 3 full pages + 2 rows
        free0 = eng.pages.num_free
        c = await eng.fork(p.id)
        assert c.state.pages[:3] == p.state.pages[:3]
        assert c.state.pages[3] != p.state.pages[3]
        assert eng.pages.num_free == free0 - 1  # only the partial page was copied
        await c.append([1, 2, 3, 4])
        await c.generate(max_tokens=3, ignore_eos=True)
        a = (await p.generate(max_tokens=5, ignore_eos=True)).token_ids
    q = await ref.create_session()
    await q.append([*list(range(50)), 7])
    assert (await q.generate(max_tokens=5, ignore_eos=True)).token_ids == a


async def test_eight_forks_store_one_prefix_plus_tails(tmp_path):
    P = 16
    prefix = [(i * 7) % 250 for i in range(512)]  # 32 full pages
    async with await ks.Engine.open(store=f"disk:{tmp_path}", page_size=P) as eng:
        root = await eng.create_session()
        await root.append([*prefix, 1])
        await root.checkpoint("base")
        await root.save()
        one = await eng.io.snapshots.bytes_stored()
        forks = []
        for i in range(8):
            f = await eng.fork(root.id, "base")
            await f.append([10 + i] * 20)
            await f.save()
            forks.append(f)
        total = await eng.io.snapshots.bytes_stored()
        store = eng.io.snapshots.store
        manifests = [await eng.io.snapshots.load_manifest(f.id) for f in forks]
        root_m = await eng.io.snapshots.load_manifest(root.id)
        page_bytes = len(await store.get_blob(root_m.head.pages[0]))
        state_bytes = len(await store.get_blob(manifests[0].head.state_blob))
        on_disk = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    prefix_pages = root_m.head.pages[:32]
    assert len(set(prefix_pages)) == 32
    for m in manifests:
        assert m.head.pages[:32] == prefix_pages  # shared, not copied
    # each fork adds its own tail only: its state, at most 3 pages, its token list
    tail = state_bytes + 3 * page_bytes + 4 * 600
    assert total - one <= 8 * tail, (one, total, tail)
    # no blob twice: the files on disk are exactly the distinct digests the manifests name
    named = set().union(root_m.blob_digests(), *(m.blob_digests() for m in manifests))
    assert len(on_disk) == len(named)


async def test_errors_are_typed(tmp_path):
    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        with pytest.raises(ks.SessionNotFound):
            await eng.resume("s_nope")
        s = await eng.create_session()
        await s.append(list(range(70)))
        with pytest.raises(ks.CheckpointNotFound):
            await eng.fork(s.id, "never")
        with pytest.raises(ValueError, match="token ids"):
            await s.append([999999])
        await s.save()
        sid = s.id
    # another page size: refused by name
    async with await ks.Engine.open(store=store, page_size=32) as eng:
        with pytest.raises(ks.IncompatibleSnapshot, match="page_size"):
            await eng.resume(sid)
    # a corrupted page blob never yields a session
    blobs = sorted((tmp_path / "blobs").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    victim = [b for b in blobs if b.is_file()][-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        with pytest.raises(ks.IntegrityError):
            s2 = await eng.resume(sid)
            await s2.generate(max_tokens=1)
        assert sid not in {x.session_id for x in await eng.list_sessions() if x.active}


async def test_store_unavailable_fails_fast():
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ks.StoreUnavailable):
        await ks.Engine.open(store=f"redis://127.0.0.1:{port}/0?timeout=1")
    assert time.monotonic() - t0 < 10


async def test_delete_reclaims_unshared_blobs(tmp_path):
    async with await ks.Engine.open(store=f"disk:{tmp_path}", page_size=16, gc_grace_s=0) as eng:
        a = await eng.create_session()
        await a.append(list(range(100)))
        await a.save()
        b = await eng.fork(a.id)
        await b.append([5] * 40)
        await b.save()
        before = set(await eng.io.snapshots.store.list_blobs())
        ma = await eng.io.snapshots.load_manifest(a.id)
        await eng.delete_session(b.id)
        after = set(await eng.io.snapshots.store.list_blobs())
        assert ma.blob_digests() <= after  # a's blobs survive
        assert after < before
        with pytest.raises(ks.SessionNotFound):
            await eng.resume(b.id)
        with pytest.raises(ks.SessionNotFound):
            await eng.delete_session(b.id)


async def test_stored_prefixes_are_reused_after_restart(tmp_path):
    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store) as eng:
        s = await eng.create_session(system="You are a careful agent. " * 30)
        await s.send("first question", max_tokens=2)
        await s.save()
        history = list(s.messages)
    async with await ks.Engine.open(store=store) as eng:  # a new process would see the same
        assert eng.stats()["prefix_index_entries"] > 0
        again = await eng.create_session_from_messages(history[:2])
        r = await again.send("a different second question", max_tokens=2)
        assert r.usage.cached_tokens > 0  # the system prompt + first question came from the store
