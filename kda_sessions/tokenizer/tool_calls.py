"""Tool calls in assistant output (Kimi's envelope, which is also the built-in format), whole or streamed.

    {content}<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>
      ...
    <|tool_calls_section_end|>

Problems never raise: a malformed call is dropped, the content is kept, and a `ToolCallParseError` describing
it is returned alongside, so a server can still answer. Envelope markers never reach the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kda_sessions.errors import ToolCallParseError
from kda_sessions.tokenizer.base import Tokenizer

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
# Kimi call ids: functions.{name}:{index}
_CALL_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", re.DOTALL)


class FunctionCall(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    """An OpenAI-shaped tool call. `id` is the model's own (e.g. `functions.read_file:0`)."""

    model_config = ConfigDict(frozen=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True)
class ContentDelta:
    text: str


StreamEvent = ContentDelta | ToolCall


@dataclass
class ParsedOutput:
    """An assistant reply split into its content and its tool calls, plus what could not be parsed."""

    content: str
    tool_calls: list[ToolCall]
    errors: list[ToolCallParseError] = field(default_factory=list)


class _State(Enum):
    CONTENT = "content"
    SECTION = "section"  # between calls
    HEADER = "header"  # call id
    ARGUMENTS = "arguments"


class ToolCallStreamParser:
    """Feed text deltas (decoded with specials kept); get content deltas and completed tool calls.

    A possible start of a marker at the end of a delta is held back until the next delta decides it, so
    splitting the text anywhere gives the same result as feeding it whole.
    """

    def __init__(self) -> None:
        self.errors: list[ToolCallParseError] = []
        self._buffer = ""
        self._state = _State.CONTENT
        self._explicit_section = False
        self._header = ""
        self._arguments = ""

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        events: list[StreamEvent] = []
        pos = 0
        for m in _MARKER_RE.finditer(self._buffer):
            self._on_text(self._buffer[pos : m.start()], events)
            self._on_marker(m.group(), events)
            pos = m.end()
        rest = self._buffer[pos:]
        hold = _partial_marker_len(rest)
        self._on_text(rest[: len(rest) - hold], events)
        self._buffer = rest[len(rest) - hold :]
        return _merge(events)

    def feed_plain(self, text: str) -> list[StreamEvent]:
        """Text known to hold no markers (decoded from non-special ids): marker strings in it stay text."""
        events = self._flush_buffer()
        self._on_text(text, events)
        return _merge(events)

    def feed_marker(self, marker: str) -> list[StreamEvent]:
        """One envelope marker that arrived as a special token."""
        if marker not in MARKERS:
            raise ValueError(f"{marker!r} is not a tool-call marker; expected one of {list(MARKERS)}")
        events = self._flush_buffer()
        self._on_marker(marker, events)
        return _merge(events)

    def finish(self) -> list[StreamEvent]:
        """End of output: flush held-back text and report an unterminated envelope."""
        events = self._flush_buffer()
        if self._state in (_State.HEADER, _State.ARGUMENTS):
            self._error("unterminated tool call", self._pending_call_text())
        if self._state is not _State.CONTENT and self._explicit_section:
            self._error("unterminated tool-call section")
        self._state = _State.CONTENT
        return _merge(events)

    def _flush_buffer(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self._on_text(self._buffer, events)
        self._buffer = ""
        return events

    # ---- the state machine ---------------------------------------------------------------------------

    def _on_text(self, text: str, events: list[StreamEvent]) -> None:
        if not text:
            return
        if self._state is _State.CONTENT:
            events.append(ContentDelta(text))
        elif self._state is _State.HEADER:
            self._header += text
        elif self._state is _State.ARGUMENTS:
            self._arguments += text
        elif text.strip():
            self._error("text between tool calls ignored", text)

    def _on_marker(self, marker: str, events: list[StreamEvent]) -> None:
        state = self._state
        if marker == SECTION_BEGIN:
            if state is not _State.CONTENT:
                self._error("tool-call section opened twice")
                self._abandon_call()
            self._state, self._explicit_section = _State.SECTION, True
        elif marker == CALL_BEGIN:
            if state is _State.CONTENT:
                self._explicit_section = False  # a call without its section: accepted
            elif state is not _State.SECTION:
                self._abandon_call()
            self._state, self._header, self._arguments = _State.HEADER, "", ""
        elif marker == ARGUMENT_BEGIN:
            if state is _State.HEADER:
                self._state = _State.ARGUMENTS
            else:
                self._error(f"{ARGUMENT_BEGIN} outside a tool call header")
        elif marker == CALL_END:
            if state is _State.ARGUMENTS:
                call = self._complete_call()
                if call is not None:
                    events.append(call)
            elif state is _State.HEADER:
                self._error("tool call without arguments", self._header)
            else:
                self._error(f"{CALL_END} outside a tool call")
            if state in (_State.ARGUMENTS, _State.HEADER):
                self._state = _State.SECTION if self._explicit_section else _State.CONTENT
        else:  # SECTION_END
            if state in (_State.HEADER, _State.ARGUMENTS):
                self._abandon_call()
            elif state is _State.CONTENT:
                self._error(f"{SECTION_END} without a section")
            self._state, self._explicit_section = _State.CONTENT, False

    def _complete_call(self) -> ToolCall | None:
        call_id = self._header.strip()
        arguments = self._arguments.strip()
        m = _CALL_ID_RE.match(call_id)
        if not call_id or m is None:
            self._error("tool call without a function name", self._pending_call_text())
            return None
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            self._error(f"arguments of {call_id} are not JSON ({e.msg})", arguments)
            return None
        if not isinstance(value, dict):
            self._error(f"arguments of {call_id} are not a JSON object", arguments)
            return None
        return ToolCall(id=call_id, function=FunctionCall(name=m.group("name"), arguments=arguments))

    def _abandon_call(self) -> None:
        if self._state in (_State.HEADER, _State.ARGUMENTS):
            self._error("unterminated tool call", self._pending_call_text())

    def _pending_call_text(self) -> str:
        if self._state is _State.ARGUMENTS:
            return self._header + ARGUMENT_BEGIN + self._arguments
        return self._header

    def _error(self, reason: str, raw: str = "") -> None:
        self.errors.append(ToolCallParseError(reason, raw))


def _partial_marker_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    start = max(0, len(text) - max(len(m) for m in MARKERS) + 1)
    for i in range(start, len(text)):
        suffix = text[i:]
        if any(m.startswith(suffix) for m in MARKERS):
            return len(text) - i
    return 0


def _merge(events: list[StreamEvent]) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    for e in events:
        if isinstance(e, ContentDelta) and out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def parse_assistant_output(output: str | Sequence[int], tokenizer: Tokenizer | None = None) -> ParsedOutput:
    """Content and tool calls of a whole reply: text, or ids (then `tokenizer` decodes them, and only real
    special tokens count as envelope markers; end-of-turn tokens are dropped)."""
    parser = ToolCallStreamParser()
    events: list[StreamEvent] = []
    if isinstance(output, str):
        events += parser.feed(output)
    else:
        if tokenizer is None:
            raise ValueError("parse_assistant_output needs the tokenizer to parse token ids")
        for text, is_marker in _id_pieces(output, tokenizer):
            if is_marker:
                events += parser.feed_marker(text)
            else:
                events += parser.feed_plain(text)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return ParsedOutput(content, calls, parser.errors)


def _id_pieces(ids: Sequence[int], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    pieces: list[tuple[str, bool]] = []
    run: list[int] = []
    for i in ids:
        if not tokenizer.is_special(i):
            run.append(i)
            continue
        if run:
            pieces.append((tokenizer.decode(run), False))
            run = []
        name = tokenizer.id_to_token(i)
        if name in MARKERS:
            pieces.append((name, True))
        # other specials (end of turn, padding) are not content
    if run:
        pieces.append((tokenizer.decode(run), False))
    return pieces
