"""Full KV pages between the pool and their blobs in bulk: no Python work per page beyond a slice.

Every full page of a model has the same blob header (`tensor_header` of [L_mla, P, r + dr]), so a batch of
pages is encoded by one gather per MLA layer and one device-to-host copy per chunk (into pinned memory on CUDA),
then cut into blobs, hashed on several threads while the next chunk is copied; and decoded by checking each
blob's header with one comparison, copying the payloads into one (pinned) staging buffer, one host-to-device
copy per chunk and one ``index_copy_`` per layer. A blob whose header or length differs goes through
``decode_page`` for its precise error.

Shapes: pool ``kv[l]`` [num_pages, P, C] (C = r + dr), a chunk [n, L_mla, P, C], a page blob's payload the
C-contiguous bytes of [L_mla, P, C].
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from ..config import ModelConfig
from ..model import StatePools
from ..storage.blobs import HASH_THREADS, tensor_header
from .codec import decode_page

CHUNK_BYTES = 64 << 20
"""Bytes of pages moved per device copy: large enough for full copy bandwidth, small enough to overlap."""


def _host_view(t: Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable memoryview (valid while ``t`` lives)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _page_digest(header: bytes, payload: memoryview) -> str:
    h = hashlib.sha256(header)
    h.update(payload)
    return h.hexdigest()


def _copy_payloads(host: Tensor, blobs: Sequence[bytes], offset: int, size: int) -> None:
    """host[j] = blobs[j][offset : offset + size] for every j, with memmove on up to HASH_THREADS threads
    (ctypes releases the GIL around it, so the copies run in parallel)."""
    base = host.data_ptr()

    def run(lo: int, hi: int) -> None:
        for j in range(lo, hi):
            src = ctypes.cast(ctypes.c_char_p(blobs[j]), ctypes.c_void_p).value
            assert src is not None and len(blobs[j]) == offset + size
            ctypes.memmove(base + j * size, src + offset, size)

    n = len(blobs)
    threads = min(HASH_THREADS, max(1, n * size // (8 << 20)))  # about 8 MiB a thread at least
    if threads <= 1:
        run(0, n)
        return
    step = -(-n // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="page-copy") as ex:
        for f in [ex.submit(run, lo, min(n, lo + step)) for lo in range(0, n, step)]:
            f.result()


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
        assert not pools.kv or pools.kv[0].dtype == dtype, "KV pool and model dtypes differ"

    def _staging(self, n: int) -> Tensor:
        return torch.empty((n, self.page_bytes), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    # -- save ------------------------------------------------------------------------------------------------

    def encode(self, pages: Sequence[int]) -> list[tuple[str, bytes]]:
        """(digest, blob) of each full pool page in ``pages``, in order. Per chunk: one gather per layer and one
        copy to (pinned) host memory; threads hash each page straight from that buffer (hashlib releases the
        GIL) while this thread copies the pages out into their blobs and the next chunk is gathered."""
        if not pages:
            return []
        blobs: list[bytes] = []
        futures: list[Future[str]] = []
        in_flight: list[tuple[Tensor, list[Future[str]]]] = []  # host buffers the hash threads still read
        b = self.page_bytes
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="page-hash") as pool:
            for i in range(0, len(pages), self.per_chunk):
                ids = list(pages[i : i + self.per_chunk])
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                block = torch.stack([kv.index_select(0, idx) for kv in self.pools.kv], dim=1)  # [n, L, P, C]
                host = self._staging(len(ids))
                host.copy_(block.view(len(ids), -1).view(torch.uint8))
                view = _host_view(host)
                chunk = [view[j * b : (j + 1) * b] for j in range(len(ids))]
                hashes = [pool.submit(_page_digest, self.header, v) for v in chunk]
                blobs.extend(self.header + v for v in chunk)
                futures.extend(hashes)
                in_flight.append((host, hashes))
                if len(in_flight) > 2:  # bound the pinned memory held: two chunks
                    oldest, oldest_hashes = in_flight.pop(0)
                    for f in oldest_hashes:
                        f.result()
                    del oldest  # freed only now: the hash threads read it through views that do not own it
            return [(f.result(), data) for f, data in zip(futures, blobs)]

    # -- load ------------------------------------------------------------------------------------------------

    def check(self, data: bytes, where: str) -> None:
        """Raise IncompatibleSnapshot / IntegrityError unless ``data`` is a full page blob of this model."""
        if len(data) != len(self.header) + self.page_bytes or data[: len(self.header)] != self.header:
            decode_page(data, self.cfg, self.dtype, self.shape[1], where)  # raises, naming what differs
            raise AssertionError("decode_page accepted a blob the page codec refused")  # pragma: no cover

    def load(self, pages: Sequence[int], blobs: Sequence[bytes], where: str, stream: object = None) -> None:
        """Write the full-page ``blobs`` (verified bytes) into pool ``pages``: one staging copy, one device
        copy and one ``index_copy_`` per layer. On CUDA the copies run on ``stream`` (a torch.cuda.Stream);
        the caller synchronizes it before the pages are used."""
        if not pages:
            return
        assert len(pages) == len(blobs)
        for data in blobs:
            self.check(data, where)
        n = len(pages)
        host = self._staging(n)
        _copy_payloads(host, blobs, len(self.header), self.page_bytes)
        L, P, C = self.shape
        if self.device.type == "cuda":
            assert isinstance(stream, torch.cuda.Stream)
            with torch.cuda.stream(stream):
                block = host.to(self.device, non_blocking=True).view(self.dtype).view(n, L, P, C)
                idx = torch.tensor(list(pages), dtype=torch.long).to(self.device, non_blocking=True)
                for layer, kv in enumerate(self.pools.kv):
                    kv.index_copy_(0, idx, block[:, layer])
        else:
            block = host.view(self.dtype).view(n, L, P, C)
            idx = torch.tensor(list(pages), dtype=torch.long)
            for layer, kv in enumerate(self.pools.kv):
                kv.index_copy_(0, idx, block[:, layer])
