"""Kimi's `tiktoken.model` (base64 token + rank per line) behind the Tokenizer contract.

Layout as in Kimi-Linear's tokenization_kimi.py: the BPE ranks, then 256 reserved special ids right after
them, named from `tokenizer_config.json`'s `added_tokens_decoder` (`<|reserved_token_{id}|>` otherwise).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from kda_sessions.tokenizer.base import Tokenizer
from kda_sessions.tokenizer.checkpoint_files import added_tokens, resolve_eos_ids

NUM_RESERVED_SPECIALS = 256

# Kimi's pre-tokenizer split: Han runs, cased words with English contractions, 1-3 digits, punctuation,
# newlines, spaces. `&&` is class intersection (tiktoken's regex engine supports it).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# tiktoken panics on very long inputs and very long runs of (non-)whitespace; encode in slices.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE with Kimi's split pattern and special-token layout."""

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None) -> None:
        path = Path(path)
        config = config or {}
        ranks = load_tiktoken_bpe(str(path))
        num_base = len(ranks)
        named = added_tokens(config)
        below = sorted(i for i in named if i < num_base)
        if below:
            raise ValueError(
                f"added_tokens_decoder ids {below[:5]} overlap the {num_base} BPE ranks of {path}; "
                f"special ids must start at {num_base}"
            )
        num_special = max([NUM_RESERVED_SPECIALS, *(i + 1 - num_base for i in named)])
        self.special_ids = {
            named[i][0] if i in named else f"<|reserved_token_{i}|>": i
            for i in range(num_base, num_base + num_special)
        }
        self.path = path
        self._enc = tiktoken.Encoding(
            name=path.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        self.eos_ids = resolve_eos_ids(path.parent, config, self.special_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        ids: list[int] = []
        for piece in _slices(text):
            if allow_special:
                ids.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def encode_plain_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode(t)`` of each text, its slices encoded on threads (tiktoken's encoder releases the GIL)."""
        slices = [list(_slices(t)) for t in texts]
        flat = [piece for pieces in slices for piece in pieces]
        encoded = iter(self._enc.encode_ordinary_batch(flat, num_threads=min(8, os.cpu_count() or 1)))
        out = []
        for pieces in slices:
            ids: list[int] = []
            for _ in pieces:
                ids.extend(next(encoded))
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if skip_special:
            ids = [i for i in ids if i not in self.special_names]
        return str(self._enc.decode(ids, errors="replace"))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one id (constrained decoding matches on bytes)."""
        return bytes(self._enc.decode_single_token_bytes(token_id))


def _slices(text: str) -> Iterator[str]:
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        yield from _split_runs(text[start : start + MAX_ENCODE_CHARS], MAX_RUN_CHARS)


@lru_cache(maxsize=4)
def _long_runs(max_run: int) -> re.Pattern[str]:
    # ``\s`` is ``str.isspace`` for str patterns; runs of one class are maximal: the classes are complementary
    return re.compile(rf"\s{{{max_run + 1},}}|\S{{{max_run + 1},}}")


def _split_runs(s: str, max_run: int) -> Iterator[str]:
    """Cut `s` so that no piece holds more than `max_run` consecutive whitespace or non-whitespace chars: a run
    longer than that is cut every `max_run` chars from its start (found by a regex: a Python loop over the
    characters took ~0.3 s for 4 MB)."""
    start = 0
    for run in _long_runs(max_run).finditer(s):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield s[start:cut]
            start = cut
    yield s[start:]
