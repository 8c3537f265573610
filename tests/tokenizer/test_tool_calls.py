import pytest

from kda_sessions.tokenizer import (
    ByteTokenizer,
    ContentDelta,
    ToolCall,
    ToolCallParseError,
    ToolCallStreamParser,
    parse_assistant_output,
)
from kda_sessions.tokenizer.tool_calls import MARKERS

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(call_id, args):
    return f"{CB}{call_id}{AB}{args}{CE}"


READ_ARGS = '{"path": "a.py"}'
GREP_ARGS = '{"pattern": "def ", "dir": "src"}'
ONE = "Let me look." + SB + call("functions.read_file:0", READ_ARGS) + SE
SEVERAL = (
    "Two things."
    + SB
    + call("functions.read_file:0", READ_ARGS)
    + "\n "
    + call("functions.grep:1", GREP_ARGS)
    + SE
)


def test_one_call():
    out = parse_assistant_output(ONE)
    assert out.content == "Let me look."
    assert out.errors == []
    [c] = out.tool_calls
    assert c == ToolCall(
        id="functions.read_file:0", function={"name": "read_file", "arguments": '{"path": "a.py"}'}
    )
    assert c.type == "function"


def test_several_calls():
    out = parse_assistant_output(SEVERAL)
    assert out.content == "Two things."
    assert [(c.id, c.function.name) for c in out.tool_calls] == [
        ("functions.read_file:0", "read_file"),
        ("functions.grep:1", "grep"),
    ]
    assert out.errors == []


def test_plain_text_and_bare_ids():
    assert parse_assistant_output("just text").tool_calls == []
    out = parse_assistant_output(f"{SB}{call('ls', '{}')}{SE}")
    assert out.tool_calls[0].function.name == "ls" and out.tool_calls[0].id == "ls"
    # a call without its section is accepted, content continues after it
    out = parse_assistant_output(f"a{call('functions.ls:3', '{}')}b")
    assert (out.content, out.tool_calls[0].function.name, out.errors) == ("ab", "ls", [])


MALFORMED = {
    "unterminated-section": (
        f"pre{SB}{call('functions.a:0', '{}')}",
        "pre",
        ["a"],
        "unterminated tool-call section",
    ),
    "unterminated-call": (f"pre{SB}{CB}functions.a:0{AB}" + '{"x": 1', "pre", [], "unterminated tool call"),
    "args-not-json": (
        f"pre{SB}{call('functions.a:0', '{oops')}{call('functions.b:1', '{}')}{SE}",
        "pre",
        ["b"],
        "not JSON",
    ),
    "args-not-object": (f"pre{SB}{call('functions.a:0', '[1]')}{SE}", "pre", [], "not a JSON object"),
    "no-arguments": (f"pre{SB}{CB}functions.a:0{CE}{SE}", "pre", [], "without arguments"),
    "no-name": (f"pre{SB}{call('', '{}')}{SE}post", "prepost", [], "without a function name"),
    "stray-end": (f"pre{SE}post{CE}", "prepost", [], "without a section"),
    "section-cut-mid-call": (
        f"pre{SB}{CB}functions.a:0{AB}{{}}{SE}post",
        "prepost",
        [],
        "unterminated tool call",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed(name):
    text, content, names, reason = MALFORMED[name]
    out = parse_assistant_output(text)
    assert out.content == content
    assert [c.function.name for c in out.tool_calls] == names
    assert out.errors and all(isinstance(e, ToolCallParseError) for e in out.errors)
    assert any(reason in e.reason for e in out.errors), out.errors
    for marker in MARKERS:
        assert marker not in out.content


def _stream(chunks):
    parser = ToolCallStreamParser()
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return content, calls, [str(e) for e in parser.errors], events


CASES = {
    "one": ONE,
    "several": SEVERAL,
    "text": "no calls, but a <| and <|tool_ here",
    **{k: v[0] for k, v in MALFORMED.items()},
}


@pytest.mark.parametrize("name", list(CASES))
def test_stream_split_anywhere_equals_whole(name):
    text = CASES[name]
    whole = parse_assistant_output(text)
    expected = (whole.content, whole.tool_calls, [str(e) for e in whole.errors])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):  # two cuts: every first cut, a spread of second cuts
            content, calls, errors, events = _stream([text[:i], text[i:j], text[j:]])
            assert (content, calls, errors) == expected, (i, j)
            for e in events:
                if isinstance(e, ContentDelta):
                    assert not any(m in e.text for m in MARKERS)
    content, calls, errors, _ = _stream(list(text))  # one character at a time
    assert (content, calls, errors) == expected


def test_stream_emits_calls_as_soon_as_they_close():
    parser = ToolCallStreamParser()
    assert parser.feed("Hi <|tool_calls") == [ContentDelta("Hi ")]
    assert parser.feed("_section_begin|>" + call("functions.a:0", "{}")) == [
        ToolCall(id="functions.a:0", function={"name": "a", "arguments": "{}"})
    ]
    assert parser.feed(SE + "<|im_end|>") == [ContentDelta("<|im_end|>")]
    assert parser.finish() == []


def test_parse_from_ids_uses_real_special_tokens_only():
    tok = ByteTokenizer()
    # the model wrote a marker's text as plain bytes: that is content, not an envelope
    text = f"see {SB} literal"
    ids = tok.encode(text) + tok.encode(ONE, allow_special=True) + [tok.token_to_id("<|im_end|>")]
    out = parse_assistant_output(ids, tok)
    assert out.content == text + "Let me look."
    assert [c.id for c in out.tool_calls] == ["functions.read_file:0"]
    with pytest.raises(ValueError, match="tokenizer"):
        parse_assistant_output(ids)
