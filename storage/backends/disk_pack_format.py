"""The pack file format of the disk store (see disk_pack)::

    header  b"KDAP" | version u8 | 3 zero bytes | count u32 LE | sha256 of the index (32 raw bytes)
    index   count x (sha256 of the blob: 32 raw bytes | offset u64 LE | length u64 LE)
    data    the blobs, back to back, in index order

The header and index are checked (magic, version, a count the file size can hold, the index's sha256, offsets
that tile the data exactly to the end of the file) before anything is allocated from them, so a bit flip,
truncation or zeroed block anywhere in a pack is an IntegrityError, never wrong data. The data of a pack of
``count`` blobs starts at ``HEADER_BYTES + count * ENTRY_BYTES``: a writer that knows the count can write the data
before it knows the digests, and the index last.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from ..errors import IntegrityError

PACK_MAGIC = b"KDAP"
PACK_VERSION = 1
_HEADER = struct.Struct("<4sB3xI32s")  # magic, version, pad, count, sha256 of the index
_ENTRY = struct.Struct("<32sQQ")  # raw sha256, offset, length
HEADER_BYTES = _HEADER.size
ENTRY_BYTES = _ENTRY.size


def encode_index(items: Sequence[tuple[str, int]]) -> bytes:
    """Header + index of a pack holding blobs ``(digest, length)`` in this order."""
    offset = _HEADER.size + _ENTRY.size * len(items)
    entries = bytearray()
    for d, n in items:
        entries += _ENTRY.pack(bytes.fromhex(d), offset, n)
        offset += n
    return _HEADER.pack(PACK_MAGIC, PACK_VERSION, len(items), hashlib.sha256(entries).digest()) + entries


def parse_index(read: Callable[[int, int], bytes], size: int, where: str) -> dict[str, tuple[int, int]]:
    """Validate a pack's header and index (read through ``read(offset, n)``) against its file ``size``;
    digest -> (offset, length). IntegrityError naming ``where`` on anything inconsistent."""
    if size < _HEADER.size:
        raise IntegrityError(f"{where}: pack truncated: {size} bytes, header needs {_HEADER.size}")
    magic, version, count, index_sha = _HEADER.unpack(read(0, _HEADER.size))
    if magic != PACK_MAGIC or version != PACK_VERSION:
        raise IntegrityError(f"{where}: bad pack header (magic {magic!r}, version {version})")
    if count == 0 or _HEADER.size + count * _ENTRY.size > size:
        raise IntegrityError(f"{where}: pack claims {count} blobs, which its {size} bytes cannot hold")
    raw = read(_HEADER.size, count * _ENTRY.size)
    if len(raw) != count * _ENTRY.size or hashlib.sha256(raw).digest() != index_sha:
        raise IntegrityError(f"{where}: pack index does not match its checksum; corrupt or truncated")
    out: dict[str, tuple[int, int]] = {}
    expect = _HEADER.size + count * _ENTRY.size
    for d, off, n in _ENTRY.iter_unpack(raw):
        if off != expect or d.hex() in out:
            raise IntegrityError(f"{where}: pack index entry at {off} breaks the layout (expected {expect})")
        out[d.hex()] = (off, n)
        expect = off + n
    if expect != size:
        raise IntegrityError(f"{where}: pack data ends at {expect}, the file has {size} bytes; truncated?")
    return out
