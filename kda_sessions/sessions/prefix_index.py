"""Prefix reuse: per-page token-hash chains -> checkpoints whose state covers that prefix.

As vLLM's block hashes: the key of page k is ``sha256(key of page k-1 + its P tokens)``, so one pass over a
request's tokens gives the key of every page-aligned prefix. A checkpoint of ``tokens[:position]`` is filed under
the key of its last full page (a *node*) plus a hash of the ``r = position mod P`` tokens after it, so
checkpoints at any position (message ends, interval boundaries) are found by the same walk: for each node of the
request that holds entries, try the tail lengths filed there. A new session (or a stateless request that resends
a whole history) starts from the longest indexed prefix of its tokens instead of prefilling it again.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex

ROOT = hashlib.sha256(b"kda-sessions prefix chain v1").digest()
"""The key of the empty prefix."""


@dataclass(frozen=True)
class PrefixHit:
    session_id: str
    checkpoint: str
    position: int


@dataclass(frozen=True)
class PrefixKey:
    """Where a prefix of ``position`` tokens is filed: its last full page's chain key and its own key."""

    node: bytes
    rows: int
    """Tokens after the node's page boundary (0 <= rows < P)."""
    key: bytes

    def to_json(self) -> list[str | int]:
        return [self.node.hex(), self.rows, self.key.hex()]

    @classmethod
    def from_json(cls, value: object) -> PrefixKey | None:
        """The key stored in a manifest, or None when the value is not one (another format: not indexed)."""
        if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], int)):
            return None
        try:
            return cls(bytes.fromhex(str(value[0])), value[1], bytes.fromhex(str(value[2])))
        except ValueError:
            return None


def _link(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("i", tokens).tobytes()).digest()


def page_chain(tokens: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """``chain[k]`` = key of ``tokens[:k * P]`` for k in [0, num_pages] (the caller makes sure the tokens hold
    that many full pages). A ``TokenList``'s from the keys it keeps."""
    if isinstance(tokens, TokenList):
        return tokens.page_chain(page_size, num_pages)
    return _extend(tokens, page_size, num_pages, [ROOT])


def _extend(tokens: Sequence[int], P: int, num_pages: int, chain: list[bytes]) -> list[bytes]:
    for k in range(len(chain) - 1, num_pages):
        chain.append(_link(chain[-1], tokens[k * P : (k + 1) * P]))
    return chain


COMPARE_BLOCK = 1 << 14
"""Ids ``common_prefix`` compares a slice at a time (128 KB of pointers a side: the slices stay in cache)."""


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (at most ``limit``): slices of
    ``COMPARE_BLOCK`` ids compared in C, the first that differs narrowed down 64-fold at a time. One pass, whose
    copies stay in cache: at 1M ids several times faster than comparing two whole slices."""
    end = min(len(a), len(b)) if limit is None else max(0, min(limit, len(a), len(b)))
    i, step = 0, COMPARE_BLOCK
    while i < end:
        j = min(i + step, end)
        if a[i:j] == b[i:j]:
            i = j
        elif step == 1:
            return i
        else:  # the first difference lies in [i, j): look again in smaller slices
            step = max(1, step // 64)
    return end


class TokenList(list[int]):
    """A session's tokens: a list that keeps the page chain of its full pages (``page_chain``) as it grows, so a
    turn hashes only its new pages. Each index, lookup and checkpoint of a turn takes the chain of the whole
    conversation: at 1M tokens 16,384 pages, ~97 ms a chain on a 2-core VM (~12 at 128K), three or more a chat
    turn, all on the event loop. Any change below the end (item assignment, ``del``, insert, pop, remove, clear,
    sort, reverse, ``*=``) drops the keys from the changed page on; append, extend and ``+=`` only add pages.
    Slices and copies are plain lists."""

    __slots__ = ("_chain", "_page_size")

    def __init__(self, tokens: Iterable[int] = (), *, keys: tuple[int, list[bytes]] | None = None) -> None:
        """``keys``: (page size, chain) already known for the tokens' first full pages (``head``), taken as is."""
        super().__init__(tokens)
        self._page_size, self._chain = keys if keys is not None else (0, [ROOT])

    def __reduce__(self) -> tuple[type, tuple[list[int]]]:  # copies start with no keys: none shares this chain
        return TokenList, (list(self),)

    def page_chain(self, page_size: int, num_pages: int) -> list[bytes]:
        """``page_chain(self, page_size, num_pages)``, the keys of full pages kept for the next call."""
        if page_size != self._page_size:
            self._chain, self._page_size = [ROOT], page_size
        kept = min(num_pages, len(self) // page_size)  # only full pages are kept: a partial one changes
        chain = _extend(self, page_size, kept, self._chain)[: kept + 1]
        return _extend(self, page_size, num_pages, chain) if num_pages > kept else chain

    def head(self, n: int) -> TokenList:
        """The first ``n`` tokens as a TokenList that starts with this one's keys of its full pages (a fork's
        tokens: its first index or lookup hashes only what follows)."""
        head = self[:n]
        if not self._page_size:
            return TokenList(head)
        return TokenList(head, keys=(self._page_size, self._chain[: len(head) // self._page_size + 1]))

    def continued_by(self, tokens: list[int], n: int | None = None) -> TokenList | None:
        """``tokens`` as a TokenList that starts with this one's keys of its first ``n`` tokens (all by default),
        where those begin ``tokens`` too (compared once: ``common_prefix``, a million ids in a few ms, against ~50
        ms to hash their pages); else None. A list already made takes the keys in place instead: ``take_keys``."""
        n = self.first_beginning(tokens, (len(self) if n is None else n,))
        return None if n is None else TokenList(tokens, keys=self.keys_of(n))

    @property
    def keeps_keys(self) -> bool:
        """Whether it has taken or computed any page keys (``page_chain``, ``take_keys``)."""
        return self._page_size > 0

    def take_keys(self, other: TokenList, ns: Sequence[int]) -> bool:
        """For a list that keeps no keys yet (``keeps_keys``): where the first n of ``other``'s tokens begin this
        one (n the first of ``ns`` that does, compared once: ``first_beginning``), take ``other``'s keys of their full pages
        in place and return True (no copy of the tokens: only the pages past them are hashed later); else
        False, nothing taken."""
        n = None if self.keeps_keys else other.first_beginning(self, ns)
        if n is None:
            return False
        self._page_size, self._chain = other.keys_of(n)
        return True

    def keys_of(self, n: int) -> tuple[int, list[bytes]]:
        """(page size, the keys kept of the full pages of the first ``n`` tokens), for a list they begin."""
        return self._page_size, self._chain[: n // self._page_size + 1]

    def first_beginning(self, tokens: Sequence[int], ns: Sequence[int]) -> int | None:
        """The first of ``ns`` whose count of this list's first tokens begins ``tokens`` (None where it keeps no
        keys: they are what a caller takes)."""
        fits = [n for n in ns if 0 < n <= min(len(self), len(tokens))]
        if not self._page_size or not fits:
            return None
        common = common_prefix(self, tokens, max(fits))
        return next((n for n in fits if n <= common), None)

    def _changed_from(self, index: int) -> None:
        """Tokens from ``index`` on changed: the keys of the pages holding them go."""
        if self._page_size:
            del self._chain[max(0, index) // self._page_size + 1 :]

    def _lowest(self, i: SupportsIndex | slice) -> int:
        n = len(self)
        if isinstance(i, slice):
            start, stop, _ = i.indices(n)
            return min(start, stop)
        k = operator.index(i)
        return k + n if k < 0 else k

    def __setitem__(self, i: Any, value: Any) -> None:
        self._changed_from(self._lowest(i))
        super().__setitem__(i, value)

    def __delitem__(self, i: SupportsIndex | slice) -> None:
        self._changed_from(self._lowest(i))
        super().__delitem__(i)

    def insert(self, i: SupportsIndex, value: int) -> None:
        self._changed_from(min(self._lowest(i), len(self)))
        super().insert(i, value)

    def pop(self, i: SupportsIndex = -1) -> int:
        if self:
            self._changed_from(self._lowest(i))
        return super().pop(i)

    def remove(self, value: int) -> None:
        if value in self:
            self._changed_from(self.index(value))
        super().remove(value)

    def clear(self) -> None:
        self._changed_from(0)
        super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._changed_from(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._changed_from(0)
        super().reverse()

    def __imul__(self, n: SupportsIndex) -> TokenList:  # type: ignore[misc,override]
        if operator.index(n) < 1:
            self._changed_from(0)
        return super().__imul__(n)  # type: ignore[return-value]


def prefix_key(tokens: Sequence[int], position: int, page_size: int) -> PrefixKey:
    full, rows = divmod(position, page_size)
    node = page_chain(tokens, page_size, full)[-1]
    tail = tokens[full * page_size : position]
    return PrefixKey(node, rows, _link(node, tail) if rows else node)


class PrefixIndex:
    """One tenant's checkpoints by prefix key. Several checkpoints may cover the same prefix (forks, equal
    conversations): each is kept, so removing one leaves the others findable."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._hits: dict[bytes, dict[tuple[str, str], PrefixHit]] = {}
        self._tails: dict[bytes, Counter[int]] = {}  # node -> tail lengths filed under it (entry counts)
        self._keys: dict[tuple[str, str], PrefixKey] = {}  # (session, checkpoint) -> where it is filed

    def add(self, tokens: Sequence[int], hit: PrefixHit) -> None:
        self.add_many(tokens, [hit])

    def add_many(self, tokens: Sequence[int], hits: Sequence[PrefixHit]) -> None:
        """Index checkpoints of one token sequence, its page chain computed once up to the longest (a 128K session
        with a checkpoint every 256 pages hashed 7,000 pages one by one instead of 2,048: 70 ms of a resume)."""
        hits = [h for h in hits if 0 < h.position <= len(tokens)]
        if not hits:
            return
        P = self.page_size
        chain = page_chain(tokens, P, max(h.position for h in hits) // P)
        for h in hits:
            full, rows = divmod(h.position, P)
            node = chain[full]
            self.add_key(PrefixKey(node, rows, _link(node, tokens[full * P : h.position]) if rows else node), h)

    def add_key(self, key: PrefixKey, hit: PrefixHit) -> None:
        """Index a checkpoint by its stored key (no tokens needed: startup indexing)."""
        if hit.position <= 0:
            return
        who = (hit.session_id, hit.checkpoint)
        old = self._keys.get(who)
        if old == key:
            self._hits[key.key][who] = hit
            return
        if old is not None:
            self.remove(*who)
        self._keys[who] = key
        self._hits.setdefault(key.key, {})[who] = hit
        self._tails.setdefault(key.node, Counter())[key.rows] += 1

    def key_of(self, session_id: str, checkpoint: str, position: int) -> PrefixKey | None:
        """Where the checkpoint is filed, if it is, at that position."""
        key = self._keys.get((session_id, checkpoint))
        if key is None or self._hits[key.key][(session_id, checkpoint)].position != position:
            return None
        return key

    def indexed(self, tokens: Sequence[int], positions: Sequence[int]) -> set[int]:
        """Those of ``positions`` (each <= len(tokens)) whose prefix of ``tokens`` some checkpoint covers."""
        if not positions:
            return set()
        P = self.page_size
        chain = page_chain(tokens, P, max(positions) // P)
        out = set()
        for p in positions:
            k, rows = divmod(p, P)
            key = _link(chain[k], tokens[k * P : p]) if rows else chain[k]
            if key in self._hits:
                out.add(p)
        return out

    def remove(self, session_id: str, checkpoint: str) -> None:
        key = self._keys.pop((session_id, checkpoint), None)
        if key is None:
            return
        hits = self._hits[key.key]
        del hits[(session_id, checkpoint)]
        if not hits:
            del self._hits[key.key]
        tails = self._tails[key.node]
        tails[key.rows] -= 1
        if not tails[key.rows]:
            del tails[key.rows]
        if not tails:
            del self._tails[key.node]

    def remove_session(self, session_id: str) -> None:
        for sid, name in [w for w in self._keys if w[0] == session_id]:
            self.remove(sid, name)

    def matches(self, tokens: Sequence[int], max_len: int | None = None) -> Iterator[PrefixHit]:
        """Indexed checkpoints whose prefix is a prefix of ``tokens`` (at most ``max_len`` tokens), longest
        first."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        P = self.page_size
        chain = page_chain(tokens, P, limit // P)
        for k in range(len(chain) - 1, -1, -1):
            tails = self._tails.get(chain[k])
            if not tails:
                continue
            for rows in sorted(tails, reverse=True):
                end = k * P + rows
                if end > limit:
                    continue
                key = _link(chain[k], tokens[k * P : end]) if rows else chain[k]
                yield from sorted(self._hits.get(key, {}).values(), key=lambda h: h.session_id)

    def longest(self, tokens: Sequence[int], max_len: int | None = None) -> PrefixHit | None:
        """The indexed checkpoint with the longest prefix of ``tokens`` (at most ``max_len`` tokens)."""
        return next(self.matches(tokens, max_len), None)

    def __len__(self) -> int:
        return len(self._keys)
