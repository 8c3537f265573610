"""The OpenAI protocol as the official SDK expects it: unknown model, response_format, n > 1, unique tool-call
ids, a forced call cut by max_tokens, malformed JSON, /v1/completions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kda_sessions.server.schemas import ChatMessage
from kda_sessions.tokenizer import validate_arguments

from .server_helpers import READ_FILE, SYSTEM, start_server

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "admin": {"type": "boolean"}},
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    srv = start_server(served_model_aliases=["kimi-tiny"])
    yield srv
    srv.stop()


@pytest.fixture
async def oai(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _user(text: str) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": text}]


async def test_unknown_model_is_404_model_not_found(oai):
    with pytest.raises(openai.NotFoundError) as e:
        await oai.chat.completions.create(model="gpt-4o", messages=_user("hi"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="gpt-4o", prompt="x", max_tokens=2)


async def test_served_name_and_aliases_are_accepted_and_listed(oai):
    for name in ("tiny-random", "kimi-tiny"):
        r = await oai.chat.completions.create(model=name, messages=_user("hi"), max_tokens=2, temperature=0)
        assert r.model == name
    assert [m.id for m in (await oai.models.list()).data] == ["tiny-random", "kimi-tiny"]


@pytest.mark.parametrize("max_tokens", [48, 200], ids=["closing-budget", "long-budget"])
async def test_response_format_json_schema_gives_a_valid_object(oai, max_tokens):
    r = await oai.chat.completions.create(
        model="tiny-random", messages=_user("who are you? answer in JSON"), max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    obj = json.loads(choice.message.content)  # random weights, yet a valid object
    assert validate_arguments(choice.message.content, PERSON) == [], obj


async def test_response_format_json_object_streams_a_json_object(oai):
    stream = await oai.chat.completions.create(
        model="tiny-random", messages=_user("json please"), max_tokens=40, temperature=0.8, seed=3, stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"type": "json_schema"}], ids=["unknown-type", "no-schema"])
async def test_bad_response_format_is_400(server, fmt):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": _user("x"), "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("response_format")


async def test_response_format_with_a_forced_call_is_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny-random", messages=_user("x"), tools=[READ_FILE],
                                          tool_choice="required", response_format={"type": "json_object"})
    assert "response_format" in e.value.body["message"]


async def test_n3_gives_three_distinct_choices_from_forks_of_the_prompt(oai, server):
    r = await oai.chat.completions.create(model="tiny-random", messages=_user("three ways"), max_tokens=6, n=3,
                                          temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3, texts
    assert r.usage.completion_tokens == 18
    ids = [c.model_extra["session_id"] for c in r.choices]
    assert ids[0] == r.session_id and len(set(ids)) == 3
    assert all(i.startswith("s_chat_") for i in ids)  # all under the chat-session retention
    prompt_len = r.usage.prompt_tokens
    for sid in ids[1:]:  # each fork holds the same prompt and its own answer
        info = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=30).json()
        assert info["num_tokens"] == prompt_len + 6 and info["parent"] == r.session_id


async def test_n_with_stream_is_400(oai):
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="tiny-random", messages=_user("x"), n=2, stream=True)


async def test_tool_call_ids_are_unique_and_a_resent_history_reencodes_exactly(oai):
    choice = {"type": "function", "function": {"name": "read_file"}}
    history = _user("read a.py")
    first = await oai.chat.completions.create(model="tiny-random", messages=history, tools=[READ_FILE],
                                              tool_choice=choice, max_tokens=60, temperature=0)
    (call1,) = first.choices[0].message.tool_calls
    history += [first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call1.id, "content": "print('a')"}]
    second = await oai.chat.completions.create(model="tiny-random", messages=history, tools=[READ_FILE],
                                               tool_choice=choice, max_tokens=60, temperature=0)
    (call2,) = second.choices[0].message.tool_calls
    assert call1.id != call2.id
    # the unique ids render as the model's own, so the whole first turn is reused from the stored session
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    streamed = await oai.chat.completions.create(model="tiny-random", messages=_user("read b.py"), tools=[READ_FILE],
                                                 tool_choice=choice, max_tokens=60, temperature=0, stream=True)
    ids = [tc.id for c in [c async for c in streamed] if c.choices and c.choices[0].delta.tool_calls
           for tc in c.choices[0].delta.tool_calls]
    assert len(ids) == 1 and ids[0] not in (call1.id, call2.id)


def test_unique_ids_render_as_the_models_own():
    m = ChatMessage(role="tool", tool_call_id="functions.read_file:0#0a1b2c3d", content="x").to_template()
    assert m["tool_call_id"] == "functions.read_file:0"
    a = ChatMessage(role="assistant", tool_calls=[{"id": "functions.grep:0#ffffffff", "type": "function",
                                                   "function": {"name": "grep", "arguments": "{}"}}]).to_template()
    assert a["tool_calls"][0]["id"] == "functions.grep:0"


async def test_a_forced_call_cut_by_max_tokens_finishes_with_length(oai):
    r = await oai.chat.completions.create(model="tiny-random", messages=_user("read a.py"), tools=[READ_FILE],
                                          tool_choice="required", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls  # the cut call's arguments are not valid


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "hi"},]}', b"not json"],
                         ids=["trailing-comma", "not-json"])
def test_malformed_json_is_400_naming_where(server, raw):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and err["param"] is None
    assert "not valid JSON" in err["message"] and "at character" in err["message"]


async def test_completions_continue_a_raw_prompt(oai, server):
    r = await oai.completions.create(model="tiny-random", prompt="def main():", max_tokens=5, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == len(b"def main():")
    assert len(r.choices[0].logprobs.token_logprobs) == 5
    sid = r.model_extra["session_id"]
    again = await oai.completions.create(model="tiny-random", prompt=[65, 66], max_tokens=2, temperature=0,
                                         extra_body={"session_id": sid, "ignore_eos": True})
    assert again.usage.prompt_tokens == r.usage.prompt_tokens + 5 + 2
    stream = await oai.completions.create(model="tiny-random", prompt="x = ", max_tokens=3, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_session_route_messages_take_response_format(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"system": "sys"}, timeout=30).json()["session_id"]
    r = httpx.post(f"{server.url}/v1/sessions/{sid}/messages", timeout=60, json={
        "content": "json", "max_tokens": 60, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    assert validate_arguments(r.json()["text"], PERSON) == []


async def test_top_logprobs_list_the_most_likely_tokens_at_each_position(oai):
    r = await oai.chat.completions.create(model="tiny-random", messages=_user("hi"), max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        alts = tok.top_logprobs
        assert len(alts) == 3 and [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
        assert alts[0].token == tok.token and alts[0].logprob == pytest.approx(tok.logprob)  # greedy: the top one
    with pytest.raises(openai.BadRequestError):  # OpenAI's rule: top_logprobs needs logprobs
        await oai.chat.completions.create(model="tiny-random", messages=_user("hi"), max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError):
        await oai.chat.completions.create(model="tiny-random", messages=_user("hi"), max_tokens=2, logprobs=True,
                                          top_logprobs=21)
