"""The same calls on an in-process ``Session`` and a ``RemoteSession`` (same model, same seedless greedy
decoding) leave the same observable state: context length, messages, reply tokens."""

from __future__ import annotations

import time

import anyio

import kda_sessions as ks
from kda_sessions.client import Client


async def _observe(s) -> tuple[int, list[dict]]:
    return s.num_tokens, s.messages


async def _drive(s) -> list[object]:
    seen: list[object] = [await _observe(s)]
    r = await s.send("hello there", max_tokens=5, ignore_eos=True)
    seen += [r.token_ids, await _observe(s)]
    r = await s.send_messages([{"role": "user", "content": "and then?"}], max_tokens=3, ignore_eos=True)
    seen += [r.token_ids, await _observe(s)]
    events = [ev async for ev in s.stream("stream it", max_tokens=4, ignore_eos=True)]
    assert isinstance(events[-1], ks.Done)
    seen += [events[-1].reply.token_ids, await _observe(s)]
    usage = await s.append([40, 41, 42])
    seen += [usage.prompt_tokens, await _observe(s)]
    g = await s.generate(max_tokens=3, ignore_eos=True)
    seen += [g.token_ids, await _observe(s)]
    return seen


async def test_remote_session_matches_local_session(server):
    async with Client(server.url) as client:
        remote = await client.create_session(system="You are terse.")
        remote_seen = await _drive(remote)
        again = await client.resume(remote.id)  # a new handle reads the server's state
        assert (again.num_tokens, again.messages) == remote_seen[-1]
    async with await ks.Engine.open(model="tiny-random", store="memory:") as engine:
        local = await engine.create_session(system="You are terse.")
        local_seen = await _drive(local)
    assert remote_seen == local_seen
    num_tokens, messages = remote_seen[-1]
    assert num_tokens > remote_seen[0][0]
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3


async def test_remote_num_tokens_after_an_early_stream_exit(server):
    async with Client(server.url) as client:
        s = await client.create_session()
        before = s.num_tokens
        async for _ in s.stream("say something long", max_tokens=32, ignore_eos=True):
            break  # leaves the stream: the server cancels the generation
        # once it sees the connection closed, and releases the session's lock after: a token decoded between
        # the two reads below would make them differ (42 against 43 under load)
        state = server.engine.sessions[s.id]
        deadline = time.monotonic() + 30
        while state.lock.locked():
            assert time.monotonic() < deadline, "the server never ended the abandoned generation"
            await anyio.sleep(0.01)
        assert s.num_tokens >= before  # asked from the server, not a stale local guess
        assert s.num_tokens == (await client.get_session(s.id)).num_tokens
