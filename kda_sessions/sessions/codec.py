"""Between pools and blobs: encode a session's pages and states for the store, and decode them back.

Blob kinds (all content-addressed, see ``kda_sessions.storage.blobs``):
- a KV page: [L_mla, rows, r + dr] latent rows of every MLA layer for one page (rows = P for a full page);
- a state bundle: {"kda": [L_kda, H, K, V] float32, "conv": [L_kda, W - 1, Dc]} at one position;
- the token ids: int32 [num_tokens].
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import ModelConfig
from ..model import StatePools
from ..storage.blobs import (
    bundle_layout,
    decode_tensor,
    decode_tensors,
    digest,
    encode_tensor,
    encode_tensors,
)
from ..storage.errors import IncompatibleSnapshot, IntegrityError


def encode_page(pools: StatePools, page: int, rows: int) -> bytes:
    return encode_tensor(torch.stack([kv[page, :rows] for kv in pools.kv]).cpu())


def encode_state(kda: Tensor, conv: Tensor) -> bytes:
    return encode_tensors({"kda": kda.contiguous(), "conv": conv.contiguous()})


def encode_tokens(tokens: list[int]) -> bytes:
    return encode_tensor(torch.tensor(tokens, dtype=torch.int32))


def blob(data: bytes) -> tuple[str, bytes]:
    return digest(data), data


def expected_state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    L, H, K = len(cfg.kda_layer_ids), cfg.kda_heads, cfg.kda_head_dim
    return (L, H, K, K), (L, cfg.conv_size - 1, 3 * H * K)


def decode_state(data: bytes, cfg: ModelConfig, dtype: torch.dtype, where: str) -> tuple[Tensor, Tensor]:
    tensors = decode_tensors(data)
    if set(tensors) != {"kda", "conv"}:
        raise IntegrityError(f"{where}: state blob must hold 'kda' and 'conv', got {sorted(tensors)}")
    want_kda, want_conv = expected_state_shapes(cfg)
    kda, conv = tensors["kda"], tensors["conv"]
    if tuple(kda.shape) != want_kda or kda.dtype != torch.float32:
        raise IncompatibleSnapshot(f"{where}: KDA state is {tuple(kda.shape)} {kda.dtype}, model needs {want_kda} float32")
    if tuple(conv.shape) != want_conv or conv.dtype != dtype:
        raise IncompatibleSnapshot(f"{where}: conv tail is {tuple(conv.shape)} {conv.dtype}, model needs {want_conv} {dtype}")
    return kda, conv


def state_layout(
    data: bytes, cfg: ModelConfig, dtype: torch.dtype, where: str
) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Where a state blob of this model holds its tensors, checked as ``decode_state`` checks them (the same
    errors) but with nothing copied: (payload offset in ``data``, (begin, end) of "kda", (begin, end) of
    "conv") in the payload, so that the payload can be copied once, straight into pinned memory."""
    offset, entries = bundle_layout(data)
    want_kda, want_conv = expected_state_shapes(cfg)
    kda, conv = entries.get("kda"), entries.get("conv")
    if (
        set(entries) != {"kda", "conv"} or kda is None or conv is None
        or (kda[0], tuple(kda[1])) != (torch.float32, want_kda) or (conv[0], tuple(conv[1])) != (dtype, want_conv)
    ):
        decode_state(data, cfg, dtype, where)  # raises, naming what differs
        raise AssertionError("decode_state accepted a state blob state_layout refused")  # pragma: no cover
    return offset, (kda[2], kda[3]), (conv[2], conv[3])


def decode_page(data: bytes, cfg: ModelConfig, dtype: torch.dtype, rows: int, where: str) -> Tensor:
    t = decode_tensor(data)
    want = (len(cfg.mla_layer_ids), rows, cfg.latent_dim)
    if tuple(t.shape) != want or t.dtype != dtype:
        raise IncompatibleSnapshot(f"{where}: KV page is {tuple(t.shape)} {t.dtype}, expected {want} {dtype}")
    return t


def decode_tokens(data: bytes, num_tokens: int, vocab_size: int, where: str) -> list[int]:
    t = decode_tensor(data)
    if t.dtype != torch.int32 or tuple(t.shape) != (num_tokens,):
        raise IntegrityError(f"{where}: token blob is {tuple(t.shape)} {t.dtype}, expected ({num_tokens},) int32")
    tokens: list[int] = t.tolist()
    # on the list, not the tensor: two reductions of torch's thread pool cost more than this at 128K tokens
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise IncompatibleSnapshot(f"{where}: token ids fall outside the vocabulary of {vocab_size}")
    return tokens
