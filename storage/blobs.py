"""Content addressing and the tensor codecs of stored blobs.

A blob is named by the sha256 hex digest of its bytes. Tensors are stored either one per blob with a small
validated header (`encode_tensor`) or as a bundle of named tensors in safetensors format (`encode_tensors`).
Decoding validates every header field before anything is allocated, so a corrupt or malicious blob raises
`IntegrityError` instead of allocating gigabytes. No pickle anywhere.

Raw tensor bytes are written in the machine's byte order; every supported platform is little-endian.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load as _st_load

from .errors import IntegrityError

DIGEST_RE = re.compile(r"[0-9a-f]{64}")

TENSOR_MAGIC = b"KDAT"
TENSOR_VERSION = 1
_PREAMBLE = struct.Struct("<4sBI")  # magic, version u8, JSON header length u32

MAX_NDIM = 8
MAX_TENSOR_HEADER_BYTES = 4096
MAX_BUNDLE_HEADER_BYTES = 16 * 1024 * 1024
MAX_BLOB_BYTES = 64 * 1024**3
"""Default cap on the size of one decoded blob (64 GiB); callers may lower it."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# safetensors spells the same dtypes differently.
_ST_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
}


def digest(data: bytes | bytearray | memoryview) -> str:
    """sha256 of `data` as 64 lowercase hex characters."""
    return hashlib.sha256(data).hexdigest()


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_THREADED_HASH_BYTES = 4 << 20  # below this in total, threads cost more than they save


def digests(buffers: Sequence[bytes | bytearray | memoryview], *, threads: int = HASH_THREADS) -> list[str]:
    """sha256 of each buffer, in order, on up to `threads` threads (hashlib releases the GIL on large buffers,
    so the hashes run in parallel: several GB/s where one thread gives about 1.5-2)."""
    if threads <= 1 or len(buffers) <= 1 or sum(map(len, buffers)) < _THREADED_HASH_BYTES:
        return [digest(b) for b in buffers]
    with ThreadPoolExecutor(min(threads, len(buffers)), thread_name_prefix="sha256") as ex:
        return list(ex.map(digest, buffers))


def is_digest(value: object) -> bool:
    """True if `value` is a well-formed digest string (safe to use in paths and keys)."""
    return isinstance(value, str) and DIGEST_RE.fullmatch(value) is not None


def check_digest(value: object) -> str:
    """Return `value` if it is a well-formed digest, else raise ValueError naming it."""
    if not is_digest(value):
        raise ValueError(f"digest must be 64 lowercase hex characters (sha256), got {value!r:.80}")
    assert isinstance(value, str)
    return value


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of `t`, C-contiguous, copied once (no numpy)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return b""
    return ctypes.string_at(flat.data_ptr(), nbytes)


def _check_shape(shape: object, where: str) -> list[int]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise IntegrityError(f"{where}: shape must be a list of at most {MAX_NDIM} ints, got {shape!r:.200}")
    for n in shape:
        # bool is an int subclass; json never yields it for a number but a forged header could.
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n > MAX_BLOB_BYTES:
            raise IntegrityError(
                f"{where}: shape entries must be ints in [0, {MAX_BLOB_BYTES}], got {shape!r:.200}"
            )
    return shape


def encode_tensor(t: torch.Tensor) -> bytes:
    """Serialize one tensor: `KDAT` | version u8 | header length u32 LE | JSON {dtype, shape} | raw bytes.

    Any shape (0-d and empty included); dtype one of `DTYPES`. bfloat16 round-trips bit-exactly.
    """
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"encode_tensor: dtype must be one of {sorted(DTYPES)}, got {t.dtype}")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"encode_tensor: at most {MAX_NDIM} dims, got shape {list(t.shape)}")
    return tensor_header(t.dtype, list(t.shape)) + _tensor_bytes(t)


def tensor_header(dtype: torch.dtype, shape: list[int]) -> bytes:
    """The bytes `encode_tensor` puts before the raw data of a tensor of this dtype and shape: equal for every
    tensor of that dtype and shape, so many blobs of one shape are encoded and decoded by slicing at its end."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"tensor_header: dtype must be one of {sorted(DTYPES)}, got {dtype}")
    header = json.dumps({"dtype": name, "shape": list(shape)}, separators=(",", ":")).encode()
    return _PREAMBLE.pack(TENSOR_MAGIC, TENSOR_VERSION, len(header)) + header


def decode_tensor(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_BLOB_BYTES) -> torch.Tensor:
    """Inverse of `encode_tensor`; returns a new CPU tensor that owns its memory.

    Raises IntegrityError on a bad magic/version, unknown dtype, bad shape, a payload whose length is not
    exactly prod(shape) * itemsize, or a blob larger than `max_bytes`, all before allocating the tensor.
    """
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise IntegrityError(f"tensor blob is {len(view)} bytes, more than the cap of {max_bytes}")
    if len(view) < _PREAMBLE.size:
        raise IntegrityError(f"tensor blob truncated: {len(view)} bytes, header needs {_PREAMBLE.size}")
    magic, version, hlen = _PREAMBLE.unpack_from(view)
    if magic != TENSOR_MAGIC:
        raise IntegrityError(f"tensor blob: bad magic {bytes(magic)!r}, expected {TENSOR_MAGIC!r}")
    if version != TENSOR_VERSION:
        raise IntegrityError(f"tensor blob: format version {version}, expected {TENSOR_VERSION}")
    if hlen > MAX_TENSOR_HEADER_BYTES or _PREAMBLE.size + hlen > len(view):
        raise IntegrityError(
            f"tensor blob: header length {hlen} exceeds the cap or the blob ({len(view)} bytes)"
        )
    start = _PREAMBLE.size + hlen
    try:
        header = json.loads(bytes(view[_PREAMBLE.size : start]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"tensor blob: header is not valid JSON: {e}") from e
    if not isinstance(header, dict) or set(header) != {"dtype", "shape"}:
        raise IntegrityError(f"tensor blob: header must have exactly dtype and shape, got {header!r:.200}")
    dtype = DTYPES.get(header["dtype"]) if isinstance(header["dtype"], str) else None
    if dtype is None:
        raise IntegrityError(
            f"tensor blob: dtype must be one of {sorted(DTYPES)}, got {header['dtype']!r:.50}"
        )
    shape = _check_shape(header["shape"], "tensor blob")
    expected = math.prod(shape) * dtype.itemsize
    payload = view[start:]
    if expected != len(payload):
        raise IntegrityError(
            f"tensor blob: shape {shape} of {header['dtype']} needs {expected} payload bytes, got {len(payload)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray copies once and is writable, so frombuffer shares it without a warning.
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_ST_ORDER = ["U8", "F16", "BF16", "I32", "F32", "I64"]
"""safetensors' dtype order, ascending (its Dtype enum, restricted to ours): it writes tensors by dtype
descending, then by name, so `encode_tensors` writes them in this order too and gives safetensors' exact bytes."""


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Serialize named tensors into one safetensors blob; deterministic for equal input, byte for byte what
    ``safetensors.torch.save`` gives. The header is built here and each tensor's bytes copied once, straight into
    the blob, without the GIL (`join`): safetensors' own save copies every tensor two to three times holding it,
    which at 42 MB a state kept a save's writer and hash threads waiting."""
    prepared: list[tuple[str, str, torch.Tensor]] = []
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"encode_tensors: {name!r} has dtype {t.dtype}, expected one of {sorted(DTYPES)}"
            )
        prepared.append((name, _ST_NAMES[_DTYPE_NAMES[t.dtype]], t.detach().to("cpu").contiguous()))
    prepared.sort(key=lambda e: (-_ST_ORDER.index(e[1]), e[0]))
    header: dict[str, object] = {}
    parts: list[tuple[int, int]] = []
    offset = 0
    for name, st_dtype, t in prepared:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        if n:
            parts.append((t.data_ptr(), n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to a multiple of 8 bytes with spaces
    return join(struct.pack("<Q", len(raw)) + raw, parts)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object


def join(header: bytes, parts: Sequence[tuple[int, int]]) -> bytes:
    """``header`` followed by each (address, nbytes) part of memory, as a new bytes object copied by ctypes'
    memmove, which releases the GIL (``header + view`` copies, and faults in the fresh memory, holding it: a
    save's writer and hash threads need the GIL between blobs). The caller keeps the parts' memory alive. The
    object is filled before anything else can see it (PyBytes_FromStringAndSize(NULL, n): uninitialized), then
    never changed."""
    out: bytes = _new_bytes(None, len(header) + sum(n for _, n in parts))
    at = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value or 0
    ctypes.memmove(at, header, len(header))
    at += len(header)
    for address, n in parts:
        ctypes.memmove(at, address, n)
        at += n
    return out


def _check_bundle_header(view: memoryview, max_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """The validated entries of a safetensors blob: name -> (dtype, shape, begin, end) in its payload."""
    if len(view) > max_bytes:
        raise IntegrityError(f"tensor bundle is {len(view)} bytes, more than the cap of {max_bytes}")
    if len(view) < 8:
        raise IntegrityError(f"tensor bundle truncated: {len(view)} bytes, header length needs 8")
    (hlen,) = struct.unpack_from("<Q", view)
    if hlen > MAX_BUNDLE_HEADER_BYTES or 8 + hlen > len(view):
        raise IntegrityError(
            f"tensor bundle: header length {hlen} exceeds the cap or the blob ({len(view)} bytes)"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"tensor bundle: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise IntegrityError("tensor bundle: header must be a JSON object")
    payload = len(view) - 8 - hlen
    end_max = 0
    entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _ST_DTYPES:
            raise IntegrityError(f"tensor bundle: {name!r:.80} has a bad entry or dtype {entry!r:.200}")
        shape = _check_shape(entry.get("shape"), f"tensor bundle {name!r:.80}")
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= payload
        ):
            raise IntegrityError(
                f"tensor bundle: {name!r:.80} data_offsets {offsets!r:.80} outside the payload"
            )
        need = math.prod(shape) * DTYPES[_ST_DTYPES[entry["dtype"]]].itemsize
        if offsets[1] - offsets[0] != need:
            raise IntegrityError(
                f"tensor bundle: {name!r:.80} shape {shape} needs {need} bytes, offsets give "
                f"{offsets[1] - offsets[0]}"
            )
        end_max = max(end_max, offsets[1])
        entries[name] = (DTYPES[_ST_DTYPES[entry["dtype"]]], shape, offsets[0], offsets[1])
    if end_max != payload:
        raise IntegrityError(f"tensor bundle: tensors cover {end_max} payload bytes, blob has {payload}")
    return entries


def bundle_layout(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_BLOB_BYTES
) -> tuple[int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """Where the tensors of an `encode_tensors` blob lie, validated as `decode_tensors` validates (IntegrityError),
    without copying them: (offset of the payload in ``data``, name -> (dtype, shape, begin, end) in the payload).
    Lets a reader copy the payload once, straight to where it goes (pinned memory for a device copy)."""
    view = memoryview(data).cast("B")
    entries = _check_bundle_header(view, max_bytes)
    (hlen,) = struct.unpack_from("<Q", view)
    return 8 + hlen, entries


def decode_tensors(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_BLOB_BYTES
) -> dict[str, torch.Tensor]:
    """Inverse of `encode_tensors`; validates the header (length cap, dtypes, shapes, offsets) first."""
    view = memoryview(data).cast("B")
    _check_bundle_header(view, max_bytes)
    try:
        return _st_load(data if isinstance(data, bytes) else bytes(view))
    except Exception as e:  # safetensors raises its own error types; all mean a corrupt blob here
        raise IntegrityError(f"tensor bundle: safetensors rejected it: {e}") from e
