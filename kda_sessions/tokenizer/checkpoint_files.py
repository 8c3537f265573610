"""Reading the tokenizer side of a checkpoint directory: tokenizer_config.json and the eos ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG = "tokenizer_config.json"
# End of an assistant turn in Kimi's format (and the built-in one): always stops generation when present.
END_OF_TURN = "<|im_end|>"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; ValueError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """`tokenizer_config.json` of `directory`, or {} when there is none."""
    path = directory / TOKENIZER_CONFIG
    return read_json(path) if path.is_file() else {}


def token_content(value: Any) -> str | None:
    """A token as written in tokenizer_config.json: a string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def added_tokens(config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """`added_tokens_decoder` as {id: (content, special)}."""
    out: dict[int, tuple[str, bool]] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = token_content(entry)
        if content is None:
            raise ValueError(f"added_tokens_decoder[{key!r}] has no string 'content': {entry!r}")
        special = bool(entry.get("special", True)) if isinstance(entry, dict) else True
        out[int(key)] = (content, special)
    return out


def resolve_eos_ids(directory: Path | None, config: dict[str, Any], special_ids: dict[str, int]) -> set[int]:
    """Ids that end generation: `<|im_end|>`, the config's eos_token, and config.json /
    generation_config.json `eos_token_id` (an int or a list) when those files exist."""
    eos: set[int] = set()
    for name in (END_OF_TURN, token_content(config.get("eos_token"))):
        if name is not None and name in special_ids:
            eos.add(special_ids[name])
    if directory is not None:
        for fname in ("generation_config.json", "config.json"):
            path = directory / fname
            if not path.is_file():
                continue
            value = read_json(path).get("eos_token_id")
            if isinstance(value, int):
                eos.add(value)
            elif isinstance(value, list):
                eos.update(v for v in value if isinstance(v, int))
    return eos
