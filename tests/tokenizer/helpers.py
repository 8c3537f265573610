"""Tiny tokenizer files built in the test, in the formats real checkpoints ship."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from kda_sessions.tokenizer import ByteTokenizer
from kda_sessions.tokenizer.chat import CHAT_SPECIALS

CORPUS = [
    "hello world, this is a tiny corpus for a tiny tokenizer.",
    "def read_file(path): return open(path).read()",
    "héllo wörld 日本語 🦀 user assistant system tool functions.read_file",
] * 20


def write_hf_tokenizer(directory: Path) -> Path:
    """A byte-level BPE trained in-test, with Kimi's chat specials, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[*CHAT_SPECIALS, "[EOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]"}))
    return directory


TIKTOKEN_MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"]


def write_tiktoken_model(directory: Path, *, added: dict[int, str] | None = None) -> Path:
    """A tiktoken.model (base64 token, rank per line): the 256 bytes, then a few merges;
    tokenizer_config.json names the specials right after the ranks, as Kimi's does."""
    ranks = [bytes([b]) for b in range(256)] + TIKTOKEN_MERGES
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(ranks)]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    if added is None:
        added = {len(ranks) + i: name for i, name in enumerate(CHAT_SPECIALS)}
    config = {
        "added_tokens_decoder": {str(i): {"content": n, "special": True} for i, n in added.items()},
        "eos_token": "<|im_end|>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


class CountingBytes(ByteTokenizer):
    """The byte tokenizer, recording the texts it encodes (``encoded``): what a cache let through."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[str] = []

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        self.encoded.append(text)
        return super().encode(text, allow_special=allow_special)
