"""Save, resume in a new process and fork of an Engine on CUDA (bf16): greedy tokens equal those of a run that
was never saved, on the same GPU, with disk and Redis stores. The context spans several staging chunks of the
bulk page copy (page_io), so the pipelined restore is exercised chunk by chunk."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
import torch

import kda_sessions as ks
from kda_sessions.sessions import page_io

pytestmark = pytest.mark.gpu

PROMPT = [(i * 37 + 11) % 251 for i in range(3000)]  # 3,000 byte tokens: 46 pages of 64
N, M = 8, 12
DEVICE = "cuda"
OPEN = f"model='tiny-random', device={DEVICE!r}, dtype=torch.bfloat16, page_size=64"


@pytest.fixture(params=["disk", "redis"])
def store_url(request, tmp_path) -> str:
    if request.param == "disk":
        return f"disk:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url") + f"?prefix=t{tmp_path.name[-12:]}:"


def in_new_process(store: str, sid: str, n: int, checkpoint: str | None = None) -> dict:
    """Resume ``sid`` (or fork it at ``checkpoint``) in a new process on CUDA and generate ``n`` tokens."""
    code = (
        "import json, anyio, torch, kda_sessions as ks\n"
        "from kda_sessions.sessions import page_io\n"
        "page_io.CHUNK_BYTES = 1 << 20\n"
        "async def main():\n"
        f"    async with await ks.Engine.open({OPEN}, store={store!r}) as e:\n"
        f"        s = await (e.fork({sid!r}, {checkpoint!r}) if {checkpoint!r} else e.resume({sid!r}))\n"
        f"        r = await s.generate(max_tokens={n}, ignore_eos=True)\n"
        "        print(json.dumps({'tokens': r.token_ids, 'usage': r.usage.model_dump()}))\n"
        "anyio.run(main)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_save_resume_fork_equal_an_uninterrupted_run(store_url, monkeypatch):
    # a plain test around anyio.run: the device's pytest has no asyncio plugin
    monkeypatch.setattr(page_io, "CHUNK_BYTES", 1 << 20)  # 1 MiB chunks: the restore runs in several
    anyio.run(save_resume_fork, store_url)


async def save_resume_fork(store_url: str) -> None:
    tail = [5, 6, 7, 8, 9]
    async with await ks.Engine.open(model="tiny-random", device=DEVICE, dtype=torch.bfloat16, page_size=64,
                                    store="memory:") as ref:
        s = await ref.create_session()
        await s.append(PROMPT)
        first = (await s.generate(max_tokens=N, ignore_eos=True)).token_ids
        await s.checkpoint("mid")
        await s.append(tail)
        want_head = (await s.generate(max_tokens=M, ignore_eos=True)).token_ids
        f = await ref.fork(s.id, "mid")
        want_mid = (await f.generate(max_tokens=M, ignore_eos=True)).token_ids
    async with await ks.Engine.open(model="tiny-random", device=DEVICE, dtype=torch.bfloat16, page_size=64,
                                    store=store_url) as eng:
        s = await eng.create_session()
        await s.append(PROMPT)
        assert (await s.generate(max_tokens=N, ignore_eos=True)).token_ids == first
        await s.checkpoint("mid")
        await s.append(tail)
        await s.save()
        sid = s.id
        child = await eng.fork(sid, "mid")  # in this process, from pages still resident
        assert (await child.generate(max_tokens=M, ignore_eos=True)).token_ids == want_mid
    resumed = in_new_process(store_url, sid, M)
    assert resumed["tokens"] == want_head
    assert resumed["usage"]["prefill_tokens"] <= len(tail) + 1  # no re-prefill of the context
    forked = in_new_process(store_url, sid, M, checkpoint="mid")
    assert forked["tokens"] == want_mid
    assert forked["usage"]["prefill_tokens"] == 1
