"""The official openai SDK against the server: plain, streamed, tools, session_id, full-history resend."""

from __future__ import annotations

import secrets

import anyio
import httpx
import openai
import pytest

from kda_sessions.engine.types import Reply, Usage
from kda_sessions.server import openai_routes
from kda_sessions.tokenizer import FunctionCall, ToolCall, validate_arguments

from .server_helpers import READ_FILE, SYSTEM


@pytest.fixture
async def oai(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


async def test_models(oai):
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]


async def test_plain_completion(oai):
    # a system prompt no other test of the module sends: nothing to reuse, whichever test ran first
    system = {"role": "system", "content": f"{secrets.token_hex(8)}: you are a coding agent."}
    r = await oai.chat.completions.create(
        model="tiny-random", messages=[system, {"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.session_id.startswith("s_")  # extension field, kept by the SDK's models


async def test_streamed_completion(oai):
    stream = await oai.chat.completions.create(
        model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "stream"}], max_completion_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.session_id for c in chunks} == {chunks[0].session_id}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


async def test_session_id_continues_with_new_messages_only(oai):
    first = await oai.chat.completions.with_raw_response.create(
        model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "plan"}], max_tokens=3, temperature=0,
    )
    sid = first.headers["x-session-id"]
    assert first.parse().session_id == sid
    second = await oai.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "next step"}], max_tokens=3, temperature=0,
        extra_body={"session_id": sid},
    )
    assert second.session_id == sid
    assert second.usage.prompt_tokens_details.cached_tokens > first.parse().usage.prompt_tokens // 2


async def test_full_history_resend_reuses_stored_prefix(oai):
    history = [SYSTEM, {"role": "user", "content": "a question nobody else asked"}]
    first = await oai.chat.completions.create(model="tiny-random", messages=history, max_tokens=3, temperature=0)
    # the shared system prompt may come from other conversations (prefix reuse across them); nothing after it
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - len(history[1]["content"])
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and a follow-up"}]
    second = await oai.chat.completions.create(model="tiny-random", messages=history, max_tokens=3, temperature=0)
    assert second.session_id != first.session_id
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


async def test_tools_with_named_tool_choice_returns_a_valid_call(oai):
    r = await oai.chat.completions.create(
        model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "read a.py"}], tools=[READ_FILE],
        tool_choice={"type": "function", "function": {"name": "read_file"}}, max_tokens=120, temperature=0,
    )
    # constrained decoding: even random weights produce exactly one call that validates against the schema
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "read_file"
    assert validate_arguments(call.function.arguments, READ_FILE["function"]["parameters"]) == []


async def test_tool_call_reply_reaches_the_sdk(oai, monkeypatch):
    """The response path for a tool call, end to end, with a reply the random model would not produce."""
    good = ToolCall(id="functions.read_file:0", function=FunctionCall(name="read_file", arguments='{"path": "a.py"}'))
    bad = ToolCall(id="functions.read_file:1", function=FunctionCall(name="read_file", arguments='{"path": 3}'))

    async def fake_send(session, messages, sampling, tool_choice):
        return Reply(session_id=session.id, text="", token_ids=[1, 2], tool_calls=[good, bad],
                     finish_reason="tool_calls", usage=Usage(prompt_tokens=10, completion_tokens=2))

    monkeypatch.setattr(openai_routes, "send_with_tool_choice", fake_send)
    r = await oai.chat.completions.create(
        model="tiny-random", messages=[SYSTEM, {"role": "user", "content": "read a.py"}], tools=[READ_FILE],
        tool_choice="required", max_tokens=8,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # the invalid one is dropped
    assert call.id.startswith("functions.read_file:0#")  # the model's id, made unique to this reply
    assert choice.message.tool_calls[0].function.arguments == '{"path": "a.py"}'


async def test_tool_round_trip_messages_are_accepted(oai):
    call = {"id": "functions.read_file:0", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    r = await oai.chat.completions.create(
        model="tiny-random", tools=[READ_FILE], max_tokens=2, temperature=0,
        messages=[SYSTEM, {"role": "user", "content": "read a.py"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "print('hi')"}],
    )
    assert r.choices[0].finish_reason in ("stop", "length")


async def test_unknown_session_is_404_in_openai_shape(oai, server):
    with pytest.raises(openai.NotFoundError) as e:
        await oai.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "x"}],
                                          extra_body={"session_id": "s_" + "f" * 32})
    assert e.value.body["code"] == "session_not_found"
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "session_id": "s_" + "f" * 32})
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code", "request_id"}


@pytest.mark.parametrize(
    "body",
    [{"n": 9}, {"max_tokens": 0}, {"temperature": 5}, {"tool_choice": "required"}, {"messages": []},
     {"messages": [{"role": "wizard", "content": "x"}]}, {"top_logprobs": 3}],
    ids=["n9", "max_tokens0", "temperature5", "required-without-tools", "no-messages", "bad-role", "top-logprobs"],
)
async def test_bad_requests_are_400(server, body):
    payload = {"messages": [{"role": "user", "content": "x"}], **body}
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_dropped_stream_frees_its_slot(server):
    """A client that goes away mid-stream cancels its generation: nothing stays queued or locked, and the
    next request completes (the test would hang or time out otherwise)."""
    eng = server.engine
    body = {"messages": [SYSTEM, {"role": "user", "content": "long"}], "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with anyio.fail_after(30):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                sid = r.headers["x-session-id"]
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data:")
                    if n >= 4:
                        break
            while eng.sessions[sid].lock.locked() or eng.scheduler.running or eng.stats()["queue_depth"]:
                await anyio.sleep(0.05)
            assert eng.stats()["queue_depth"] == 0
            assert eng.sessions[sid].num_tokens < 1000  # generation stopped long before max_tokens
            r = await http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2,
                                                               "session_id": sid, "messages": [{"role": "user", "content": "again"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
