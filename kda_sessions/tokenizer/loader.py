"""`load_tokenizer`: a built-in name or a checkpoint directory to a Tokenizer."""

from __future__ import annotations

from pathlib import Path

from kda_sessions.errors import TokenizerNotFound
from kda_sessions.tokenizer.base import Tokenizer
from kda_sessions.tokenizer.byte import ByteTokenizer
from kda_sessions.tokenizer.checkpoint_files import read_tokenizer_config

BUILTIN_NAMES = ("tiny-random", "tiny")
HF_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"


def load_tokenizer(path_or_name: str | Path) -> Tokenizer:
    """Built-in names -> ByteTokenizer; a directory (or the file itself) with tokenizer.json -> HFTokenizer,
    with tiktoken.model -> TiktokenTokenizer (tokenizer.json wins when both exist)."""
    if isinstance(path_or_name, str) and path_or_name in BUILTIN_NAMES:
        return ByteTokenizer()
    path = Path(path_or_name)
    if path.is_file() and path.name in (HF_FILE, TIKTOKEN_FILE):
        path, only = path.parent, path.name
    else:
        only = None
    if path.is_dir():
        config = read_tokenizer_config(path)
        if only in (None, HF_FILE) and (path / HF_FILE).is_file():
            from kda_sessions.tokenizer.hf import HFTokenizer

            return HFTokenizer(path / HF_FILE, config=config)
        if only in (None, TIKTOKEN_FILE) and (path / TIKTOKEN_FILE).is_file():
            from kda_sessions.tokenizer.tiktoken_tok import TiktokenTokenizer

            return TiktokenTokenizer(path / TIKTOKEN_FILE, config=config)
    raise TokenizerNotFound(str(path_or_name), (HF_FILE, TIKTOKEN_FILE), tuple(BUILTIN_NAMES))
