"""CUDA graphs for the decode step: capture ``HybridModel.decode`` once per (batch bucket, page-table width) and
replay it, so a decode step costs one graph launch instead of ~1,000 kernel launches from Python.

A decode batch of N sequences is padded up to its bucket (1, 2, 4, ... ``max_batch``) with dummy rows that feed
token 0 from the pools' scratch slot and scratch page (context length 1), so they touch no session's state.
Page tables are padded to a width bucket (a power of two pages, at least ``min_width``, at most the pool's page
count); a sequence that outgrows its width is served by the graph of the next width, captured on first use.
Every input lives in one static int32 device buffer per graph, filled from a pinned host buffer by one copy;
page-table rows that did not change since the last step (same page list, same length) are not rewritten. The
new tokens' flat cache rows are computed on the host into the same buffer (int64), rather than by ~6 small
kernels at the start of every step.

A step may take its first rows' input ids on the device from an earlier step's sampled tokens (``Feed``), so it
can be queued before the host has read them (the engine's decode ahead, ``EngineConfig.decode_ahead``). A fed row
whose token is a stop token runs as a dummy (scratch slot and page, context 1): the request it belongs to has
ended, so its state and cache must stay as they were.

Without graphs (a CPU model, ``enabled=False``, or a capture that failed) ``run`` executes the same static-buffer
step eagerly, which is what the CPU tests check against ``HybridModel.step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..kernels.feed import feed_decode_rows
from .batch import DecodeInputs, StatePools
from .model import HybridModel

log = logging.getLogger(__name__)

Out = TypeVar("Out")

MAX_DECODE_BATCH = 64
"""The default largest decode batch captured (buckets 1, 2, 4, ... 64)."""


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (included even when not a power of two)."""
    out = [1]
    while out[-1] * 2 <= max_batch:
        out.append(out[-1] * 2)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def width_bucket(max_pages: int, min_width: int, max_width: int) -> int:
    """The page-table width of a graph that serves sequences of up to ``max_pages`` pages: a power of two pages, at
    least ``min_width``, at most ``max_width`` (a pool's page count), never below ``max_pages``."""
    w = min_width
    while w < max_pages:
        w *= 2
    return max(min(w, max_width), max_pages)


def upload(ints: Tensor, host: Tensor) -> torch.cuda.Event | None:
    """Copy a graph's host input buffer into its device buffer: on CUDA without waiting, returning the event after
    which the host buffer may be written again."""
    if ints.device.type != "cuda":
        ints.copy_(host)
        return None
    ints.copy_(host, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return copied


def capture_graph(run: Callable[[], Out], device: torch.device, mempool: Any) -> tuple[torch.cuda.CUDAGraph, Out]:
    """``run`` warmed up twice on a side stream (Triton compiles on first call, cuBLAS picks its kernels), then
    captured into the private pool ``mempool``: (the graph, the output it writes on every replay). Returns once the
    warm-up's device work has ended, so the caller's clock holds what the capture cost the step thread."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
        out = run()
    torch.cuda.synchronize(device)
    return graph, out


@dataclass
class Feed:
    """Input ids of a step's first rows taken on the device from an earlier step's sampled tokens: row i feeds
    ``tokens[rows[i]]``; where ``can_stop[i]`` and that token is one of ``stop_ids``, row i runs as a dummy."""

    tokens: Tensor
    """[K] int64 on the model's device."""
    rows: list[int]
    stop_ids: Tensor
    """[S] int64 on the model's device (S >= 1)."""
    can_stop: list[bool]


@dataclass
class _Static:
    """The static inputs of one bucket: bs rows, width pages per row, all in one int32 device buffer
    (ids | slots | seq_lens | kv_rows as int64 | a ``Feed``'s rows | its can_stop | page table rows, each part
    16-byte aligned), its host twin (pinned on CUDA), and the captured graph with its output logits [bs, vocab]."""

    bs: int
    width: int
    ints: Tensor
    host: Tensor
    inputs: DecodeInputs
    kv_rows: Tensor
    """[bs] int64, a view of ``ints``: each row's new cache row (``DecodeInputs.kv_rows``), written by the host."""
    graph: torch.cuda.CUDAGraph | None = None
    out: Tensor | None = None
    copied: torch.cuda.Event | None = None
    rows: list[tuple[list[int] | None, int]] = field(default_factory=list)
    """Per page-table row: the page list last written there (kept alive so its identity is a safe key) and
    its length then. Session page lists only grow in place, so the same list at the same length is unchanged."""


class DecodeGraphs:
    """Decode steps of up to ``max_batch`` sequences from static buffers, replayed from CUDA graphs on a GPU.

    ``run`` takes host lists and returns logits [N, vocab] float32; on CUDA a view of the buffer every graph
    writes, valid until the next ``run``.
    """

    def __init__(
        self, model: HybridModel, pools: StatePools, max_batch: int = MAX_DECODE_BATCH,
        enabled: bool = True, min_width: int = 16, capture_lock: AbstractContextManager | None = None,
    ) -> None:
        if pools.scratch_slot is None or pools.scratch_page is None:
            raise ValueError("DecodeGraphs needs pools with a scratch slot and page (allocate_pools(scratch=True))")
        self.max_batch = max(1, max_batch)
        self.buckets = batch_buckets(self.max_batch)
        self.model = model
        self.pools = pools
        self.device = model.device
        self.use_graphs = enabled and self.device.type == "cuda"
        if self.device.type == "cuda":
            model.stack_experts()  # the routed experts then run in the fused MoE kernels, graph-safe
        self.min_width = min_width
        self.capture_lock = capture_lock or nullcontext()
        """Held while warming up and capturing (the engine's pool mutex keeps other threads off the device)."""
        usable_pages = pools.kv[0].shape[0] - 1 if pools.kv else 1
        self.max_width = max(1, usable_pages)
        self._static: dict[tuple[int, int], _Static] = {}
        self._logits_out: Tensor | None = None
        """The logits every graph writes, at the largest batch bucket captured so far (a graph's own output would
        stay allocated per key: [bs, vocab] float32, 42 MB at 64 rows of a 163,840 vocabulary, per width)."""
        self.mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0
        """Seconds the captures took (warm-ups, Triton's first compiles among them), all buckets together."""
        self.eager_runs = 0
        self.capture_error: str | None = None

    def accepts(self, n: int) -> bool:
        return 1 <= n <= self.max_batch

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def width(self, max_pages: int) -> int:
        return width_bucket(max_pages, self.min_width, self.max_width)

    def graph_for(self, n: int, max_pages: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph that serves n sequences of at most ``max_pages`` pages (None before capture)."""
        st = self._static.get((self.bucket(n), self.width(max_pages)))
        return st.graph if st is not None else None

    @torch.inference_mode()
    def run(self, input_ids: list[int], slots: list[int], seq_lens: list[int], pages: list[list[int]],
            feed: Feed | None = None) -> Tensor:
        """One decode step: sequence n feeds ``input_ids[n]`` at position ``seq_lens[n] - 1`` from KDA slot
        ``slots[n]``, its context in ``pages[n]`` (at least ceil(seq_lens[n] / P) pages, allocated by the
        caller); with ``feed``, its first ``len(feed.rows)`` sequences feed tokens on the device instead (their
        ``input_ids`` are ignored). Returns logits [N, vocab] float32."""
        N = len(input_ids)
        if feed is not None and not (len(feed.rows) == len(feed.can_stop) <= N):
            raise ValueError(f"a feed needs one row index and one can_stop per fed row, at most {N}; got "
                             f"{len(feed.rows)} and {len(feed.can_stop)}")
        if not self.accepts(N) or not (len(slots) == len(seq_lens) == len(pages) == N):
            raise ValueError(f"need 1..{self.max_batch} sequences with one entry each, got {N}, {len(slots)}, "
                             f"{len(seq_lens)}, {len(pages)}")
        st = self._get(self.bucket(N), self.width(max(len(p) for p in pages)))
        if st.graph is None and self.use_graphs:
            with self.capture_lock:
                self._capture(st)
        self._fill(st, input_ids, slots, seq_lens, pages, feed)
        if feed is not None and feed.rows:
            self._feed(st, feed)
        if st.graph is not None:
            st.graph.replay()
            self.replays += 1
            assert st.out is not None
            return st.out[:N]
        self.eager_runs += 1
        return self.model.decode(st.inputs, self.pools, st.kv_rows)[:N]

    # -- static buffers --------------------------------------------------------------------------------------

    def _get(self, bs: int, width: int) -> _Static:
        key = (bs, width)
        if key not in self._static:
            b4 = -(-bs // 4) * 4  # each part starts 16-byte aligned
            ints = torch.empty(7 * b4 + bs * width, dtype=torch.int32, device=self.device)
            host = torch.empty(ints.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            inputs = DecodeInputs(
                input_ids=ints[:bs],
                slots=ints[b4 : b4 + bs],
                seq_lens=ints[2 * b4 : 2 * b4 + bs],
                page_table=ints[7 * b4 :].view(bs, width),  # contiguous [bs, width]
                cu_seqlens=torch.arange(bs + 1, dtype=torch.long, device=self.device),
            )
            kv_rows = ints[3 * b4 : 3 * b4 + 2 * bs].view(torch.int64)  # [bs] int64
            st = _Static(bs, width, ints, host, inputs, kv_rows, rows=[(None, 0)] * bs)
            self._fill(st, [], [], [], [])  # every row a dummy
            self._static[key] = st
        return self._static[key]

    def _fill(self, st: _Static, ids: list[int], slots: list[int], lens: list[int], pages: list[list[int]],
              feed: Feed | None = None) -> None:
        """Write the host buffer (real rows, then dummies on the scratch slot and page; a feed's rows and can_stop)
        and copy it over."""
        if st.copied is not None:
            st.copied.synchronize()  # the previous copy out of the host buffer has finished
        bs, N = st.bs, len(ids)
        b4 = -(-bs // 4) * 4
        scratch_slot, scratch_page = self.pools.scratch_slot, self.pools.scratch_page
        assert scratch_slot is not None and scratch_page is not None
        h = st.host.numpy()
        h[: 3 * b4] = 0
        h[:N] = ids
        h[b4 : b4 + N] = slots
        h[b4 + N : b4 + bs] = scratch_slot
        h[2 * b4 : 2 * b4 + N] = lens
        h[2 * b4 + N : 2 * b4 + bs] = 1
        P = self.pools.page_size
        rows = h[3 * b4 : 3 * b4 + 2 * bs].view(np.int64)
        for i in range(N):
            pos = lens[i] - 1
            if not 0 <= pos < len(pages[i]) * P:
                raise ValueError(f"sequence {i}: seq_len {lens[i]} needs {-(-lens[i] // P)} pages of {P}, got "
                                 f"{len(pages[i])}")
            rows[i] = pages[i][pos // P] * P + pos % P
        rows[N:] = scratch_page * P  # the dummies' one token, on the scratch page
        if feed is not None:
            M = len(feed.rows)
            h[5 * b4 : 5 * b4 + M] = feed.rows
            h[6 * b4 : 6 * b4 + M] = feed.can_stop
        table = h[7 * b4 :].reshape(bs, st.width)
        for i in range(bs):
            p = pages[i] if i < N else None
            last, n_last = st.rows[i]
            if p is None:
                if last is not None or n_last == 0:
                    table[i] = scratch_page
                    st.rows[i] = (None, -1)
                continue
            if p is last and n_last <= len(p):
                table[i, n_last : len(p)] = p[n_last:]  # only the pages appended since the last step
            else:
                table[i, : len(p)] = p
                table[i, len(p) :] = scratch_page
            st.rows[i] = (p, len(p))
        st.copied = upload(st.ints, st.host)

    def _feed(self, st: _Static, feed: Feed) -> None:
        """After ``_fill``'s copy: the fed rows' ids from ``feed.tokens``, and the rows whose token stops their
        request turned into dummies, on the device (``kernels.feed``; no sync). The next ``_fill`` copies the whole
        host buffer again, so nothing here outlives the step."""
        M = len(feed.rows)
        b4 = -(-st.bs // 4) * 4
        assert self.pools.scratch_slot is not None and self.pools.scratch_page is not None
        i = st.inputs
        feed_decode_rows(feed.tokens, st.ints[5 * b4 : 5 * b4 + M], st.ints[6 * b4 : 6 * b4 + M], feed.stop_ids,
                         i.input_ids[:M], i.slots[:M], i.seq_lens[:M], st.kv_rows[:M], i.page_table[:M],
                         self.pools.scratch_slot, self.pools.scratch_page, self.pools.page_size)

    # -- capture -------------------------------------------------------------------------------------------

    def _capture(self, st: _Static) -> None:
        """Warm up (Triton compiles on first call, cuBLAS picks its kernels), then capture into the shared
        private pool. The warm-up runs on dummy rows only (scratch slot and page), so no session moves. A failed
        capture turns graphs off and leaves the eager static path."""
        self._fill(st, [], [], [], [])
        t0 = time.perf_counter()
        try:
            if self._logits_out is None or self._logits_out.shape[0] < st.bs:  # outside the capture
                self._logits_out = torch.empty(st.bs, self.model.config.vocab_size, dtype=torch.float32,
                                               device=self.device)
            logits_out = self._logits_out[: st.bs]
            graph, out = capture_graph(lambda: self.model.decode(st.inputs, self.pools, st.kv_rows, logits_out),
                                       self.device, self.mempool)
        except Exception as e:
            log.warning("CUDA graph capture failed for batch %d, width %d: decode runs eagerly", st.bs, st.width,
                        exc_info=True)
            self.capture_error = f"{type(e).__name__}: {e}"
            self.use_graphs = False
            return
        st.graph, st.out = graph, out
        self.captures += 1
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("captured the decode step for batch %d, page-table width %d in %.0f ms", st.bs, st.width, dt * 1e3)
