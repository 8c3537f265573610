"""A save that reuses stored blobs by dedup verifies them first and rewrites a corrupt one (issue 24.6)."""

from __future__ import annotations

import json
from pathlib import Path

import kda_sessions as ks

PROMPT = list(range(40, 140))  # 100 byte tokens: 7 KV pages of 16


def flip_first_byte(root: Path, digest: str) -> None:
    path = root / "blobs" / digest[:2] / digest
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])


async def test_a_session_reusing_a_corrupt_page_saves_it_again(tmp_path: Path) -> None:
    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        s = await eng.create_session()
        await s.append(PROMPT)
        await s.save()
        first = s.id
    manifest = json.loads((tmp_path / "manifests" / f"{first}.json").read_bytes())
    page = manifest["head"]["pages"][2]
    flip_first_byte(tmp_path, page)
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        s = await eng.create_session()
        await s.append(PROMPT)
        result = await s.save()  # the same pages: all but the corrupt one are reused
        second = s.id
    assert result.blobs_written == 1
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        for sid in (second, first):  # the rewrite heals the first session too
            r = await (await eng.resume(sid)).generate(max_tokens=3, ignore_eos=True)
            assert len(r.token_ids) == 3
