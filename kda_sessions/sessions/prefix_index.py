"""Prefix reuse: token-prefix hash -> a checkpoint whose state covers that prefix.

A new session (or a stateless request that resends a whole history) starts from the longest indexed prefix
of its tokens instead of prefilling it again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    session_id: str
    checkpoint: str
    position: int


def _hashes(tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, str]:
    """sha256 of tokens[:L] for every L in ``lengths``, in one pass over the tokens."""
    out: dict[int, str] = {}
    h = hashlib.sha256()
    done = 0
    for L in sorted(set(lengths)):
        if len(tokens) < L:
            break
        h.update(array("i", tokens[done:L]).tobytes())
        done = L
        out[L] = h.copy().hexdigest()
    return out


def prefix_hash(tokens: Sequence[int], length: int) -> str:
    return _hashes(tokens, [length])[length]


class PrefixIndex:
    def __init__(self) -> None:
        self._by_hash: dict[str, PrefixHit] = {}
        self._lengths: dict[int, int] = {}  # length -> number of entries

    def add(self, tokens: Sequence[int], hit: PrefixHit) -> None:
        if hit.position <= 0:
            return
        self.add_hashed(prefix_hash(tokens, hit.position), hit)

    def add_hashed(self, key: str, hit: PrefixHit) -> None:
        """Index a checkpoint by the stored hash of its prefix (no tokens needed: startup indexing)."""
        if hit.position <= 0:
            return
        if key not in self._by_hash:
            self._lengths[hit.position] = self._lengths.get(hit.position, 0) + 1
        self._by_hash[key] = hit

    def remove_session(self, session_id: str) -> None:
        for key, hit in list(self._by_hash.items()):
            if hit.session_id == session_id:
                del self._by_hash[key]
                self._lengths[hit.position] -= 1
                if not self._lengths[hit.position]:
                    del self._lengths[hit.position]

    def longest(self, tokens: Sequence[int], max_len: int | None = None) -> PrefixHit | None:
        """The indexed checkpoint with the longest prefix of ``tokens`` (at most ``max_len`` tokens)."""
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        lengths = [L for L in self._lengths if limit >= L]
        best = None
        for L, key in _hashes(tokens, lengths).items():
            if key in self._by_hash and (best is None or best.position < L):
                best = self._by_hash[key]
        return best

    def __len__(self) -> int:
        return len(self._by_hash)
