"""A `tokenizer.json` (Hugging Face `tokenizers`) behind the Tokenizer contract."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kda_sessions.tokenizer.base import Tokenizer
from kda_sessions.tokenizer.checkpoint_files import added_tokens, resolve_eos_ids


class HFTokenizer(Tokenizer):
    """Wraps `tokenizers.Tokenizer.from_file(tokenizer.json)`; specials are its added tokens marked special."""

    def __init__(self, path: str | Path, *, config: dict[str, Any] | None = None) -> None:
        path = Path(path)
        config = config or {}
        raw = path.read_text(encoding="utf-8")
        self.path = path
        self._tok = tokenizers.Tokenizer.from_str(raw)
        # A second instance that treats special strings as text: the flag lives on the object, and flipping
        # it per call would race between threads.
        self._tok_plain = tokenizers.Tokenizer.from_str(raw)
        self._tok_plain.encode_special_tokens = True

        self.special_ids = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        for i, (content, special) in added_tokens(config).items():
            if special and content not in self.special_ids and self._tok.token_to_id(content) == i:
                self.special_ids[content] = i
        self.eos_ids = resolve_eos_ids(path.parent, config, self.special_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        tok = self._tok if allow_special else self._tok_plain
        return list(tok.encode(text, add_special_tokens=False).ids)

    def encode_plain_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode(t)`` of each text, encoded in parallel by the tokenizers library (its threads)."""
        return [list(e.ids) for e in self._tok_plain.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))
