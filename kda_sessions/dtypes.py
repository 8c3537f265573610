"""The ``--dtype`` names a user may give, and what ``auto`` means on each device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype of the weights for ``name`` on ``device``: ``auto`` is bfloat16 on CUDA (the tensor
    cores' type, half the bytes to read per token) and float32 elsewhere (CPU matmuls are fastest and exact
    there for small models)."""
    import torch

    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
