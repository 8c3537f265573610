"""``encode_chat`` under the built-in template: messages rendered and encoded one by one, their ids kept in
``Tokenizer.message_cache``; every conversation encodes to the ids of the whole of it rendered at once."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_sessions.tokenizer import (
    ByteTokenizer,
    ChatTemplate,
    ChatTemplateError,
    Tokenizer,
    ToolCall,
    builtin_template,
    encode_chat,
    encode_chat_delta,
    encode_chat_turn,
    load_tokenizer,
)
from kda_sessions.tokenizer.chat import BUILTIN_TEMPLATE, CHAT_SPECIALS

from .helpers import CountingBytes, write_hf_tokenizer

TPL = builtin_template()
SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

# contents full of special names, the template's escape character, their pieces and JSON-ish punctuation
text = st.lists(
    st.one_of(
        st.text(max_size=10),
        st.sampled_from([*CHAT_SPECIALS, "<|bos|>", "\ue000", "<|", "|>", "{", "}", "## Return of ", "\n"]),
    ),
    max_size=6,
).map("".join)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1.5]), text)
json_value = st.recursive(
    json_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
tool_call = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": text, "arguments": st.one_of(text, st.dictionaries(text, json_value, max_size=3))})},
    optional={"id": text},
)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                           "content": st.one_of(text, st.none())}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(text, st.none())},
                          optional={"tool_calls": st.lists(tool_call, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": text, "content": text},
                          optional={"name": text}),
)
# a conversation that repeats some of its messages (the same text sent twice, a retried tool call)
conversation = st.lists(message, max_size=6).flatmap(
    lambda ms: st.lists(st.sampled_from(ms), max_size=3).map(lambda again: ms + again) if ms else st.just(ms)
)
function = st.fixed_dictionaries({"name": text, "description": text})
tools = st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": function}),
                             max_size=2)
# anything JSON can hold where a message has fields
roles = st.sampled_from(["system", "user", "assistant", "tool"])
wild_message = st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "tool_call_id"]),
                               st.one_of(json_value, roles), max_size=4)


class NoSegmentCache(ByteTokenizer):
    SEGMENT_CACHE_MIN_CHARS = 1 << 62


@pytest.fixture(scope="module", params=["bytes", "hf"])
def tokenizers(request, tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    """(the tokenizer under test, a second one whose ids are the reference: no cache of any kind)."""
    if request.param == "bytes":
        return ByteTokenizer(), NoSegmentCache()
    directory = write_hf_tokenizer(tmp_path_factory.mktemp("hf"))
    tok, ref = load_tokenizer(directory), load_tokenizer(directory)
    tok.SEGMENT_CACHE_MIN_CHARS = 8  # short enough that hypothesis' texts go through the segment cache too
    ref.SEGMENT_CACHE_MIN_CHARS = 1 << 62
    return tok, ref


def whole(tok: Tokenizer, messages: list[Any], tools: Any = None, gen: bool = True) -> list[int]:
    """The reference: the whole conversation rendered at once, every piece through the tokenizer."""
    return tok.encode_segments(TPL.render_segments(messages, tools, add_generation_prompt=gen))


@SETTINGS
@given(history=conversation, new=conversation, tools=tools, gen=st.booleans(), edit=text, data=st.data())
def test_resent_conversations_encode_as_rendered_whole(tokenizers, history, new, tools, gen, edit, data):
    """The first request, the same history resent with new messages, then with one earlier message edited."""
    tok, ref = tokenizers
    scope = data.draw(st.sampled_from([None, "acme"]))
    requests = [history, history + new]
    if history:
        i = data.draw(st.integers(0, len(history) - 1))
        edited = {**history[i], "content": edit}
        requests.append([*history[:i], edited, *history[i + 1 :], *new])
    for messages in requests:
        assert encode_chat(tok, messages, tools, add_generation_prompt=gen, scope=scope) == whole(
            ref, messages, tools, gen
        )


def test_a_resent_history_renders_and_encodes_only_new_messages():
    class Counting(CountingBytes):
        SEGMENT_CACHE_MIN_CHARS = NoSegmentCache.SEGMENT_CACHE_MIN_CHARS

    tok = Counting()
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "read a.py"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c0", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]},
               {"role": "tool", "tool_call_id": "c0", "content": "print(1)"}]
    encode_chat(tok, history)
    tok.encoded.clear()
    new = {"role": "user", "content": "thanks"}
    assert encode_chat(tok, [*history, new]) == whole(NoSegmentCache(), [*history, new])
    assert tok.encoded == ["user", "thanks", "assistant"]  # the new message's pieces, the generation prompt's
    assert tok.message_cache.hits == len(history) and len(tok.message_cache) == len(history) + 1


@SETTINGS
@given(new=conversation, data=st.data())
def test_a_session_turn_encodes_as_its_delta_and_fills_the_cache(tokenizers, new, data):
    """``encode_chat_turn`` under the built-in template: the body and the body with the generation prompt are the
    ids of the delta rendered at once (``encode_chat_delta`` of a reference tokenizer without caches), and each
    new message's ids are kept, so a stateless request resending them after the turn hits the cache."""
    tok, ref = tokenizers
    scope = data.draw(st.sampled_from([None, "acme"]))
    body, full = encode_chat_turn(tok, new, scope=scope)
    assert body == encode_chat_delta(ref, new, add_generation_prompt=False)
    assert full == encode_chat_delta(ref, new, add_generation_prompt=True)
    hits = tok.message_cache.hits
    assert encode_chat(tok, new, scope=scope) == full
    assert tok.message_cache.hits - hits == len(new)


class Offset(ByteTokenizer):
    """Byte ids moved past CPython's cached small ints (every encode makes new int objects)."""

    @property
    def vocab_size(self) -> int:
        return 2000

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return [i + 1000 for i in super().encode(text, allow_special=allow_special)]


def test_a_requests_ids_are_the_int_objects_the_next_request_hits():
    """The first request's ids of its messages are the cache's shared int objects, not the tokenizer's new ones:
    the next request (its messages hit) holds the same objects, so the two compare by identity
    (``prefix_index.common_prefix`` of a resent conversation against the session that served it). Long plain
    pieces of a checkpoint template's render likewise (``segment_cache``)."""
    tok = Offset()
    msgs = [{"role": "system", "content": "sys " * 20}, {"role": "user", "content": "read a.py " * 30}]
    first = encode_chat(tok, msgs, add_generation_prompt=False)
    second = encode_chat(tok, [*msgs, {"role": "user", "content": "more"}], add_generation_prompt=False)
    assert second[: len(first)] == first and all(a is b for a, b in zip(first, second))
    assert sum(i >= 1000 for i in first) > 200  # the test holds ids that are not small ints
    checkpoint = ChatTemplate(BUILTIN_TEMPLATE, special_tokens=tok.special_ids)
    tok.SEGMENT_CACHE_MIN_CHARS = 16
    whole = encode_chat(tok, msgs, add_generation_prompt=False, template=checkpoint)
    again = encode_chat(tok, msgs, add_generation_prompt=False, template=checkpoint)
    assert again == whole and sum(a is b for a, b in zip(whole, again)) >= len(whole) - 10


@pytest.mark.parametrize("template", ["builtin", "checkpoint"])
def test_encode_chat_appends_to_the_list_it_is_given(template):
    """``out``: the ids go into the caller's list (a session's TokenList), which is returned, equal to a new
    list's ids, under either kind of template."""
    from kda_sessions.sessions.prefix_index import TokenList

    tpl = TPL if template == "builtin" else ChatTemplate(BUILTIN_TEMPLATE, special_tokens=ByteTokenizer().special_ids)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    out = TokenList()
    ids = encode_chat(ByteTokenizer(), messages, template=tpl, out=out)
    assert ids is out and list(out) == encode_chat(ByteTokenizer(), messages, template=tpl)


def test_a_message_first_sent_in_a_session_turn_is_not_encoded_again():
    class Counting(CountingBytes):
        SEGMENT_CACHE_MIN_CHARS = NoSegmentCache.SEGMENT_CACHE_MIN_CHARS

    tok = Counting()
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "read a.py"}]
    encode_chat_turn(tok, first)
    reply = [{"role": "assistant", "content": "done"}]
    encode_chat_turn(tok, [{"role": "user", "content": "go on"}], history=[*first, *reply])
    tok.encoded.clear()
    resent = [*first, *reply, {"role": "user", "content": "go on"}]
    assert encode_chat(tok, resent) == whole(NoSegmentCache(), resent)
    assert tok.encoded == ["assistant", "done", "assistant"]  # the reply (never sent as a message) and the prompt


@pytest.mark.parametrize(
    "a, b",
    [(True, 1), (1, 1.0), (0.0, -0.0), ("1", 1), (None, "null"), ([1], {"0": 1}),
     ({"x": 1, "y": 2}, {"y": 2, "x": 1})],
    ids=["bool-int", "int-float", "signed-zero", "str-int", "none-str", "list-dict", "key-order"],
)
def test_equal_python_values_that_render_apart_are_cached_apart(a, b):
    """``True == 1``, ``1 == 1.0``, ``0.0 == -0.0``, dicts in another order: ``tojson`` writes each apart."""
    tok = ByteTokenizer()

    def call(arguments: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"v": arguments}}}]}

    for value in (a, b, a, b):
        assert encode_chat(tok, [call(value)]) == whole(NoSegmentCache(), [call(value)])
    assert len(tok.message_cache) == 2 and tok.message_cache.hits == 2


def test_messages_of_other_types_are_rendered_every_time():
    tok = ByteTokenizer()
    call = ToolCall(id="c0", function={"name": "f", "arguments": "{}"})
    messages = [{"role": "assistant", "content": "x", "tool_calls": [call]},  # a pydantic model inside
                {"role": "user", "content": ("a tuple",)}]
    for _ in range(2):
        with pytest.raises(ChatTemplateError):
            encode_chat(tok, messages)
    assert encode_chat(tok, messages[:1]) == encode_chat(tok, messages[:1]) == whole(tok, messages[:1])
    assert len(tok.message_cache) == 0


def test_tenants_messages_are_kept_apart():
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "hello"}]
    encode_chat(tok, messages, scope="acme")
    encode_chat(tok, messages, scope="globex")
    assert tok.message_cache.hits == 0 and len(tok.message_cache) == 2
    encode_chat(tok, messages, scope="acme")
    assert tok.message_cache.hits == 1


def test_the_cache_holds_at_most_its_bound_of_ids():
    class Small(ByteTokenizer):
        MESSAGE_CACHE_TOKENS = 100

    tok = Small()
    messages = [{"role": "user", "content": f"message {i}"} for i in range(50)]
    for n in (10, 50, 50):
        assert encode_chat(tok, messages[:n]) == whole(tok, messages[:n])
        assert 0 < tok.message_cache.tokens <= 100


@SETTINGS
@given(messages=st.lists(st.one_of(message, wild_message), max_size=4),
       tools=st.one_of(tools, st.lists(json_value, max_size=2)), gen=st.booleans())
def test_bad_conversations_fail_as_rendered_whole(messages, tools, gen):
    """The same error (type and text) as rendering the whole conversation, whichever messages are cached."""
    tok = ByteTokenizer()
    for m in messages:  # what can be cached is, so the second call checks only the others
        with contextlib.suppress(ChatTemplateError, TypeError, ValueError):
            encode_chat(tok, [m])
    for _ in range(2):
        outcomes = []
        for encode in (lambda: encode_chat(tok, messages, tools, add_generation_prompt=gen),
                       lambda: whole(NoSegmentCache(), messages, tools, gen)):
            try:
                outcomes.append(encode())
            except (ChatTemplateError, TypeError, ValueError) as e:
                outcomes.append((type(e), str(e)))
        assert outcomes[0] == outcomes[1]


def test_only_the_builtin_template_renders_apart():
    assert TPL.renders_apart
    assert not ChatTemplate(BUILTIN_TEMPLATE, special_tokens=CHAT_SPECIALS).renders_apart  # a checkpoint's
    assert not ChatTemplate(special_tokens=[*CHAT_SPECIALS, "|><|"]).renders_apart  # could span two messages
    with pytest.raises(ChatTemplateError, match="whole conversations"):
        ChatTemplate(BUILTIN_TEMPLATE).render_apart([], add_generation_prompt=False)


async def test_engine_stats_count_the_messages_a_resent_history_reuses():
    import kda_sessions as ks

    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"}]
    async with await ks.Engine.open(store="memory:") as eng:
        tenant = await eng.for_tenant("acme")
        await tenant.create_session_from_messages(history)
        await tenant.create_session_from_messages([*history, {"role": "user", "content": "more"}])
        stats = eng.stats()
        assert stats["message_cache_hits"] == len(history)
        assert stats["message_cache_messages"] == len(history) + 1
        assert stats["message_cache_tokens"] == eng.tokenizer.message_cache.tokens > 0
