"""The tokenizer contract every backend (byte, tokenizer.json, tiktoken) fulfils.

Special tokens are control tokens (role markers, end of turn, tool-call envelope). They are only produced
from text when the caller says so (`allow_special=True`, used for template text), never from user content.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from functools import cached_property
from operator import itemgetter
from typing import NamedTuple


class Segment(NamedTuple):
    """A piece of rendered chat text: a special token name (is_special) or plain text encoded as is."""

    text: str
    is_special: bool


class IdCache:
    """Token ids by (scope, key), the least recently used dropped past ``max_tokens`` ids: the tokenizer's
    caches of long plain pieces (``Tokenizer.segment_cache``) and of whole chat messages (``message_cache``).

    A client that resends its whole conversation every request (the OpenAI API) sends the same messages
    each time, so only new ones need the chat template and the tokenizer. The scope (the sessions' tenant)
    keeps one tenant from timing whether another sent a text, as the prefix index does. Ids are kept as tuples
    of ``id_objects`` (one int object per id value, shared): 8 bytes an id, and a hit extends the request's
    list without making an int object per id (a million from a 4-byte array: ~30 ms on a 2-core VM).
    Thread-safe."""

    def __init__(self, max_tokens: int, id_objects: tuple[int, ...]) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self._id_objects = id_objects
        self._ids: OrderedDict[tuple[Hashable, Hashable], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Hashable, Hashable]) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                self.hits += 1
            return ids

    def put(self, key: tuple[Hashable, Hashable], ids: list[int]) -> Sequence[int]:
        """Keeps ``ids`` under ``key``; returns what it keeps (the same ids, as ``id_objects``), or ``ids`` where
        they are more than it holds. A caller that uses the returned ids gives a request's list the same int
        objects as the next request's hits: the two compare by identity (``prefix_index.common_prefix``: at 1M
        ids ~6 ms against ~14 by value)."""
        if len(ids) > self.max_tokens:
            return ids
        kept = self._shared(ids)
        with self._lock:
            old = self._ids.pop(key, None)
            self.tokens += len(kept) - (len(old) if old is not None else 0)
            self._ids[key] = kept
            while self.tokens > self.max_tokens:
                _, dropped = self._ids.popitem(last=False)
                self.tokens -= len(dropped)
        return kept

    def _shared(self, ids: list[int]) -> tuple[int, ...]:
        # kept as they came: one id (itemgetter gives no tuple), a negative one (it would index from the end)
        if len(ids) < 2 or min(ids) < 0:
            return tuple(ids)
        try:
            return itemgetter(*ids)(self._id_objects)
        except IndexError:  # an id past the table
            return tuple(ids)

    def __len__(self) -> int:
        return len(self._ids)


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses fill `special_ids` and `eos_ids` in their constructor."""

    special_ids: dict[str, int]
    eos_ids: set[int]

    SEGMENT_CACHE_MIN_CHARS = 512
    """Plain pieces of template output this long or longer are cached by ``encode_segments``."""
    SEGMENT_CACHE_TOKENS = 1 << 22
    """The most ids ``segment_cache`` holds (8 bytes each, with their text: ~48 MB at 4 characters an id)."""
    MESSAGE_CACHE_TOKENS = 1 << 22
    """The most ids ``message_cache`` holds (8 bytes each, with their messages: ~48 MB at 4 characters
    an id)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover (base vocabulary plus specials)."""

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of `text`. Special-token strings map to their ids only with `allow_special=True`."""

    @abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; specials appear as their names unless `skip_special`. Invalid UTF-8 becomes U+FFFD."""

    # ---- specials -------------------------------------------------------------------------------------

    @cached_property
    def special_names(self) -> dict[int, str]:
        return {i: name for name, i in self.special_ids.items()}

    def token_to_id(self, name: str) -> int:
        """Id of the special token `name`; KeyError naming it when the tokenizer has no such token."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise KeyError(f"tokenizer has no special token {name!r}") from None

    def id_to_token(self, token_id: int) -> str:
        """Name of the special token `token_id`; KeyError when it is not a special id."""
        try:
            return self.special_names[token_id]
        except KeyError:
            raise KeyError(f"token id {token_id} is not a special token") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_names

    @cached_property
    def special_pattern(self) -> re.Pattern[str] | None:
        """Regex matching any special name, longest first (so `<|a|>` never shadows `<|a|>b`)."""
        if not self.special_ids:
            return None
        names = sorted(self.special_ids, key=len, reverse=True)
        return re.compile("|".join(re.escape(n) for n in names))

    # ---- helpers built on the primitives -------------------------------------------------------------

    BATCH_MIN_CHARS = 1 << 16
    """Plain text to encode in one ``encode_segments`` call from which its pieces go to ``encode_plain_batch``
    together (a long conversation's first request); below it, one by one (a turn's few short pieces)."""

    def encode_plain_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode(t, allow_special=False)`` of each text; tokenizers that can encode on several threads at once
        override it."""
        return [self.encode(t, allow_special=False) for t in texts]

    def encode_segments(self, segments: Iterable[Segment], *, scope: Hashable = None) -> list[int]:
        """Encode template output: specials by id, plain text with `allow_special=False` (not injectable). Long
        plain pieces go through ``segment_cache`` under ``scope`` (the tenant); the pieces to encode go to
        ``encode_plain_batch`` together when they hold ``BATCH_MIN_CHARS`` or more."""
        return self.encode_segment_groups([segments], scope=scope)[0]

    def encode_segment_groups(
        self, groups: Sequence[Iterable[Segment]], *, scope: Hashable = None
    ) -> list[list[int]]:
        """``encode_segments`` of each group, the pieces of all of them encoded together (a conversation's
        messages on its first request)."""
        cache = self.segment_cache
        parts: list[list[Sequence[int]]] = []  # each group's segments' ids; empty until encoded for ``todo``'s
        todo: list[str] = []
        slots: list[tuple[int, int, tuple[Hashable, str] | None]] = []  # (group, segment) of each of ``todo``
        for g, segments in enumerate(groups):
            group: list[Sequence[int]] = []
            for seg in segments:
                if seg.is_special:
                    group.append((self.token_to_id(seg.text),))
                    continue
                key = (scope, seg.text) if len(seg.text) >= self.SEGMENT_CACHE_MIN_CHARS else None
                hit = cache.get(key) if key is not None else None
                if hit is not None:
                    group.append(hit)
                elif seg.text:
                    slots.append((g, len(group), key))
                    todo.append(seg.text)
                    group.append(())
            parts.append(group)
        if sum(map(len, todo)) >= self.BATCH_MIN_CHARS:
            encoded = self.encode_plain_batch(todo)
        else:
            encoded = [self.encode(t, allow_special=False) for t in todo]
        for (g, i, key), new in zip(slots, encoded):
            parts[g][i] = cache.put(key, new) if key is not None else new
        out = []
        for group in parts:
            ids: list[int] = []
            for part in group:
                ids.extend(part)
            out.append(ids)
        return out

    @cached_property
    def segment_cache(self) -> IdCache:
        """``encode_segments``' ids of long plain pieces, by (scope, text)."""
        return IdCache(self.SEGMENT_CACHE_TOKENS, self._id_objects)

    @cached_property
    def message_cache(self) -> IdCache:
        """``encode_chat``'s ids of whole messages, each rendered alone (the built-in template), by
        (scope, message)."""
        return IdCache(self.MESSAGE_CACHE_TOKENS, self._id_objects)

    @cached_property
    def _id_objects(self) -> tuple[int, ...]:
        """One int object per id, shared by the caches' ids."""
        return tuple(range(self.vocab_size))

    def split_specials(self, text: str) -> list[Segment]:
        """Split text at literal special names: the inverse of rendering segments to a string."""
        pattern = self.special_pattern
        if pattern is None:
            return [Segment(text, False)] if text else []
        out: list[Segment] = []
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                out.append(Segment(text[pos : m.start()], False))
            out.append(Segment(m.group(), True))
            pos = m.end()
        if pos < len(text):
            out.append(Segment(text[pos:], False))
        return out

    def incremental_decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special=skip_special)


class IncrementalDecoder:
    """Feed ids one at a time; get back only new, complete text.

    Text is held back while the decoded tail ends in U+FFFD (an unfinished UTF-8 sequence split across
    byte-level tokens), so no half character is ever emitted. Decoding a small window of recent ids rather than
    the last id alone keeps tokenizers whose decoders look at neighbours (leading-space rules) right.
    """

    # A UTF-8 character spans at most 4 bytes; a few more ids allow for multi-byte BPE pieces. Past this, the
    # replacement character is real (invalid bytes) and is emitted rather than stalling the stream.
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this have been emitted

    def feed(self, token_id: int) -> str:
        """Text newly completed by `token_id` (often "", while a character is still incomplete)."""
        if self.tokenizer.is_special(token_id):
            # Specials are never part of a character: flush what is pending, then the special itself.
            text = self.flush()
            return text if self.skip_special else text + self.tokenizer.id_to_token(token_id)
        self._ids.append(token_id)
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self.tokenizer.decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if full_text.endswith("\ufffd") and pending < self.MAX_PENDING:
            return ""
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a token that decodes to nothing on its own
        new = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def flush(self) -> str:
        """Whatever is pending, incomplete characters as U+FFFD; resets the window."""
        if self._read == len(self._ids):
            self._reset()
            return ""
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self.tokenizer.decode(self._ids[self._prefix :])
        self._reset()
        return full_text[len(prefix_text) :]

    def _reset(self) -> None:
        self._ids.clear()
        self._prefix = self._read = 0
