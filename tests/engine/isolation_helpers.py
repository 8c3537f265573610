"""Helpers for the failure-isolation tests: a session's pool state, the state of a fresh prefill of its tokens,
a pause that makes several requests start in the same engine step, and fault injection points."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio
import torch

import kda_sessions as ks


def prompt(i: int, n: int = 30) -> list[int]:
    return [(i * 13 + j * 7) % 250 for j in range(n + i)]


@dataclass
class PoolState:
    kda: torch.Tensor
    """[L, H, K, V] float32."""
    conv: torch.Tensor
    kv: list[torch.Tensor]
    """One [num_cached, latent] per MLA layer."""
    num_cached: int
    tokens: list[int]

    def equal(self, other: PoolState) -> bool:
        return (self.num_cached == other.num_cached and self.tokens == other.tokens and torch.equal(self.kda, other.kda)
                and torch.equal(self.conv, other.conv) and all(torch.equal(a, b) for a, b in zip(self.kv, other.kv)))


def pool_state(eng: ks.Engine, s: ks.Session) -> PoolState:
    st = s.state
    assert st.slot is not None
    with eng.mutex:
        kda = torch.stack([p[st.slot] for p in eng.pools.kda]).clone()
        conv = torch.stack([p[st.slot] for p in eng.pools.conv]).clone()
        kv = [torch.cat([p[pg] for pg in st.pages])[: st.num_cached].clone() if st.pages else p[:0, 0] for p in eng.pools.kv]
    return PoolState(kda, conv, kv, st.num_cached, list(st.tokens))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).pow(2).mean().sqrt() / (b.float().pow(2).mean().sqrt() + 1e-12))


async def assert_equals_fresh_prefill(eng: ks.Engine, s: ks.Session, tol: float = 1e-4) -> None:
    """The session's pools hold what a fresh prefill of ``tokens[:num_cached]`` gives (to float rounding: a
    different chunking rounds differently; a token too many or too few is off by orders of magnitude more)."""
    got = pool_state(eng, s)
    fresh = await eng.create_session()
    await fresh.append([*got.tokens[: got.num_cached], 0])  # append keeps its last token pending
    want = pool_state(eng, fresh)
    assert want.num_cached == got.num_cached
    assert rel_rms(got.kda, want.kda) < tol, rel_rms(got.kda, want.kda)
    assert rel_rms(got.conv, want.conv) < tol
    for a, b in zip(got.kv, want.kv):
        assert rel_rms(a, b) < tol
    await eng.delete_session(fresh.id)


@contextmanager
def one_step(eng: ks.Engine) -> Iterator[None]:
    """Hold the engine's step thread while the block submits requests, so that they all start in one step."""
    eng.mutex.acquire()
    try:
        yield
    finally:
        eng.mutex.release()


async def wait_queued(eng: ks.Engine, n: int) -> None:
    with anyio.fail_after(10):
        while len(eng.scheduler.waiting) < n:
            await anyio.sleep(0.005)


def collect(out: dict[str, object]):
    """``go(name, call)`` for a task group: awaits ``call()`` and stores its result, or the exception it raised
    (the tests inspect both), in ``out[name]``."""

    async def go(name: str, call) -> None:  # type: ignore[no-untyped-def]
        try:
            out[name] = await call()
        except Exception as e:  # the test inspects it
            out[name] = e

    return go
