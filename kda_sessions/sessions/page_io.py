"""Full KV pages between the pool and their blobs in bulk: no Python work per page beyond a slice.

Every full page of a model has the same blob header (`tensor_header` of [L_mla, P, r + dr]). Save: per chunk one
gather per MLA layer and one device-to-host copy (into pinned memory on CUDA; on the CPU the pool pages are the
source), each blob copied out and hashed on one of several threads while the next chunk is staged. Restore: the store writes each verified blob straight into
its place (`SnapshotStore.load_blobs_into`): on the CPU the pool pages themselves, on CUDA a pinned staging
buffer per chunk, copied to the device while the next chunk is read; headers land in a scratch buffer and are
checked with one comparison. A blob whose header or length differs goes through ``decode_page`` for its precise
error.

Shapes: pool ``kv[l]`` [num_pages, P, C] (C = r + dr), a chunk [n, L_mla, P, C], a page blob's payload the
C-contiguous bytes of [L_mla, P, C].
"""

from __future__ import annotations

import ctypes
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from ..config import ModelConfig
from ..model import StatePools
from ..storage import SnapshotStore
from ..storage.blobs import HASH_THREADS, digest, join, tensor_header
from .codec import decode_page

CHUNK_BYTES = 64 << 20
"""Bytes of pages moved per device copy: large enough for full copy bandwidth, small enough to overlap."""


def _raw_view(address: int, nbytes: int) -> memoryview:
    """``nbytes`` of memory at ``address`` as a writable memoryview (valid while its owner lives)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _host_view(t: Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview (valid while ``t`` lives)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return _raw_view(t.data_ptr(), t.numel() * t.element_size())


def _join_digest(header: bytes, parts: Sequence[tuple[int, int]]) -> tuple[str, bytes]:
    """One page blob made from its parts (`join`, without the GIL) and hashed while it is still in the cache."""
    data = join(header, parts)
    return digest(data), data


class PageCodec:
    """Encodes and decodes full pages of one pool (page size P, dtype of the model)."""

    def __init__(self, pools: StatePools, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.pools = pools
        self.cfg = cfg
        self.dtype = dtype
        self.shape = (len(cfg.mla_layer_ids), pools.page_size, cfg.latent_dim)  # [L, P, C]
        self.header = tensor_header(dtype, list(self.shape))
        self.page_bytes = self.shape[0] * self.shape[1] * self.shape[2] * dtype.itemsize
        self.per_chunk = max(1, CHUNK_BYTES // max(1, self.page_bytes))
        self.device = pools.kv[0].device if pools.kv else torch.device("cpu")
        self.staged = self.device.type == "cuda"
        """Saves copy each chunk of pages into a host buffer first (pinned on CUDA); else blobs are joined
        straight from the pool's pages."""
        assert not pools.kv or pools.kv[0].dtype == dtype, "KV pool and model dtypes differ"

    def _staging(self, n: int) -> Tensor:
        return torch.empty((n, self.page_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    # -- save ------------------------------------------------------------------------------------------------

    def encode(self, pages: Sequence[int]) -> list[tuple[str, bytes]]:
        """(digest, blob) of each full pool page in ``pages``, in order (`encode_chunks`)."""
        return [item for chunk in self.encode_chunks(pages) for item in chunk]

    def encode_chunks(self, pages: Sequence[int]) -> Generator[list[tuple[str, bytes]], None, None]:
        """(digest, blob) of each full pool page in ``pages``, in order, a chunk of up to `per_chunk` pages at
        a time. Each blob is copied out of its source and hashed on one of `HASH_THREADS` threads (the copy
        into fresh memory, page faults included, and sha256 run without the GIL), and the next chunk is
        staged before this one is yielded, so the consumer writes chunk i while chunk i + 1 is made. On CUDA
        the source is a pinned host buffer per chunk (one gather per layer, one device-to-host copy); on the
        CPU the pool pages themselves (no gather)."""
        if not pages:
            return
        pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="page-blob")
        in_flight: list[tuple[Tensor | None, list[Future[tuple[str, bytes]]]]] = []  # sources the threads read
        try:
            for i in range(0, len(pages), self.per_chunk):
                ids = list(pages[i : i + self.per_chunk])
                source, parts = self._stage(ids) if self.staged else (None, self._parts(ids))
                in_flight.append((source, [pool.submit(_join_digest, self.header, p) for p in parts]))
                if len(in_flight) > 1:
                    yield self._done(in_flight)
            while in_flight:
                yield self._done(in_flight)
        finally:  # also when the consumer stops early: the sources outlive every job that reads them
            pool.shutdown(wait=True, cancel_futures=True)
            in_flight.clear()

    @staticmethod
    def _done(in_flight: list[tuple[Tensor | None, list[Future[tuple[str, bytes]]]]]) -> list[tuple[str, bytes]]:
        """The oldest chunk's blobs, once every job that reads its source is done; only then is the source let go
        (popped first, it was freed under the running jobs: the allocator wrote its free-list into the buffer)."""
        source, jobs = in_flight[0]
        blobs = [f.result() for f in jobs]
        del in_flight[0], source
        return blobs

    def _stage(self, ids: list[int]) -> tuple[Tensor, list[list[tuple[int, int]]]]:
        """Pool pages ``ids`` gathered on the device and copied into a pinned host buffer [n, page_bytes]; the
        buffer and each page's (address, nbytes) in it."""
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        block = torch.stack([kv.index_select(0, idx) for kv in self.pools.kv], dim=1)  # [n, L, P, C]
        host = self._staging(len(ids))
        host.copy_(block.view(len(ids), -1).view(torch.uint8))
        base, b = host.data_ptr(), self.page_bytes
        return host, [[(base + j * b, b)] for j in range(len(ids))]

    def _parts(self, ids: list[int]) -> list[list[tuple[int, int]]]:
        """Each CPU pool page's (address, nbytes) in every layer: a blob is joined straight from the pool."""
        layer_bytes = self.page_bytes // self.shape[0]
        assert all(kv.is_contiguous() for kv in self.pools.kv)
        bases = [kv.data_ptr() for kv in self.pools.kv]  # kv[l] [num_pages, P, C]: page p at p * layer_bytes
        return [[(base + p * layer_bytes, layer_bytes) for base in bases] for p in ids]

    # -- load ------------------------------------------------------------------------------------------------

    async def restore(
        self, snapshots: SnapshotStore, pages: Sequence[int], digests: Sequence[str], where: str, stream: object = None
    ) -> None:
        """Read the full-page blobs ``digests`` from ``snapshots`` into pool ``pages``, verified, with no bytes
        object in between where the store reads files (`SnapshotStore.load_blobs_into`). On the CPU each blob
        goes straight into its pool pages: header into a scratch buffer, each layer's rows into that layer's
        page, all pages in one batch that the store spreads over its threads. On CUDA a chunk at a time into
        a pinned staging buffer, whose device copy and ``index_copy_`` per layer are queued on ``stream`` (a
        torch.cuda.Stream) while the next chunk is read; the caller synchronizes it before the pages are used.
        A blob that is not a full page of this model raises what ``decode_page`` says of it."""
        assert len(pages) == len(digests)
        cuda = self.device.type == "cuda"
        step = self.per_chunk if cuda else max(1, len(pages))
        for a in range(0, len(pages), step):
            ids, ds = list(pages[a : a + step]), list(digests[a : a + step])
            n, hlen = len(ids), len(self.header)
            heads = memoryview(bytearray(n * hlen))
            if cuda:
                host = self._staging(n)
                view = _host_view(host)
                bodies = [[view[j * self.page_bytes : (j + 1) * self.page_bytes]] for j in range(n)]
            else:
                b = self.page_bytes // self.shape[0]
                # kv[l] is [num_pages, P, C], contiguous: page p of layer l is bytes [p * b, (p + 1) * b) of it;
                # slices of one view a layer (a ctypes object a page cost ~1-20 us, GC-tracked, growing with n)
                layers = [_host_view(kv) for kv in self.pools.kv]
                bodies = [[layer[page * b : (page + 1) * b] for layer in layers] for page in ids]
            targets = [(d, [heads[j * hlen : (j + 1) * hlen], *bodies[j]]) for j, d in enumerate(ds)]
            bad = set(await snapshots.load_blobs_into(targets))
            if bad or heads != self.header * n:
                bad |= {j for j in range(n) if heads[j * hlen : (j + 1) * hlen] != self.header}
                for j in sorted(bad):
                    self.check(await snapshots.load_blob(ds[j]), where)  # raises, naming what differs
                    raise AssertionError("a stored page blob changed while it was read")  # pragma: no cover
            if cuda:
                assert isinstance(stream, torch.cuda.Stream)
                self._to_device(host, ids, stream)

    def _to_device(self, host: Tensor, pages: list[int], stream: torch.cuda.Stream) -> None:
        """Queue host [n, page_bytes] (pinned) -> pool ``pages`` on ``stream``: one copy, one index_copy_ a layer.
        The caching host allocator keeps ``host`` from reuse until the queued copy is done."""
        L, P, C = self.shape
        with torch.cuda.stream(stream):
            block = host.to(self.device, non_blocking=True).view(self.dtype).view(len(pages), L, P, C)
            idx = torch.tensor(pages, dtype=torch.long).to(self.device, non_blocking=True)
            for layer, kv in enumerate(self.pools.kv):
                kv.index_copy_(0, idx, block[:, layer])

    def check(self, data: bytes, where: str) -> None:
        """Raise IncompatibleSnapshot / IntegrityError unless ``data`` is a full page blob of this model."""
        if len(data) != len(self.header) + self.page_bytes or data[: len(self.header)] != self.header:
            decode_page(data, self.cfg, self.dtype, self.shape[1], where)  # raises, naming what differs
            raise AssertionError("decode_page accepted a blob the page codec refused")  # pragma: no cover
