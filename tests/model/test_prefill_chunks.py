"""Greedy continuations after a prefill in small chunks equal those after one unchunked prefill (CPU, through the
Engine), with a context long enough that MLA prefill crosses several of its CPU tiles."""

from __future__ import annotations

import anyio
import pytest
import torch

import kda_sessions as ks
from kda_sessions.kernels.mla import prefill_cpu

IDS = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(5)).tolist()
TILE = 128  # so that 600 tokens span several MLA tiles


async def _greedy(chunk: int) -> list[int]:
    """12 greedy tokens after IDS prefilled ``chunk`` tokens a model call."""
    async with await ks.Engine.open(store="memory:", prefill_chunk_tokens=chunk, prefill_chunk_tokens_idle=chunk,
                                    page_size=16) as eng:
        s = await eng.create_session()
        u = await s.append(IDS)
        r = await s.generate(max_tokens=12, temperature=0.0)
        assert u.prefill_tokens + r.usage.prefill_tokens >= len(IDS)
        return r.token_ids


@pytest.fixture(scope="module")
def unchunked() -> list[int]:
    """The continuation after one unchunked prefill, shared by the chunk sizes below."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_cpu, "TILE", TILE)
        return anyio.run(_greedy, 4096)


@pytest.mark.parametrize("chunk", [16, 300], ids=lambda c: f"chunk{c}")
async def test_chunked_prefill_greedy_equals_unchunked(chunk, unchunked, monkeypatch):
    monkeypatch.setattr(prefill_cpu, "TILE", TILE)
    got = await _greedy(chunk)
    assert len(got) == 12 and got == unchunked
