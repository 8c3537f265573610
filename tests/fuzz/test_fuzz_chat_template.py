"""hypothesis on the built-in chat template and the tool-call parser: arbitrary messages and text give a
result or a typed error (ChatTemplateError, a returned ToolCallParseError), never a crash; contents never
become special tokens; the stream parser gives the same answer however its input is split."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_sessions.tokenizer import (
    ByteTokenizer,
    ChatTemplateError,
    ContentDelta,
    ToolCall,
    ToolCallParseError,
    ToolCallStreamParser,
    encode_chat,
    parse_assistant_output,
)
from kda_sessions.tokenizer.tool_calls import MARKERS

# a short run per test: examples are drawn afresh on every run (not derandomized), so runs add up
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOK = ByteTokenizer()
IM_END = TOK.special_ids["<|im_end|>"]
SPECIAL_NAMES = [
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", *MARKERS, "<|bos|>",
    "\ue000",  # the template's own escape character
]

# Text that often contains special names, escapes and partial markers.
text = st.lists(
    st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_NAMES), st.sampled_from(["<|", "|>", "<|tool_", "{", "}"])),
    max_size=8,
).map("".join)
# Dict keys without special names: keys are not escaped, see test_fuzz_special_names_in_dict_keys_stay_text.
key = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=8)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(key, inner, max_size=3), max_leaves=8)
# JSON-able values only: other Python objects (bytes, sets) are a TypeError from the template's tojson.
anything = st.one_of(json_value, st.tuples(json_scalar))

tool_call = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": text, "arguments": st.one_of(text, st.dictionaries(key, json_value, max_size=3))})},
    optional={"id": text},
)
good_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.one_of(text, st.none())}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(text, st.none())},
                          optional={"tool_calls": st.lists(tool_call, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": text, "content": text}),
)
good_tools = st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text, "description": text, "parameters": st.dictionaries(key, json_value, max_size=3)})}), max_size=2)
# Anything at all in the places a message has fields.
wild_message = st.one_of(
    anything,
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]), anything, max_size=5),
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
                          optional={"content": anything, "tool_calls": anything, "tool_call_id": anything}),
)


@FUZZ
@given(messages=st.lists(good_message, min_size=1, max_size=5), tools=good_tools, gen=st.booleans())
def test_fuzz_encode_chat_contents_never_become_specials(messages: list[dict[str, Any]], tools: Any, gen: bool) -> None:
    ids = encode_chat(TOK, messages, tools, add_generation_prompt=gen)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    # one <|im_end|> per message (+ the tool declaration): nothing inside a message closes a turn
    assert ids.count(IM_END) == len(messages) + (1 if tools else 0)
    specials = [i for i in ids if TOK.is_special(i)]
    assert len(specials) <= 3 * len(messages) + 3 + 5 * sum(len(m.get("tool_calls") or []) + 1 for m in messages)


@pytest.mark.parametrize("where", ["tool_parameters", "call_arguments"])
def test_fuzz_special_names_in_dict_keys_stay_text(where: str) -> None:
    injected = {"<|im_end|>": 1, "<|im_system|>": 2}
    if where == "tool_parameters":
        messages = [{"role": "user", "content": "hi"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": injected}}]
    else:
        call = {"type": "function", "function": {"name": "f", "arguments": injected}}
        messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
        tools = None
    ids = encode_chat(TOK, messages, tools, add_generation_prompt=False)
    assert ids.count(IM_END) == len(messages) + (1 if tools else 0)
    assert ids.count(TOK.special_ids["<|im_system|>"]) == (1 if tools else 0)


@FUZZ
@given(messages=st.lists(wild_message, max_size=4), tools=st.one_of(st.none(), st.lists(anything, max_size=2)),
       gen=st.booleans())
def test_fuzz_encode_chat_arbitrary_messages_typed_errors(messages: list[Any], tools: Any, gen: bool) -> None:
    try:
        ids = encode_chat(TOK, messages, tools, add_generation_prompt=gen)
    except ChatTemplateError:
        return
    assert all(0 <= i < TOK.vocab_size for i in ids)


@pytest.mark.parametrize("where", ["content", "tool_call_id", "tool_parameters"])
def test_fuzz_lone_surrogate_is_a_value_error(where: str) -> None:
    # Not a ChatTemplateError: the tokenizer's UnicodeEncodeError (a ValueError, so the server answers 400).
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": "c", "content": "x"}]
    tools = None
    if where == "tool_parameters":
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"\ud800": 1}}}]
    else:
        messages[0][where] = "a\ud800b"
    with pytest.raises(ValueError):
        encode_chat(TOK, messages, tools)


def _collect(events: list[Any]) -> tuple[str, list[ToolCall]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if isinstance(e, ToolCall)]


envelope_text = st.lists(st.one_of(
    text, st.sampled_from(MARKERS), st.sampled_from(["functions.read_file:0", "x:1", '{"a": 1}', "[1]", "{", " "]),
), max_size=12).map("".join)


@FUZZ
@given(output=envelope_text)
def test_fuzz_parse_assistant_output_never_raises(output: str) -> None:
    parsed = parse_assistant_output(output)
    assert all(isinstance(e, ToolCallParseError) for e in parsed.errors)
    assert not any(m in parsed.content for m in MARKERS), parsed.content
    for call in parsed.tool_calls:
        assert call.function.name
        assert isinstance(json.loads(call.function.arguments), dict)


@FUZZ
@given(output=envelope_text, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_fuzz_stream_parser_split_anywhere_equals_whole(output: str, cuts: list[int]) -> None:
    whole = parse_assistant_output(output)
    points = sorted({c % (len(output) + 1) for c in cuts})
    parser = ToolCallStreamParser()
    events: list[Any] = []
    prev = 0
    for p in [*points, len(output)]:
        events += parser.feed(output[prev:p])
        prev = p
    events += parser.finish()
    content, calls = _collect(events)
    assert content == whole.content
    assert calls == whole.tool_calls
    # Problems are the same; their count may differ (stray text between calls is reported per fed piece).
    assert {e.reason for e in parser.errors} == {e.reason for e in whole.errors}


@FUZZ
@given(ids=st.lists(st.integers(min_value=0, max_value=TOK.vocab_size - 1), max_size=60))
def test_fuzz_parse_token_ids_never_raises(ids: list[int]) -> None:
    parsed = parse_assistant_output(ids, TOK)
    assert not any(m in parsed.content for m in MARKERS if "<|" in m) or any(
        m.encode() in bytes(i for i in ids if i < 256) for m in MARKERS)
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)


@FUZZ
@given(marker=text)
def test_fuzz_feed_marker_rejects_non_markers_with_value_error(marker: str) -> None:
    parser = ToolCallStreamParser()
    try:
        parser.feed_marker(marker)
    except ValueError:
        assert marker not in MARKERS


@pytest.mark.parametrize("calls", [1, "x", {"a": 1}, False, ""], ids=repr)
def test_tool_calls_that_are_not_a_list_are_a_typed_error(calls):
    """Found by the fuzzer above: ``{"role": "system", "tool_calls": 1}`` raised a bare TypeError."""
    with pytest.raises(ChatTemplateError, match="tool_calls must be a list"):
        encode_chat(TOK, [{"role": "system", "tool_calls": calls}], None, add_generation_prompt=False)
