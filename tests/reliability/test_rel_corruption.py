"""Corruption through the engine: flip a bit, truncate, zero a 4 KiB page of each kind of blob and of the
manifest, on disk and in Redis; resume raises IntegrityError (or the session/blob is reported missing), never
loads wrong data, and the engine keeps serving other sessions."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

import kda_sessions as ks
from kda_sessions.storage import SnapshotStore

ENGINE = {"model": "tiny-random", "page_size": 16, "ram_tier_bytes": 0}
MUTATIONS: dict[str, Callable[[bytes], bytes]] = {
    "flip-bit": lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0x10]) + b[len(b) // 2 + 1 :],
    "truncate": lambda b: b[: len(b) // 2],
    "zero-page": lambda b: bytes(min(4096, len(b))) + b[4096:],
}
TARGETS = ["manifest", "tokens", "state", "page"]
BACKENDS = ["disk", "redis"]


def _cases() -> list:
    """Every (backend, target, mutation). The default run takes half, 12 that still hold every pair (each target
    with each mutation, the backend alternating so each backend meets every target and every mutation); the
    other 12 are marked slow (`-m slow` runs them, `-m ""` the whole product)."""
    return [
        pytest.param(backend, target, mutation, id=f"{backend}-{target}-{mutation}",
                     marks=() if (t + m) % 2 == b else pytest.mark.slow)
        for t, target in enumerate(TARGETS)
        for m, mutation in enumerate(MUTATIONS)
        for b, backend in enumerate(BACKENDS)
    ]


class Raw:
    """Read and overwrite stored objects behind the store's back."""

    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("disk:"):
            from pathlib import Path

            self.root = Path(url[5:])
        else:
            base, _, query = url.partition("?")
            self.prefix = query.split("prefix=")[1].split("&")[0]
            self.r = redis.Redis.from_url(base)

    def key(self, target: str, sid: str, digest: str) -> object:
        if target == "manifest":
            return self.root / "manifests" / f"{sid}.json" if hasattr(self, "root") else f"{self.prefix}manifest:{{{sid}}}"
        return self.root / "blobs" / digest[:2] / digest if hasattr(self, "root") else f"{self.prefix}blob:{digest}"

    def mutate(self, key: object, fn: Callable[[bytes], bytes]) -> None:
        if hasattr(self, "root"):
            key.write_bytes(fn(key.read_bytes()))  # type: ignore[attr-defined]
        else:
            self.r.set(key, fn(self.r.get(key)))  # type: ignore[arg-type]


@pytest.fixture
def url(request, backend, tmp_path) -> str:
    if backend == "disk":
        return f"disk:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url") + f"?prefix=corrupt{tmp_path.name[-10:]}:"


@pytest.mark.parametrize("backend,target,mutation", _cases())
async def test_corruption_is_an_integrity_error(url, target, mutation):
    async with await ks.Engine.open(store=url, **ENGINE) as eng:
        victim, other = await eng.create_session(), await eng.create_session()
        for k, s in enumerate((victim, other)):
            await s.append(list(range(40 + k, 240 + k)))  # no blob in common
            await s.save()
        sid = victim.id
    async with await SnapshotStore.open(url) as snaps:
        m = await snaps.load_manifest(sid)
    digest = {"manifest": "", "tokens": m.tokens_blob, "state": m.head.state_blob, "page": m.head.pages[0]}[target]
    raw = Raw(url)
    raw.mutate(raw.key(target, sid, digest), MUTATIONS[mutation])
    async with await ks.Engine.open(store=url, **ENGINE) as eng:
        with pytest.raises((ks.IntegrityError, ks.SessionNotFound)) as err:
            s = await eng.resume(sid)
            await s.generate(max_tokens=2, ignore_eos=True)
        assert not isinstance(err.value, ks.SessionNotFound) or target == "manifest"
        o = await eng.resume(other.id)  # the engine keeps serving the other session
        assert len((await o.generate(max_tokens=2, ignore_eos=True)).token_ids) == 2
