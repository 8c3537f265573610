"""Prefix reuse across conversations of one tenant: a new conversation with the same system prompt and tools as
an earlier one starts from that state on its first turn; never across tenants; outputs equal a run without reuse."""

from __future__ import annotations

import httpx
import openai
import pytest
from server.server_helpers import start_server

import kda_sessions as ks
from kda_sessions.tokenizer import encode_chat

SYSTEM = "You are a careful coding agent working in a large repository. Read before you edit. " * 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def _head_len(eng: ks.Engine) -> int:
    """Tokens of the rendered system prompt + tools: the head every conversation here shares."""
    return len(encode_chat(
        eng.tokenizer, [{"role": "system", "content": SYSTEM}], TOOLS, add_generation_prompt=False, template=eng.template
    ))


async def test_second_conversation_reuses_the_shared_head():
    async with await ks.Engine.open(store="memory:", page_size=16) as ref:
        alone = await (await ref.create_session(system=SYSTEM, tools=TOOLS)).send("fix the parser", max_tokens=8, ignore_eos=True)
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        head = _head_len(eng)
        a = await eng.create_session(system=SYSTEM, tools=TOOLS)
        first = await a.send("list the files", max_tokens=8, ignore_eos=True)
        assert first.usage.cached_tokens == 0
        b = await eng.create_session(system=SYSTEM, tools=TOOLS)
        got = await b.send("fix the parser", max_tokens=8, ignore_eos=True)
        assert got.usage.cached_tokens >= 0.9 * head
        assert got.token_ids == alone.token_ids  # bit for bit on the CPU
        other = await (await eng.for_tenant("other")).create_session(system=SYSTEM, tools=TOOLS)
        r = await other.send("fix the parser", max_tokens=8, ignore_eos=True)
        assert r.usage.cached_tokens == 0
        assert r.token_ids == alone.token_ids
        stats = eng.stats()
        assert stats["prefix_cache_lookups"] >= 3 and stats["prefix_cache_hits"] >= 1
        assert stats["prefix_cache_hit_tokens"] >= 0.9 * head


@pytest.fixture(scope="module")
def tenant_server():
    srv = start_server(tenants={"acme": ["acme-key-000001"], "globex": ["globex-key-00002"]})
    yield srv
    srv.stop()


def _client(srv, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


async def test_openai_conversations_share_the_head_within_a_tenant_only(tenant_server):
    system = {"role": "system", "content": SYSTEM}

    async def ask(c: openai.AsyncOpenAI, text: str):
        return await c.chat.completions.create(
            model="tiny-random", messages=[system, {"role": "user", "content": text}], tools=TOOLS, max_tokens=6,
            temperature=0, extra_body={"ignore_eos": True},
        )

    head = _head_len(tenant_server.engine)
    async with _client(tenant_server, "acme-key-000001") as acme, _client(tenant_server, "globex-key-00002") as globex:
        first = await ask(acme, "list the files")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = await ask(acme, "fix the parser")
        assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * head
        other = await ask(globex, "fix the parser")
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        assert other.choices[0].message.content == second.choices[0].message.content
    async with httpx.AsyncClient(headers={"Authorization": "Bearer acme-key-000001"}) as c:
        metrics = (await c.get(tenant_server.url + "/metrics")).text
    hit_tokens = next(line for line in metrics.splitlines() if line.startswith("kda_prefix_cache_hit_tokens_total "))
    assert float(hit_tokens.split()[1]) >= 0.9 * head
    assert "kda_prefix_cache_lookups_total " in metrics


async def test_a_restarted_engine_finds_the_saved_head(tmp_path):
    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        head = _head_len(eng)
        a = await eng.create_session(system=SYSTEM, tools=TOOLS)
        await a.send("list the files", max_tokens=4, ignore_eos=True)
        await a.save()
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        b = await eng.create_session(system=SYSTEM, tools=TOOLS)
        r = await b.send("fix the parser", max_tokens=4, ignore_eos=True)
        assert r.usage.cached_tokens >= 0.9 * head
        other = await (await eng.for_tenant("other")).create_session(system=SYSTEM, tools=TOOLS)
        assert (await other.send("fix the parser", max_tokens=4, ignore_eos=True)).usage.cached_tokens == 0


async def test_resent_conversation_hashes_only_its_new_pages(monkeypatch):
    """A stateless client resends its history with one more turn: the new session takes the page keys of the held
    session whose tokens begin its own, so only the pages past them are hashed; the keys are the plain chain's."""
    from kda_sessions.sessions import prefix_index

    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read the parser " * 40}]
    more = [*history, {"role": "assistant", "content": "done " * 30}, {"role": "user", "content": "now the lexer"}]
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        a = await eng.create_session_from_messages(history)
        calls = []
        real = prefix_index._link
        monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
        b = await eng.create_session_from_messages(more)
        monkeypatch.setattr(prefix_index, "_link", real)
        na, nb = len(a.state.tokens), len(b.state.tokens)
        assert b.state.tokens[:na] == a.state.tokens and nb // 16 > na // 16 + 2
        assert 0 < len(calls) <= nb // 16 - na // 16
        plain = list(b.state.tokens)
        assert prefix_index.page_chain(b.state.tokens, 16, nb // 16) == prefix_index.page_chain(plain, 16, nb // 16)
