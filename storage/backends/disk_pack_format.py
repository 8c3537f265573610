"""The pack file format of the disk store (see disk_pack). Version 2, written now::

    header   b"KDAP" | version u8 = 2 | 3 zero bytes
    data     the blobs, back to back, in index order, from offset HEADER_BYTES
    index    count x (sha256 of the blob: 32 raw bytes | offset u64 LE | length u64 LE)
    trailer  count u32 LE | sha256 of the index (32 raw bytes) | b"KDAP"

The index comes last, so a writer starts on the data before it knows how many blobs the pack will hold (a save
writes its first pages while its KDA states are still being hashed, and drops a blob seen twice without moving
anything). Version 1 packs (index before the data) are still read::

    header  b"KDAP" | version u8 = 1 | 3 zero bytes | count u32 LE | sha256 of the index (32 raw bytes)
    index   count x entry, as above
    data    the blobs, back to back, in index order

Both are checked (magics, version, a count the file size can hold, the index's sha256, offsets that tile the data
exactly) before anything is allocated from them, so a bit flip, truncation or zeroed block anywhere in a pack is
an IntegrityError, never wrong data.

Every later version keeps the magic as the first and the last 4 bytes and its version byte at offset 4: a pack so
framed, with a version above `PACK_VERSION` (written by a newer release), is IncompatibleSnapshot naming that
version, and the store leaves it alone (disk_pack.PackSet.newer). One that is a whole, valid version 2 pack but for
its version byte is a damaged version 2 pack (IntegrityError), as is a version byte flipped in a version 1 pack
(whose last bytes are data).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from ..errors import IncompatibleSnapshot, IntegrityError

PACK_MAGIC = b"KDAP"
PACK_VERSION = 2
"""The version `encode_index` writes; `parse_index` reads it and version 1."""
_START = struct.Struct("<4sB3x")  # magic, version, pad: the first bytes of every version
_HEADER_V1 = struct.Struct("<4sB3xI32s")  # magic, version, pad, count, sha256 of the index
_TRAILER = struct.Struct("<I32s4s")  # count, sha256 of the index, magic
_ENTRY = struct.Struct("<32sQQ")  # raw sha256, offset, length
HEADER_BYTES = _START.size
"""Where a version 2 pack's data starts: the header is written first, the data right after it."""
ENTRY_BYTES = _ENTRY.size
TRAILER_BYTES = _TRAILER.size


def encode_header() -> bytes:
    """The first `HEADER_BYTES` of a pack."""
    return _START.pack(PACK_MAGIC, PACK_VERSION)


def encode_index(items: Sequence[tuple[str, int]]) -> bytes:
    """Index + trailer of a pack whose data, from `HEADER_BYTES` on, is blobs ``(digest, length)`` in this order;
    written right after the last blob."""
    offset = HEADER_BYTES
    entries = bytearray()
    for d, n in items:
        entries += _ENTRY.pack(bytes.fromhex(d), offset, n)
        offset += n
    return bytes(entries) + _TRAILER.pack(len(items), hashlib.sha256(entries).digest(), PACK_MAGIC)


def parse_index(read: Callable[[int, int], bytes], size: int, where: str) -> dict[str, tuple[int, int]]:
    """Validate a pack's header and index (read through ``read(offset, n)``) against its file ``size``;
    digest -> (offset, length). IntegrityError naming ``where`` on anything inconsistent; IncompatibleSnapshot
    naming the version for a pack of a newer format (see the module's docstring)."""
    if size < _START.size:
        raise IntegrityError(f"{where}: pack truncated: {size} bytes, header needs {_START.size}")
    magic, version = _START.unpack(read(0, _START.size))
    if magic == PACK_MAGIC and version > PACK_VERSION:
        try:
            _parse(read, size, where, PACK_VERSION)
        except IntegrityError:
            if size >= _START.size + 4 and read(size - 4, 4) == PACK_MAGIC:
                raise IncompatibleSnapshot(
                    f"{where}: pack format version {version}, newer than this release reads (1 to {PACK_VERSION})"
                ) from None
        else:
            raise IntegrityError(
                f"{where}: bad pack header: version {version} on a valid version {PACK_VERSION} pack (a flipped bit)"
            )
    if magic != PACK_MAGIC or version not in (1, 2):
        raise IntegrityError(f"{where}: bad pack header (magic {magic!r}, version {version})")
    return _parse(read, size, where, version)


def _parse(read: Callable[[int, int], bytes], size: int, where: str, version: int) -> dict[str, tuple[int, int]]:
    if version == 1:
        if size < _HEADER_V1.size:
            raise IntegrityError(f"{where}: pack truncated: {size} bytes, header needs {_HEADER_V1.size}")
        _, _, count, index_sha = _HEADER_V1.unpack(read(0, _HEADER_V1.size))
        index_at = data_at = _HEADER_V1.size
        data_at += count * _ENTRY.size
        data_end = size
    else:
        if size < _START.size + _TRAILER.size:
            raise IntegrityError(f"{where}: pack truncated: {size} bytes, no room for its trailer")
        count, index_sha, tail = _TRAILER.unpack(read(size - _TRAILER.size, _TRAILER.size))
        if tail != PACK_MAGIC:
            raise IntegrityError(f"{where}: bad pack trailer (magic {tail!r}); truncated?")
        index_at = data_end = size - _TRAILER.size - count * _ENTRY.size
        data_at = _START.size
    if count == 0 or index_at < _START.size or data_at > size or data_end < data_at:
        raise IntegrityError(f"{where}: pack claims {count} blobs, which its {size} bytes cannot hold")
    raw = read(index_at, count * _ENTRY.size)
    if len(raw) != count * _ENTRY.size or hashlib.sha256(raw).digest() != index_sha:
        raise IntegrityError(f"{where}: pack index does not match its checksum; corrupt or truncated")
    out: dict[str, tuple[int, int]] = {}
    expect = data_at
    for d, off, n in _ENTRY.iter_unpack(raw):
        if off != expect or d.hex() in out:
            raise IntegrityError(f"{where}: pack index entry at {off} breaks the layout (expected {expect})")
        out[d.hex()] = (off, n)
        expect = off + n
    if expect != data_end:
        raise IntegrityError(f"{where}: pack data ends at {expect}, its index says {data_end}; truncated?")
    return out
