"""A save streams its blobs into one pack: the pages reach the pack file before any KDA state is hashed (the
stream's count is a bound announced at once, the pack's index comes last), a state equal to another of the same
save (a checkpoint at the head) is written once, and the session resumes as if never saved (greedy, CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kda_sessions as ks
from kda_sessions.sessions import store_io
from kda_sessions.storage.backends import disk as disk_mod
from kda_sessions.storage.backends.disk import TMP_PREFIX

PROMPT = list(range(40, 240))  # 200 byte tokens: 12 full KV pages of 16


def _pack_bytes_in_flight(root: Path) -> int:
    return max((p.stat().st_size for p in (root / "blobs" / "packs").glob(f"{TMP_PREFIX}*")), default=0)


async def test_pages_are_written_before_the_states_are_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_mod, "PACK_MIN_BLOBS", 2)
    async with await ks.Engine.open(store="memory:", page_size=16) as ref:
        s = await ref.create_session()
        await s.append(PROMPT)
        await s.generate(max_tokens=4, ignore_eos=True)
        want = await s.generate(max_tokens=6, ignore_eos=True)

    root = tmp_path / "store"
    seen_in_pack: list[int] = []
    real = store_io._encode_hash

    def after_pages(encode: Callable[[], bytes]) -> tuple[str, bytes]:
        """Hash a small blob only once page bytes are in the pack's temp file (10 s at most)."""
        for _ in range(1000):
            if (n := _pack_bytes_in_flight(root)) > 16 * 4:
                break
            time.sleep(0.01)
        seen_in_pack.append(n)
        return real(encode)

    async with await ks.Engine.open(store=f"disk:{root}", page_size=16) as eng:
        s = await eng.create_session()
        await s.append(PROMPT)
        await s.generate(max_tokens=4, ignore_eos=True)
        await s.checkpoint("here")  # its state is the head's: one blob, put once
        monkeypatch.setattr(store_io, "_encode_hash", after_pages)
        result = await s.save()
        monkeypatch.setattr(store_io, "_encode_hash", real)
        sid = s.id
    assert seen_in_pack and min(seen_in_pack) > 16 * 4  # every small blob waited for pages already written
    assert len(list((root / "blobs" / "packs").glob("pack-*.pack"))) == 1
    assert [p for p in (root / "blobs").glob("??/*") if p.is_file()] == []
    assert result.blobs_written == 12 + 3  # pages, one state (head = checkpoint), the partial page, the tokens
    async with await ks.Engine.open(store=f"disk:{root}", page_size=16) as eng:
        got = await (await eng.resume(sid)).generate(max_tokens=6, ignore_eos=True)
    assert got.token_ids == want.token_ids
