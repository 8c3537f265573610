"""The OpenAI translation layer without a server: history split, tool-call checks, bodies that the
openai SDK's own models accept, and tool_choice passed to the engine when it takes it."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kda_sessions.engine.types import Reply, Usage
from kda_sessions.server.chat import ChunkWriter, check_tool_calls, completion_body, split_history
from kda_sessions.server.openai_routes import send_with_tool_choice
from kda_sessions.server.schemas import NamedToolChoice
from kda_sessions.tokenizer import FunctionCall, ToolCall

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}},
         {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]


def call(name: str, args: str, i: int = 0) -> ToolCall:
    return ToolCall(id=f"functions.{name}:{i}", function=FunctionCall(name=name, arguments=args))


S, U, A, T = ({"role": r, "content": r} for r in ("system", "user", "assistant", "tool"))


@pytest.mark.parametrize(
    ("messages", "n_prefix"),
    [([S, U], 1), ([U], 0), ([S, S, U], 2), ([S, U, A, U], 3), ([S, U, A, T, U], 3), ([S, U, A, U, A, T], 5)],
    ids=["sys-user", "user", "two-sys", "one-turn", "tool-then-user", "two-turns"],
)
def test_split_history(messages, n_prefix):
    prefix, new = split_history(messages)
    assert len(prefix) == n_prefix and prefix + new == messages


def test_split_history_needs_something_to_answer():
    with pytest.raises(ValueError, match="nothing to answer"):
        split_history([S, U, A])


def test_check_tool_calls():
    good, bad_args, unknown = call("grep", '{"pattern": "x"}'), call("grep", '{"pattern": 1}', 1), call("rm", "{}", 2)
    valid, problems = check_tool_calls([good, bad_args, unknown], TOOLS, "auto")
    assert valid == [good] and len(problems) == 2
    named = NamedToolChoice(function={"name": "ls"})
    assert check_tool_calls([good, call("ls", "{}")], TOOLS, named)[0] == [call("ls", "{}")]
    assert check_tool_calls([good], TOOLS, "none")[0] == []


def test_completion_with_tool_call_parses_as_openai_chat_completion():
    c = call("grep", '{"pattern": "TODO"}')
    reply = Reply(session_id="s_abc", text="", token_ids=[1, 2, 3], tool_calls=[c], finish_reason="tool_calls",
                  usage=Usage(prompt_tokens=20, cached_tokens=12, prefill_tokens=8, completion_tokens=3))
    body = completion_body(reply, [c], "tiny-random", "chatcmpl-1")
    parsed = ChatCompletion.model_validate(body)
    msg = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "grep" and msg.tool_calls[0].id == "functions.grep:0"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 12 and parsed.usage.total_tokens == 23
    assert body["session_id"] == "s_abc"
    # every call dropped: not "tool_calls" any more
    assert completion_body(reply, [], "m", "x")["choices"][0]["finish_reason"] == "stop"


def test_chunks_parse_as_openai_chunks():
    w = ChunkWriter("chatcmpl-1", "tiny-random", "s_abc")
    bodies = [w.role(), w.content("he"), w.tool_call(call("ls", "{}")), w.tool_call(call("grep", '{"pattern": "a"}', 1)),
              w.finish("tool_calls"), w.usage(Usage(prompt_tokens=5, completion_tokens=2))]
    chunks = [ChatCompletionChunk.model_validate(b) for b in bodies]
    assert [c.choices[0].delta.tool_calls[0].index for c in chunks[2:4]] == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert all(b["session_id"] == "s_abc" for b in bodies)


class _FakeSession:
    def __init__(self, accepts_tool_choice: bool) -> None:
        self.accepts = accepts_tool_choice
        self.calls: list[dict] = []

    @property
    def id(self) -> str:
        return "s_fake"

    async def send_messages(self, messages, **sampling):
        self.calls.append(sampling)
        if "tool_choice" in sampling and not self.accepts:
            raise TypeError("unknown sampling arguments ['tool_choice']; allowed: [...]")
        return Reply(session_id="s_fake", text="", token_ids=[], finish_reason="stop", usage=Usage())


@pytest.mark.parametrize("accepts", [True, False], ids=["engine-constrains", "engine-does-not-yet"])
async def test_tool_choice_passed_through_with_fallback(accepts):
    s = _FakeSession(accepts)
    named = NamedToolChoice(function={"name": "ls"})
    await send_with_tool_choice(s, [U], {"max_tokens": 2}, named)  # type: ignore[arg-type]
    assert s.calls[0]["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert (len(s.calls) == (1 if accepts else 2) and "tool_choice" not in s.calls[-1]) or accepts
    s = _FakeSession(False)
    await send_with_tool_choice(s, [U], {}, "auto")  # type: ignore[arg-type]
    assert s.calls == [{}]
