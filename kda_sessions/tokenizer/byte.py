"""The byte tokenizer of the built-in models: ids 0..255 are raw bytes, specials follow from 256.

Specials carry Kimi's names, so the built-in chat format and Kimi's are the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kda_sessions.tokenizer.base import Tokenizer

# Fixed order: the id of each name is 256 + its index. Changing it changes every built-in checkpoint.
BYTE_SPECIALS: tuple[str, ...] = (
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|bos|>",
    "<|pad|>",
    *(f"<|reserved_{i}|>" for i in range(12, 16)),
)
NUM_BYTES = 256


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids plus 16 specials: vocab_size 272."""

    def __init__(self) -> None:
        self.special_ids = {name: NUM_BYTES + i for i, name in enumerate(BYTE_SPECIALS)}
        self.eos_ids = {self.special_ids["<|im_end|>"]}
        self.bos_id = self.special_ids["<|bos|>"]
        self.pad_id = self.special_ids["<|pad|>"]

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(BYTE_SPECIALS)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for seg in self.split_specials(text):
            if seg.is_special:
                ids.append(self.special_ids[seg.text])
            else:
                ids.extend(seg.text.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        parts: list[str] = []
        pending = bytearray()
        for i in ids:
            if 0 <= i < NUM_BYTES:
                pending.append(i)
                continue
            name = self.special_names.get(i)
            if name is None:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})"
                )
            # Decode bytes up to each special separately: a special never completes a character.
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special:
                parts.append(name)
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of a non-special id (constrained decoding matches on bytes)."""
        if not 0 <= token_id < NUM_BYTES:
            raise ValueError(f"token id {token_id} is not a byte id")
        return bytes([token_id])
