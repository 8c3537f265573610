"""Chat template: OpenAI-style messages (+ tools) to text and ids, whole or as a delta.

The checkpoint's Jinja `chat_template` is used when it has one, else the built-in template in Kimi's format:

    <|im_system|>tool_declare<|im_middle|>{tools json}<|im_end|>            (when tools are given)
    <|im_system|>system<|im_middle|>{content}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json}<|tool_call_end|>...
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\n{content}<|im_end|>
    add_generation_prompt: <|im_assistant|>assistant<|im_middle|>

Message contents can never become special tokens: before rendering, every special name inside a message or
tool string is broken with an escape character, the rendered text is split at the specials that remain (the
template's own) and the escape is undone inside the plain segments, which are then encoded as plain text.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kda_sessions.errors import ChatTemplateError
from kda_sessions.tokenizer.base import Segment, Tokenizer
from kda_sessions.tokenizer.checkpoint_files import END_OF_TURN, read_tokenizer_config, token_content
from kda_sessions.tokenizer.loader import BUILTIN_NAMES

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]

ROLES = ("system", "user", "assistant", "tool")
PREPARED_CACHE_CHARS = 1 << 24
"""The most content characters of history messages a checkpoint template keeps prepared (``render_deltas``):
a few 1M-token conversations (~4 characters a token)."""
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
# The specials the built-in template emits; only these are split out of its output.
CHAT_SPECIALS = (
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

# Whitespace control on every tag: the output is exactly the literal pieces, no stray newlines.
BUILTIN_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>{{ message.content or '' }}"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>{{ message.content or '' }}"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ message.content or '' }}"
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>"
    "{{ call.id or ('functions.' ~ call.function.name ~ ':' ~ loop.index0) }}<|tool_call_argument_begin|>"
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "## Return of {{ message.tool_call_id }}{{ '\\n' }}{{ message.content or '' }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ message.role) }}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Private-use character: inserted after the first character of a special name found in content, doubled
# when content holds it literally. Undone in plain segments after splitting.
_ESC = "\ue000"
_UNESCAPE = re.compile(_ESC + "(.)", re.DOTALL)


class ChatTemplate:
    """Renders messages to text or segments. `source=None` is the built-in (Kimi-format) template."""

    def __init__(
        self,
        source: str | None = None,
        *,
        special_tokens: Iterable[str] = CHAT_SPECIALS,
        bos_token: str = "",
        eos_token: str = "",
        end_of_turn: str = END_OF_TURN,
    ) -> None:
        self.is_builtin = source is None
        self.source = BUILTIN_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        #: Text that closes an assistant turn: the engine appends it after a reply that stopped on eos
        #: (the eos token itself is that text in Kimi's format) or was cut off.
        self.end_of_turn = end_of_turn
        #: Text that opens an assistant turn (what add_generation_prompt appends, built-in template).
        self.generation_prompt = GENERATION_PROMPT
        names = sorted(set(special_tokens), key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self._longest_special = max(map(len, names), default=0)
        self._escape_re = re.compile("|".join([re.escape(_ESC), *(re.escape(n) for n in names)]))
        self._escape_starts = tuple(sorted({_ESC, *(n[:2] for n in names)}))
        """What a string must hold for the escape to change it: the escape character or a special's first two."""
        #: Whether ``render_apart`` may render messages one by one. The built-in template renders each
        #: message alone (and the tools' declaration) ending with ``<|im_end|>``; when every special is
        #: ``<|...|>`` with no ``|>`` inside, none can span the ``|><|`` between two parts, so the split of
        #: the whole conversation is the parts' splits in turn.
        self.renders_apart = (
            source is None
            and END_OF_TURN in names
            and all(n.startswith("<|") and n.endswith("|>") and "|>" not in n[:-2] for n in names)
        )
        self._prepared: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()  # a message, its content's size
        self._prepared_chars = 0
        self._prepared_lock = threading.Lock()
        try:
            self._template = _environment().from_string(self.source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat_template does not compile: {e}") from e

    # ---- rendering ----------------------------------------------------------------------------------

    def render_segments(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool,
        scope: Hashable = None,
    ) -> list[Segment]:
        """The conversation as (text, is_special) pieces; specials only where the template put them. A checkpoint
        template takes the messages it has prepared before under ``scope`` (the tenant; ``render_deltas``)."""
        if self.is_builtin:
            return self._split(self._render_raw(messages, tools, add_generation_prompt))
        prepared = self._prepare_kept(messages, scope)
        return self._split(self._render_prepared(prepared, self._prepare_tools(tools), add_generation_prompt))

    def render_messages(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, *, add_generation_prompt: bool
    ) -> str:
        """The conversation as text (specials written out; for display and golden tests)."""
        return _join(self.render_segments(messages, tools, add_generation_prompt=add_generation_prompt))

    def render_apart(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool,
        skip: Container[int] = (),
    ) -> list[list[Segment]]:
        """``render_segments`` in ``len(messages) + 2`` parts whose concatenation it is: the tools'
        declaration, each message rendered alone, the generation prompt (a part is empty where there is
        nothing). A message whose index is in ``skip`` is neither checked nor rendered (its part is empty):
        the caller has its pieces. Only where ``renders_apart`` (the built-in template), else
        ChatTemplateError."""
        if not self.renders_apart:
            raise ChatTemplateError("this chat template renders whole conversations only")
        kept = [i for i in range(len(messages)) if i not in skip]
        # checked, then rendered, in the order render_segments does both: the same input fails the same way
        prepared = self._escape([_normalize(messages[i], i, check=True) for i in kept])
        parts: list[list[Segment]] = [[] for _ in range(len(messages) + 2)]
        parts[0] = self._split(self._render_prepared([], self._prepare_tools(tools), False))
        for i, msg in zip(kept, prepared):
            parts[i + 1] = self._split(self._render_prepared([msg], None, False))
        parts[-1] = self._split(self._render_prepared([], None, add_generation_prompt))
        return parts

    def render_delta_segments(
        self,
        new_messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        history: Sequence[Message] | None = None,
        tools: Sequence[Any] | None = None,
    ) -> list[Segment]:
        """Only `new_messages`, to append to a conversation already rendered without a generation prompt.

        Built-in template: render(a, tools) + render_delta(b) == render(a + b, tools); history is not needed.
        A checkpoint template: `history` (and `tools`) are required; the delta is render(history + new) minus
        render(history), which must end where a special token ends, else ChatTemplateError.
        """
        (delta,) = self.render_deltas(new_messages, (add_generation_prompt,), history=history, tools=tools)
        return delta

    def render_deltas(
        self,
        new_messages: Sequence[Message],
        generation_prompts: Sequence[bool],
        *,
        history: Sequence[Message] | None = None,
        tools: Sequence[Any] | None = None,
        scope: Hashable = None,
    ) -> list[list[Segment]]:
        """``render_delta_segments`` once per ``add_generation_prompt`` in ``generation_prompts``; a checkpoint
        template renders and prepares the history once for all of them (a chat turn takes the delta with and
        without the generation prompt), each message of it prepared once per ``scope`` (the tenant) across
        turns (``PREPARED_CACHE_MESSAGES``)."""
        if self.is_builtin:
            return [self._split(self._render_raw(new_messages, None, gen)) for gen in generation_prompts]
        if history is None:
            raise ChatTemplateError("a checkpoint chat_template renders deltas only given the history")
        # the history prepared once for every render (the sandbox keeps templates from changing it)
        past, tools_seen = self._prepare_kept(history, scope), self._prepare_tools(tools)
        before = self._render_prepared(past, tools_seen, False)
        whole = [*past, *self._prepare(new_messages, len(past))]
        ends: dict[str, bool] = {}
        return [self._delta(before, self._render_prepared(whole, tools_seen, gen), ends) for gen in generation_prompts]

    def _delta(self, before: str, after: str, ends: dict[str, bool] | None = None) -> list[Segment]:
        """The pieces of ``after`` past ``before``, which it must extend at a piece boundary. ``ends``: the answers
        for other texts extending the same ``before``, by the characters past it that a match reaching the
        boundary can see (the scan up to there is the same): a turn scans the history once."""
        if not after.startswith(before):
            raise ChatTemplateError(
                "chat_template is not incremental: history renders differently once extended"
            )
        end = len(before)
        if end == len(after):
            return []
        window = after[end : end + self._longest_special]
        ok = ends.get(window) if ends is not None else None
        if ok is None and end:
            ok = self._ends_a_piece(after, end)
            if ends is not None:
                ends[window] = ok
        if end and not ok:
            raise ChatTemplateError(
                "chat_template is not incremental: the history does not end on a special token"
            )
        # the scan of the whole text has a piece boundary at ``end``, so the tail splits alone as it would there
        return self._split(after[end:])

    def render_delta(
        self,
        new_messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        history: Sequence[Message] | None = None,
        tools: Sequence[Any] | None = None,
    ) -> str:
        return _join(
            self.render_delta_segments(
                new_messages, add_generation_prompt=add_generation_prompt, history=history, tools=tools
            )
        )

    # ---- internals ----------------------------------------------------------------------------------

    def _render_raw(self, messages: Sequence[Message], tools: Sequence[Any] | None, gen: bool) -> str:
        return self._render_prepared(self._prepare(messages), self._prepare_tools(tools), gen)

    def _prepare(self, messages: Sequence[Message], first: int = 0) -> list[Any]:
        """Messages as the template sees them: plain dicts, contents joined, escaped (``first``: the index of
        the first, for errors)."""
        return list(self._escape([_normalize(m, first + i, check=self.is_builtin) for i, m in enumerate(messages)]))

    def _prepare_kept(self, messages: Sequence[Message], scope: Hashable) -> list[Any]:
        """``_prepare(messages)``, each message that is a dict of JSON's types taken from the kept ones by its
        value (``_frozen``) and ``scope``, the others prepared; at most ``PREPARED_CACHE_CHARS`` of contents kept
        (the sandbox keeps templates from changing what is kept)."""
        keys: list[Hashable | None] = []
        for m in messages:
            try:
                keys.append((scope, _frozen(m)) if type(m) is dict else None)
            except (TypeError, RecursionError):
                keys.append(None)
        out: list[Any] = []
        with self._prepared_lock:
            for k in keys:
                hit = self._prepared.get(k) if k is not None else None
                if hit is not None:
                    self._prepared.move_to_end(k)
                out.append(None if hit is None else hit[0])
        missing = [i for i, p in enumerate(out) if p is None]
        fresh = list(self._escape([_normalize(messages[i], i, check=self.is_builtin) for i in missing]))
        with self._prepared_lock:
            for i, p in zip(missing, fresh):
                out[i] = p
                key = keys[i]
                size = 64 + (len(p["content"]) if isinstance(p.get("content"), str) else 0)  # 64: its dict
                if key is None or key in self._prepared or size > PREPARED_CACHE_CHARS:
                    continue
                self._prepared[key] = (p, size)
                self._prepared_chars += size
            while self._prepared_chars > PREPARED_CACHE_CHARS:
                self._prepared_chars -= self._prepared.popitem(last=False)[1][1]
        return out

    @property
    def prepared_messages(self) -> int:
        """History messages kept prepared (``render_deltas``)."""
        return len(self._prepared)

    @property
    def prepared_chars(self) -> int:
        """Their contents' characters (64 more a message), at most ``PREPARED_CACHE_CHARS``."""
        return self._prepared_chars

    def _prepare_tools(self, tools: Sequence[Any] | None) -> Any:
        return self._escape(_deep_sort(_plain(list(tools)))) if tools else None

    def _render_prepared(self, msgs: list[Any], tools: Any, gen: bool) -> str:
        try:
            return self._template.render(
                messages=msgs,
                tools=tools,
                add_generation_prompt=gen,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat_template failed: {e}") from e

    def _escape(self, obj: Any) -> Any:
        if isinstance(obj, str):
            # most contents hold none of ``_escape_starts``: a few ``in`` scans instead of the regex
            for start in self._escape_starts:
                if start in obj:
                    return self._escape_re.sub(_break, obj)
            return obj
        if isinstance(obj, dict):
            return {self._escape(k): self._escape(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._escape(v) for v in obj]
        return obj

    def _ends_a_piece(self, text: str, end: int) -> bool:
        """Whether ``_split(text)`` has a boundary at raw offset ``end`` (0 < end < len(text)): a special's match
        of its scan starts or ends there. Positions are the raw (escaped) text's, not the split pieces'."""
        if self._special_re is None:
            return False
        for m in self._special_re.finditer(text):
            if m.start() >= end:
                return m.start() == end
            if m.end() >= end:
                return m.end() == end
        return False

    def _split(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        if self._special_re is not None:
            for m in self._special_re.finditer(text):
                if m.start() > pos:
                    out.append(Segment(_UNESCAPE.sub(r"\1", text[pos : m.start()]), False))
                out.append(Segment(m.group(), True))
                pos = m.end()
        if pos < len(text):
            out.append(Segment(_UNESCAPE.sub(r"\1", text[pos:]), False))
        return out


def _break(m: re.Match[str]) -> str:
    s = m.group()
    return _ESC + _ESC if s == _ESC else s[0] + _ESC + s[1:]


def _join(segments: Iterable[Segment]) -> str:
    return "".join(s.text for s in segments)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with ``message.content`` on a plain dict looked up as jinja's sandbox does it (the
    dict's attribute first, then its item) but without raising and catching an AttributeError each time: a
    template reads a few fields of every message, and at 1M tokens of history (~800 messages) the exception is
    ~half of a render's time."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:  # no such attribute: the item, or undefined
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # The conventions of Hugging Face chat templates, so checkpoint templates render as they do there.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain(obj: Any) -> Any:
    """pydantic models (e.g. ToolCall) to dicts, recursively; tuples to lists."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _deep_sort(obj: Any) -> Any:
    # Kimi's tokenizer sorts tool schemas' keys before rendering; equal tools then render to equal text.
    if isinstance(obj, dict):
        return {k: _deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_deep_sort(v) for v in obj]
    return obj


def _normalize(message: Message, index: int, *, check: bool) -> dict[str, Any]:
    """A plain dict with `content` a string (OpenAI text parts joined); checked for the built-in template."""
    msg = _plain(message)
    if not isinstance(msg, dict):
        raise ChatTemplateError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ChatTemplateError(f"messages[{index}].content[{j}] must be a text part, got {part!r}")
            texts.append(part["text"])
        msg["content"] = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string, got {type(content).__name__}")
    if check:
        role = msg.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{index}].role must be one of {list(ROLES)}, got {role!r}")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise ChatTemplateError(f"messages[{index}] (role tool) needs a string tool_call_id")
        calls = msg.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ChatTemplateError(f"messages[{index}].tool_calls must be a list, got {type(calls).__name__}")
        for j, call in enumerate(calls or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise ChatTemplateError(
                    f"messages[{index}].tool_calls[{j}] needs function.name, got {call!r}"
                )
    return msg


# ---- loading and encoding ---------------------------------------------------------------------------


def load_chat_template(path_or_name: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
    """The checkpoint's template (`chat_template` in tokenizer_config.json, or chat_template.jinja) when the
    directory has one, else the built-in template."""
    if isinstance(path_or_name, str) and path_or_name in BUILTIN_NAMES:
        return builtin_template()
    directory = Path(path_or_name)
    if directory.is_file():
        directory = directory.parent
    source = _checkpoint_template(directory) if directory.is_dir() else None
    if source is None:
        missing = [n for n in CHAT_SPECIALS if n not in tokenizer.special_ids]
        if missing:
            logger.warning(
                "%s has no chat_template and its tokenizer lacks %s: chat encoding will fail",
                directory,
                missing,
            )
        return builtin_template()
    config = read_tokenizer_config(directory)
    return ChatTemplate(
        source,
        special_tokens=tokenizer.special_ids,
        bos_token=token_content(config.get("bos_token")) or "",
        eos_token=token_content(config.get("eos_token")) or "",
        end_of_turn=END_OF_TURN
        if END_OF_TURN in tokenizer.special_ids
        else token_content(config.get("eos_token")) or END_OF_TURN,
    )


def _checkpoint_template(directory: Path) -> str | None:
    value = read_tokenizer_config(directory).get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = by_name.get("default") or next(iter(by_name.values()), None)
    if isinstance(value, str) and value:
        return value
    jinja_file = directory / "chat_template.jinja"
    return jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None


@lru_cache(maxsize=1)
def builtin_template() -> ChatTemplate:
    return ChatTemplate()


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    template: ChatTemplate | None = None,
    scope: Hashable = None,
    out: list[int] | None = None,
) -> list[int]:
    """Ids of the whole conversation; message contents encoded as plain text (specials not injectable). ``scope``:
    the tenant, whose ids the tokenizer's caches keep apart. ``out``: an empty list to append the ids to and
    return (a list subclass the caller keeps, such as a session's TokenList: no copy of a million ids after);
    by default a new list.

    Under the built-in template (``ChatTemplate.renders_apart``) each message is rendered and encoded alone
    and its ids kept in ``Tokenizer.message_cache``, so a resent history renders only its new messages; under
    a checkpoint's template the whole conversation is rendered, long pieces' ids from ``segment_cache``."""
    template = template or builtin_template()
    if not template.renders_apart:
        segments = template.render_segments(messages, tools, add_generation_prompt=add_generation_prompt, scope=scope)
        ids = tokenizer.encode_segments(segments, scope=scope)
        if out is None:
            return ids
        out.extend(ids)
        return out
    ids, tail = _encode_apart(tokenizer, template, messages, tools, add_generation_prompt, scope, out)
    ids.extend(tail)
    return ids


def _encode_apart(
    tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[Message], tools: Sequence[Any] | None,
    add_generation_prompt: bool, scope: Hashable, out: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Under a template that ``renders_apart``: (the ids of the tools' declaration and of every message, appended
    to ``out`` where given; those of the generation prompt), each message's ids from ``Tokenizer.message_cache``
    or encoded and kept there."""
    cache = tokenizer.message_cache
    keys = [_message_key(template, m) for m in messages]
    found: list[Sequence[int] | None] = [None if key is None else cache.get((scope, key)) for key in keys]
    parts = template.render_apart(
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        skip={i for i, hit in enumerate(found) if hit is not None},
    )
    # the tools, the new messages and the generation prompt encoded together (on threads where the tokenizer can)
    misses = [i for i, hit in enumerate(found) if hit is None]
    head, *new, tail = tokenizer.encode_segment_groups([parts[0], *(parts[i + 1] for i in misses), parts[-1]],
                                                       scope=scope)
    for i, ids_i in zip(misses, new):
        found[i] = cache.put((scope, keys[i]), ids_i) if keys[i] is not None else ids_i
    ids = head if out is None else out
    if out is not None:
        ids.extend(head)
    for hit in found:
        assert hit is not None  # every message's ids by now
        ids.extend(hit)
    return ids, tail


def _message_key(template: ChatTemplate, message: Message) -> Hashable | None:
    """``message`` under ``template`` as a ``message_cache`` key; None (rendered every time) unless it is a
    dict of JSON's types only (what a request's body parses to)."""
    if type(message) is not dict:
        return None
    try:
        return (template, _frozen(message))
    except (TypeError, RecursionError):
        return None


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable equal only to that of the same value with the same types: ``True``, ``1`` and
    ``1.0`` render apart (``tojson``), so scalars keep their type; floats are kept as their repr (``0.0`` and
    ``-0.0`` are equal but render apart); dicts keep their order (``tojson`` does). TypeError for a type that
    JSON does not have."""
    kind = type(value)
    if kind is str or value is None:
        return value
    if kind is dict:
        return ("dict", *[(_frozen(k), _frozen(v)) for k, v in value.items()])
    if kind is list:
        return ("list", *[_frozen(v) for v in value])
    if kind is int or kind is bool:
        return (kind, value)
    if kind is float:
        return (kind, repr(value))
    raise TypeError(f"{kind.__name__} is not a JSON type")


def encode_chat_delta(
    tokenizer: Tokenizer,
    new_messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    template: ChatTemplate | None = None,
    history: Sequence[Message] | None = None,
    tools: Sequence[Any] | None = None,
    scope: Hashable = None,
) -> list[int]:
    """Ids to append for `new_messages` after a conversation that ends with a closed turn; ``scope`` as
    ``encode_chat``'s."""
    template = template or builtin_template()
    return tokenizer.encode_segments(
        template.render_delta_segments(
            new_messages, add_generation_prompt=add_generation_prompt, history=history, tools=tools
        ),
        scope=scope,
    )


def encode_chat_turn(
    tokenizer: Tokenizer,
    new_messages: Sequence[Message],
    *,
    template: ChatTemplate | None = None,
    history: Sequence[Message] | None = None,
    tools: Sequence[Any] | None = None,
    scope: Hashable = None,
) -> tuple[list[int], list[int]]:
    """``encode_chat_delta`` without and with the generation prompt (the turn's body and what it appends), the
    history rendered once for both; ``scope`` as ``encode_chat``'s. Under the built-in template each new message's
    ids go through ``Tokenizer.message_cache``, as ``encode_chat``'s do: a stateless request that resends the
    conversation later encodes none of them again."""
    template = template or builtin_template()
    if template.renders_apart:  # the delta is the new messages alone (no tools: the history declared them)
        body, tail = _encode_apart(tokenizer, template, new_messages, None, True, scope)
        _, no_prompt = _encode_apart(tokenizer, template, (), None, False, scope)
        return [*body, *no_prompt], [*body, *tail]
    body_s, full_s = template.render_deltas(new_messages, (False, True), history=history, tools=tools, scope=scope)
    return tokenizer.encode_segments(body_s, scope=scope), tokenizer.encode_segments(full_s, scope=scope)


def encode_end_of_turn(tokenizer: Tokenizer, template: ChatTemplate | None = None) -> list[int]:
    """Ids of the text that closes an assistant turn (`<|im_end|>` in Kimi's format)."""
    return tokenizer.encode((template or builtin_template()).end_of_turn, allow_special=True)
