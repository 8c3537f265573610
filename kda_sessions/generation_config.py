"""A model's suggested sampling: Hugging Face's ``generation_config.json`` beside its weights.

The CLI's chat and the server take what a request or a flag leaves unset from here, so that a model which only
works greedily (the built-in ``tiny``) is not sampled at OpenAI's temperature 1 by a client that names none. A
built-in model keeps the file as ``builtin/NAME.generation_config.json``, not inside ``NAME.json``: keys added to
the model config would change its fingerprint and orphan the saved sessions of that model. No file, no defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling a model suggests; None where it suggests nothing (the caller's own default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


def _config_file(model: str) -> Path | None:
    """The generation config of a built-in name or a checkpoint directory, if it has one."""
    if "/" not in model and (BUILTIN_DIR / f"{model}.json").is_file():
        path = BUILTIN_DIR / f"{model}.generation_config.json"
    else:
        path = Path(model) / "generation_config.json"
    return path if path.is_file() else None


def parse_generation_config(data: dict[str, object], source: str = "generation config") -> GenerationDefaults:
    """Hugging Face's keys: ``do_sample`` false means greedy (temperature 0) whatever ``temperature`` says;
    ``max_new_tokens`` is the reply's token limit."""
    try:
        temperature = 0.0 if data.get("do_sample") is False else data.get("temperature")
        top_p, max_new = data.get("top_p"), data.get("max_new_tokens")
        return GenerationDefaults(
            temperature=None if temperature is None else float(temperature),  # type: ignore[arg-type]
            top_p=None if top_p is None else float(top_p),  # type: ignore[arg-type]
            max_tokens=None if max_new is None else int(max_new),  # type: ignore[call-overload]
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {e}") from None


@lru_cache(maxsize=32)
def generation_defaults(model: str) -> GenerationDefaults:
    """The suggested sampling of ``model`` (a built-in name or a checkpoint directory), read once per process."""
    path = _config_file(model)
    if path is None:
        return GenerationDefaults()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable generation config ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a generation config is a JSON object")
    return parse_generation_config(data, str(path))
