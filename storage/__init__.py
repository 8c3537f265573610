"""Snapshot storage for kda_sessions: a versioned manifest naming content-addressed blobs, and the stores
(disk, redis, memory, plus a host-RAM tier) that hold them.

The engine uses `SnapshotStore` (save / load / delete with garbage collection), the codecs in `blobs`
(`encode_tensor`, `encode_tensors`, `digest`) and the manifest models. Nothing here imports the engine.
"""

from .backends import BlobStore, StoreStats, default_disk_root, open_store
from .blobs import decode_tensor, decode_tensors, digest, encode_tensor, encode_tensors
from .errors import (
    BlobNotFound,
    IncompatibleSnapshot,
    IntegrityError,
    KdaSessionsError,
    ManifestNotFound,
    StoreError,
    StoreUnavailable,
)
from .manifest import FORMAT_VERSION, CheckpointRecord, ModelFingerprint, SessionManifest
from .snapshot import GcResult, SaveResult, SnapshotStore
from .stream import BlobStream
from .tier import RamTier, TieredStore

__all__ = [
    "FORMAT_VERSION",
    "BlobNotFound",
    "BlobStore",
    "BlobStream",
    "CheckpointRecord",
    "GcResult",
    "IncompatibleSnapshot",
    "IntegrityError",
    "KdaSessionsError",
    "ManifestNotFound",
    "ModelFingerprint",
    "RamTier",
    "SaveResult",
    "SessionManifest",
    "SnapshotStore",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "TieredStore",
    "decode_tensor",
    "decode_tensors",
    "default_disk_root",
    "digest",
    "encode_tensor",
    "encode_tensors",
    "open_store",
]
