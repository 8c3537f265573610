"""Greedy continuations after a prefill in small chunks equal those after one unchunked prefill (CPU, through the
Engine), with a context long enough that MLA prefill crosses several of its CPU tiles."""

from __future__ import annotations

import pytest
import torch

import kda_sessions as ks
from kda_sessions.kernels.mla import prefill_cpu


@pytest.mark.parametrize("chunk", [16, 300], ids=lambda c: f"chunk{c}")
async def test_chunked_prefill_greedy_equals_unchunked(chunk, monkeypatch):
    monkeypatch.setattr(prefill_cpu, "TILE", 128)  # so that 600 tokens span several MLA tiles
    ids = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {}
    for c in (chunk, 4096):
        async with await ks.Engine.open(store="memory:", prefill_chunk_tokens=c, prefill_chunk_tokens_idle=c,
                                          page_size=16) as eng:
            s = await eng.create_session()
            u = await s.append(ids)
            r = await s.generate(max_tokens=12, temperature=0.0)
            out[c] = r.token_ids
            assert u.prefill_tokens + r.usage.prefill_tokens >= len(ids)
    assert len(out[chunk]) == 12 and out[chunk] == out[4096]
