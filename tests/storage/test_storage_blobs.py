"""Tensor codecs: round trips (bit-exact) and header validation that fails before allocating."""

from __future__ import annotations

import contextlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_sessions.storage import blobs
from kda_sessions.storage.blobs import decode_tensor, decode_tensors, digest, encode_tensor, encode_tensors
from kda_sessions.storage.errors import IntegrityError

CASES = {
    "fp32": torch.randn(3, 5),
    "bf16": torch.randn(4, 2, 3).to(torch.bfloat16),
    "fp16": torch.randn(7).half(),
    "int32": torch.arange(-5, 11, dtype=torch.int32),
    "int64": torch.tensor([2**40, -1]),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "0d": torch.tensor(3.25),
    "empty": torch.empty(0, 4),
    "noncontig": torch.randn(4, 6).t(),
    "slice": torch.arange(100, dtype=torch.int32)[10:20],
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.reshape(-1).contiguous().view(torch.uint8).equal(b.reshape(-1).contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("t", CASES.values(), ids=CASES.keys())
def test_tensor_round_trip_is_bit_exact(t: torch.Tensor) -> None:
    out = decode_tensor(encode_tensor(t))
    assert _same_bits(out, t)
    assert out.is_contiguous()


def test_bf16_special_values_survive() -> None:
    # 0x7FC1 NaN with payload, 0xFF80 -inf, 0x0001 subnormal, 0x8000 -0 (as signed int16)
    bits = torch.tensor([0x7FC1, 0xFF80 - 0x10000, 0x0001, -0x8000], dtype=torch.int16)
    t = bits.view(torch.bfloat16)
    assert decode_tensor(encode_tensor(t)).view(torch.int16).equal(bits)


def test_decoded_tensor_owns_writable_memory() -> None:
    data = encode_tensor(torch.zeros(4))
    out = decode_tensor(data)
    out += 1
    assert decode_tensor(data).equal(torch.zeros(4))


def test_digest_is_sha256_hex() -> None:
    assert digest(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert blobs.is_digest(digest(b"x")) and not blobs.is_digest("E3" * 32)


def _blob(header: object, payload: bytes = b"", *, magic: bytes = b"KDAT", version: int = 1) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<4sBI", magic, version, len(h)) + h + payload


BAD = {
    "bad-magic": _blob({"dtype": "float32", "shape": [1]}, b"\0" * 4, magic=b"NOPE"),
    "bad-version": _blob({"dtype": "float32", "shape": [1]}, b"\0" * 4, version=9),
    "unknown-dtype": _blob({"dtype": "complex64", "shape": [1]}, b"\0" * 8),
    "negative-dim": _blob({"dtype": "uint8", "shape": [-1]}),
    "float-dim": _blob({"dtype": "uint8", "shape": [1.0]}, b"\0"),
    "too-many-dims": _blob({"dtype": "uint8", "shape": [1] * 9}, b"\0"),
    "length-mismatch": _blob({"dtype": "float32", "shape": [2, 2]}, b"\0" * 15),
    "giant-shape": _blob({"dtype": "float32", "shape": [2**40, 2**40]}, b"\0" * 16),
    "extra-key": _blob({"dtype": "uint8", "shape": [1], "x": 1}, b"\0"),
    "header-not-json": struct.pack("<4sBI", b"KDAT", 1, 3) + b"{{{",
    "header-longer-than-blob": struct.pack("<4sBI", b"KDAT", 1, 1000) + b"{}",
    "truncated-preamble": b"KDAT\x01",
    "empty": b"",
}


@pytest.mark.parametrize("data", BAD.values(), ids=BAD.keys())
def test_bad_tensor_blob_raises_integrity_error_without_allocating(
    data: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_alloc(*args: object, **kwargs: object) -> None:
        raise AssertionError("decode_tensor allocated before validating")

    monkeypatch.setattr(torch, "frombuffer", no_alloc)
    monkeypatch.setattr(torch, "empty", no_alloc)
    with pytest.raises(IntegrityError):
        decode_tensor(data)


def test_truncated_valid_blob_raises() -> None:
    data = encode_tensor(torch.randn(16))
    for cut in (1, 4, len(data) - 1):
        with pytest.raises(IntegrityError):
            decode_tensor(data[:-cut])


def test_max_bytes_cap() -> None:
    data = encode_tensor(torch.zeros(1000))
    with pytest.raises(IntegrityError, match="cap"):
        decode_tensor(data, max_bytes=100)


def test_encode_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


def test_bundle_bytes_are_safetensors_own() -> None:
    """encode_tensors builds the header itself and copies without the GIL: the bytes stay exactly those of
    safetensors' save (every dtype, empty and 0-d tensors, names out of order), so digests of stored states
    do not change with it."""
    from safetensors.torch import save

    bundle = {
        "kda": torch.randn(2, 3, 4, 4),
        "conv": torch.randn(2, 3, 5).to(torch.bfloat16),
        "b": torch.arange(6, dtype=torch.int32),
        "a": torch.ones(2, 2),
        "zero_d": torch.tensor(3.0),
        "empty": torch.empty(0, 3),
        "u8": torch.arange(7, dtype=torch.uint8),
        "f16": torch.randn(3).half(),
        "i64": torch.tensor([2**40, -1]),
        "empty_i64": torch.empty(0, dtype=torch.int64),
    }
    assert encode_tensors(bundle) == save(bundle)
    assert encode_tensors({}) == save({})


def test_bundle_round_trip_and_determinism() -> None:
    shared = torch.randn(8)
    bundle = {
        "layer0.state": torch.randn(2, 4, 4),
        "layer0.conv": torch.randn(3, 5).to(torch.bfloat16),
        "layer1.state": shared,
        "layer1.alias": shared,  # shares storage: stored as its own copy
        "empty": torch.empty(0, 3),
    }
    data = encode_tensors(bundle)
    assert encode_tensors(bundle) == data
    out = decode_tensors(data)
    assert set(out) == set(bundle)
    for k, t in bundle.items():
        assert _same_bits(out[k], t), k


def _bundle_with_header(header: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + payload


BAD_BUNDLES = {
    "giant-header-length": struct.pack("<Q", 2**62) + b"{}",
    "header-past-end": struct.pack("<Q", 100) + b"{}",
    "truncated": b"\x01\x02",
    "not-json": _bundle_with_header(b"nope"),
    "bad-dtype": _bundle_with_header(b'{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}', b"\0" * 8),
    "offsets-past-payload": _bundle_with_header(
        b'{"a":{"dtype":"F32","shape":[1000000000],"data_offsets":[0,4000000000]}}', b"\0" * 8
    ),
    "shape-offsets-mismatch": _bundle_with_header(
        b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', b"\0" * 8
    ),
    "uncovered-tail": _bundle_with_header(
        b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}', b"\0" * 8
    ),
}


@pytest.mark.parametrize("data", BAD_BUNDLES.values(), ids=BAD_BUNDLES.keys())
def test_bad_bundle_raises_integrity_error(data: bytes) -> None:
    with pytest.raises(IntegrityError):
        decode_tensors(data)


def test_truncated_bundle_raises() -> None:
    data = encode_tensors({"a": torch.randn(10)})
    with pytest.raises(IntegrityError):
        decode_tensors(data[:-3])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_tensor_blobs_only_raise_integrity_error(data: bytes) -> None:
    with contextlib.suppress(IntegrityError):
        decode_tensor(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_damaged_bundles_only_raise_integrity_error(pos: int, value: int) -> None:
    # Payload damage decodes to other numbers (the blob digest check catches that); header damage must
    # surface as IntegrityError, never as another exception or a huge allocation.
    data = bytearray(encode_tensors({"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(2, 2)}))
    data[pos % len(data)] = value
    with contextlib.suppress(IntegrityError):
        decode_tensors(bytes(data))
