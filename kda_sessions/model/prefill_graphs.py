"""CUDA graphs for short prefill steps: an agent's tool output of a few dozen tokens appended to a long conversation.

Run eagerly such a step is bound by the host: ~900 kernel launches from Python (~30 us each at the 48B shape's first
16 layers, ~27 ms) for a few milliseconds of device work (docs/benchmarks.md, "Agents' turns"). Here it is one graph
launch: ``HybridModel.prefill_padded`` captured once per (sequences bucket, chunk bucket, page-table width, whether
it returns states inside the chunks) and replayed.

A step of N sequences feeding t_n <= ``max_tokens`` tokens each after s_n >= 1 cached ones is laid out at fixed
shapes (``PaddedPrefill``): N up to its bucket (1, 2, 4, ... ``max_batch``) with dummy sequences on the pools'
scratch slot and page, every chunk padded to the chunk bucket Tb (16, 32, ... ``max_tokens``). The padding changes
no state: its KDA gate and beta are zeroed, conv tails are taken after the real tokens, its cache rows land on the
scratch page, and the MLA layers attend absorbed (kernels/mla/absorbed.py), causal, so no real query reads it. Page
tables are padded to a width bucket as ``DecodeGraphs`` pads them. Inputs live in one static int32 device buffer
per graph, filled from a pinned host buffer by one copy.

A replay can also return each sequence's state after p of its chunk's tokens (``run(checkpoint_at=)``: a chat turn's
input holds its message's end, a checkpoint, before the assistant's header). Longer chunks, a sequence with no cached
token, or more sequences run eagerly (``HybridModel.step``), as the runner decides. Without graphs (a CPU model, ``enabled=False``, a failed capture) ``run`` executes the same
static-buffer step eagerly, which is what the CPU tests check against ``HybridModel.step``.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..kernels.kda import chunk_table
from ..kernels.mla import absorbed_splits, served_head_block
from .batch import CheckpointStates, PaddedPrefill, StatePools
from .graphs import batch_buckets, capture_graph, upload, width_bucket
from .model import HybridModel

log = logging.getLogger(__name__)

PREFILL_GRAPH_MAX_TOKENS = 128
"""The longest chunk a prefill graph takes (buckets 16, 32, 64, 128). MLA attends absorbed in it, whose cost per
cached row grows with the chunk (2 T H (2 r + dr) flops a row): replayed, 3.6 ms a layer for 128 tokens after 128K
(27 ms after 1M) against the decompressed kernel's ~4.7 (~37). Turns through the Engine (H100, the 48B shape's first
16 layers): 128 tokens graphed 44.6 ms against 52.5 eager at 1 x 128K, 114.7 against 118.2 at 8 x 32K
(docs/benchmarks.md, "Agents' turns"); longer chunks are not timed graphed."""
PREFILL_GRAPH_MAX_BATCH = 32
"""The most sequences of a prefill graph (buckets 1, 2, 4, 8, 16, 32). 32 agents appending 16 tokens at once (H100,
the 48B shape's first 16 layers, 32 x 32K cached): 68.3 ms to their first tokens, against 207.6 with at most 8
(the step then ran eagerly)."""
MIN_CHUNK_BUCKET = 16


@dataclass
class _Static:
    """One graph's static inputs: bs sequences of tb tokens, width pages each, in one int32 device buffer (ids |
    slots | starts | lens | last | ck_lens | kv_rows as int64 | page table, each part 16-byte aligned), its host twin
    (pinned on CUDA), and the captured graph with its outputs (``HybridModel.prefill_padded``'s)."""

    bs: int
    tb: int
    width: int
    ints: Tensor
    host: Tensor
    inputs: PaddedPrefill
    graph: torch.cuda.CUDAGraph | None = None
    out: tuple[Tensor, CheckpointStates | None] | None = None
    copied: torch.cuda.Event | None = None
    keep: list[Any] = field(default_factory=list)
    """Device tensors the graph reads that no one else keeps alive (the KDA kernels' cached chunk table)."""


class PrefillGraphs:
    """Prefill steps of up to ``max_batch`` short chunks from static buffers, replayed from CUDA graphs on a GPU.

    ``run`` takes host lists and returns logits [N, vocab] float32 (each chunk's last token's), a view of a buffer
    every graph writes, valid until the next ``run``.
    """

    def __init__(
        self, model: HybridModel, pools: StatePools, max_batch: int | None = None, max_tokens: int | None = None,
        enabled: bool = True, min_width: int = 16,
        capture_lock: AbstractContextManager | None = None, mempool: Any = None,
    ) -> None:
        if pools.scratch_slot is None or pools.scratch_page is None:
            raise ValueError("PrefillGraphs needs pools with a scratch slot and page (allocate_pools(scratch=True))")
        max_batch = PREFILL_GRAPH_MAX_BATCH if max_batch is None else max_batch
        max_tokens = PREFILL_GRAPH_MAX_TOKENS if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.model = model
        self.pools = pools
        self.device = model.device
        self.batch_buckets = batch_buckets(max(1, max_batch))
        self.max_batch = self.batch_buckets[-1]
        self.chunk_buckets = batch_buckets(max_tokens)
        self.chunk_buckets = [b for b in self.chunk_buckets if b >= min(MIN_CHUNK_BUCKET, max_tokens)]
        self.max_tokens = max_tokens
        self.use_graphs = enabled and self.device.type == "cuda"
        if self.device.type == "cuda":
            model.stack_experts()  # the routed experts in the fused MoE kernels: graph-safe
        self.min_width = min_width
        self.max_width = max(1, pools.num_pages - 1)
        self.capture_lock = capture_lock or nullcontext()
        self._sm = (torch.cuda.get_device_properties(self.device).multi_processor_count
                    if self.device.type == "cuda" else 4)
        self._static: dict[tuple[int, int, int, bool], _Static] = {}
        self._logits_out: Tensor | None = None
        self._states_out: CheckpointStates | None = None
        """The outputs every graph writes (logits; the states inside the chunks), shared (``_outputs``): a graph's
        own outputs would stay allocated per key, and the states are ~42 MB a sequence at the 48B shape (kda
        [N, 20, 32, 128, 128] float32), 16 keys of 8 sequences 5.4 GB. Valid until the next ``run``."""
        self._mempool = (mempool if mempool is not None else torch.cuda.graph_pool_handle()) if self.use_graphs else None
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0
        """Seconds the captures took (warm-ups, Triton's first compiles among them): the step thread's stall."""
        self.eager_runs = 0
        self.capture_error: str | None = None

    def accepts(self, num_new: list[int], starts: list[int]) -> bool:
        """Whether a step of these chunks runs here: 1..max_batch sequences, each 1..max_tokens tokens after at
        least one cached token."""
        return (1 <= len(num_new) <= self.max_batch and len(starts) == len(num_new)
                and all(1 <= t <= self.max_tokens for t in num_new) and all(s >= 1 for s in starts))

    def width(self, max_pages: int) -> int:
        return width_bucket(max_pages, self.min_width, self.max_width)

    def key(self, num_new: list[int], max_pages: int, checkpoint: bool = False) -> tuple[int, int, int, bool]:
        """(sequences bucket, chunk bucket, width, whether it returns states inside the chunks) of a step."""
        bs = next(b for b in self.batch_buckets if b >= len(num_new))
        tb = next(b for b in self.chunk_buckets if b >= max(num_new))
        return bs, tb, self.width(max_pages), checkpoint

    @torch.inference_mode()
    def run(self, input_ids: list[int], num_new: list[int], slots: list[int], starts: list[int],
            pages: list[list[int]], checkpoint_at: list[int] | None = None) -> tuple[Tensor, CheckpointStates | None]:
        """One prefill step: sequence n feeds the next ``num_new[n]`` of ``input_ids`` (packed in sequence order)
        at positions ``starts[n]`` .. from KDA slot ``slots[n]``, its pages ``pages[n]`` covering starts[n] +
        num_new[n] tokens (allocated by the caller). Returns (logits [N, vocab] float32, each chunk's last token's;
        with ``checkpoint_at`` [N], p in [1, num_new[n]], the states after p tokens of each chunk (kda [N, L_kda,
        H, K, V] float32, conv [N, L_kda, W - 1, Dc]), else None): views of buffers every key shares, valid until
        the next ``run``."""
        N = len(num_new)
        if not self.accepts(num_new, starts) or not (len(slots) == len(pages) == N):
            raise ValueError(f"need 1..{self.max_batch} sequences of 1..{self.max_tokens} tokens after >= 1 cached "
                             f"ones, one slot and page list each; got num_new={num_new}, starts={starts}, "
                             f"{len(slots)} slots, {len(pages)} page lists")
        if len(input_ids) != sum(num_new):
            raise ValueError(f"input_ids holds {len(input_ids)} tokens, num_new sums to {sum(num_new)}")
        if checkpoint_at is not None and not (len(checkpoint_at) == N
                                              and all(1 <= p <= t for p, t in zip(checkpoint_at, num_new))):
            raise ValueError(f"checkpoint_at needs one position in [1, num_new[n]] per sequence, got {checkpoint_at} "
                             f"for num_new={num_new}")
        st = self._get(*self.key(num_new, max(len(p) for p in pages), checkpoint_at is not None))
        if st.graph is None and self.use_graphs:
            self._outputs(st.bs, checkpoint_at is not None)
            with self.capture_lock:
                self._capture(st)
        self._fill(st, input_ids, num_new, slots, starts, pages, checkpoint_at)
        if st.graph is not None:
            st.graph.replay()
            self.replays += 1
            assert st.out is not None
            logits, states = st.out
        else:
            self.eager_runs += 1
            logits, states = self._step(st)
        if states is not None:
            states = CheckpointStates(kda=states.kda[:N], conv=states.conv[:N])
        return logits[:N], states

    def _step(self, st: _Static) -> tuple[Tensor, CheckpointStates | None]:
        """``HybridModel.prefill_padded`` of ``st``'s inputs into the shared outputs' first st.bs rows."""
        logits_out, states_out = self._outputs(st.bs, st.inputs.ck_lens is not None)
        states = None
        if states_out is not None:
            states = CheckpointStates(kda=states_out.kda[: st.bs], conv=states_out.conv[: st.bs])
        return self.model.prefill_padded(st.inputs, self.pools, logits_out[: st.bs], states)

    def _outputs(self, bs: int, checkpoint: bool) -> tuple[Tensor, CheckpointStates | None]:
        """The shared outputs with at least ``bs`` rows: logits, and with ``checkpoint`` the states. Allocated on
        first use, outside any capture, at that bucket's rows and again at a larger bucket's when one comes (graphs
        captured before keep the smaller buffer alive: at most twice the largest)."""
        if self._logits_out is None or self._logits_out.shape[0] < bs:
            self._logits_out = torch.empty(bs, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        if checkpoint and (self._states_out is None or self._states_out.kda.shape[0] < bs):
            kda, conv = self.pools.kda, self.pools.conv
            self._states_out = CheckpointStates(
                kda=torch.empty(bs, len(kda), *(kda[0].shape[1:] if kda else ()), dtype=torch.float32,
                                device=self.device),
                conv=torch.empty(bs, len(conv), *(conv[0].shape[1:] if conv else ()),
                                 dtype=conv[0].dtype if conv else torch.float32, device=self.device))
        return self._logits_out, self._states_out if checkpoint else None

    # -- static buffers --------------------------------------------------------------------------------------

    def _get(self, bs: int, tb: int, width: int, checkpoint: bool) -> _Static:
        key = (bs, tb, width, checkpoint)
        if key not in self._static:
            b4 = -(-bs // 4) * 4  # each part starts 16-byte aligned
            t4 = -(-(bs * tb) // 4) * 4
            o_rows = t4 + 5 * b4  # kv_rows: 2 int32 per row
            o_table = o_rows + 2 * t4
            ints = torch.empty(o_table + bs * width, dtype=torch.int32, device=self.device)
            host = torch.empty(ints.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            P = self.pools.page_size
            inputs = PaddedPrefill(
                input_ids=ints[: bs * tb],
                slots=ints[t4 : t4 + bs],
                starts=ints[t4 + b4 : t4 + b4 + bs],
                lens=ints[t4 + 2 * b4 : t4 + 2 * b4 + bs],
                last=ints[t4 + 3 * b4 : t4 + 3 * b4 + bs],
                kv_rows=ints[o_rows : o_rows + 2 * bs * tb].view(torch.int64),
                page_table=ints[o_table:].view(bs, width),
                bounds=torch.arange(bs + 1, dtype=torch.long, device=self.device) * tb,
                ck_lens=ints[t4 + 4 * b4 : t4 + 4 * b4 + bs] if checkpoint else None,
                mla_splits=absorbed_splits(
                    tb, self.model.config.num_attention_heads, width * P, self._sm,
                    served_head_block(self.pools.kv[0], self.model.config.kv_lora_rank) if self.pools.kv else None),
            )
            st = _Static(bs, tb, width, ints, host, inputs)
            self._fill(st, [], [], [], [], [])  # every sequence a dummy
            self._static[key] = st
        return self._static[key]

    def _fill(self, st: _Static, ids: list[int], num_new: list[int], slots: list[int], starts: list[int],
              pages: list[list[int]], checkpoint_at: list[int] | None = None) -> None:
        """Write the host buffer (real sequences, then dummies of one token on the scratch slot and page after one
        cached row of it) and copy it over."""
        if st.copied is not None:
            st.copied.synchronize()  # the previous copy out of the host buffer has finished
        bs, tb, N = st.bs, st.tb, len(num_new)
        b4 = -(-bs // 4) * 4
        t4 = -(-(bs * tb) // 4) * 4
        o_rows = t4 + 5 * b4
        scratch_slot, scratch_page = self.pools.scratch_slot, self.pools.scratch_page
        assert scratch_slot is not None and scratch_page is not None
        P = self.pools.page_size
        h = st.host.numpy()
        h[: o_rows] = 0
        tok = h[: bs * tb].reshape(bs, tb)
        slot_h, start_h = h[t4 : t4 + bs], h[t4 + b4 : t4 + b4 + bs]
        len_h, last_h = h[t4 + 2 * b4 : t4 + 2 * b4 + bs], h[t4 + 3 * b4 : t4 + 3 * b4 + bs]
        rows = h[o_rows : o_rows + 2 * bs * tb].view(np.int64).reshape(bs, tb)
        rows[:] = scratch_page * P  # the padding's and the dummies' rows
        table = h[o_rows + 2 * t4 :].reshape(bs, st.width)
        table[:] = scratch_page
        offset = 0
        for n in range(N):
            t, s, p = num_new[n], starts[n], pages[n]
            if len(p) * P < s + t:
                raise ValueError(f"sequence {n}: {s} cached + {t} new tokens need {-(-(s + t) // P)} pages of {P}, "
                                 f"got {len(p)}")
            tok[n, :t] = ids[offset : offset + t]
            offset += t
            pos = np.arange(s, s + t)
            rows[n, :t] = np.asarray(p, dtype=np.int64)[pos // P] * P + pos % P
            table[n, : len(p)] = p
        slot_h[:N], slot_h[N:] = slots, scratch_slot
        start_h[:N], start_h[N:] = starts, 1
        len_h[:N], len_h[N:] = num_new, 1
        last_h[:] = np.arange(bs) * tb + len_h - 1
        ck_h = h[t4 + 4 * b4 : t4 + 4 * b4 + bs]
        ck_h[:N], ck_h[N:] = checkpoint_at if checkpoint_at is not None else num_new, 1
        st.copied = upload(st.ints, st.host)

    # -- capture -------------------------------------------------------------------------------------------

    def _capture(self, st: _Static) -> None:
        """Warm up (Triton compiles on first call), then capture into the private pool; on dummy sequences only
        (scratch slot and page), so no session moves. A failed capture turns graphs off and leaves the eager
        static path."""
        self._fill(st, [], [], [], [], [])
        t0 = time.perf_counter()
        try:
            # the KDA kernels' chunk table of this layout, cached by them: kept alive as long as the graph reads it
            st.keep.append(chunk_table([n * st.tb for n in range(st.bs + 1)], self.device))
            graph, out = capture_graph(lambda: self._step(st), self.device, self._mempool)
        except Exception as e:
            log.warning("CUDA graph capture failed for a prefill of %d x %d tokens, width %d: short prefills run "
                        "eagerly", st.bs, st.tb, st.width, exc_info=True)
            self.capture_error = f"{type(e).__name__}: {e}"
            self.use_graphs = False
            return
        st.graph, st.out = graph, out
        self.captures += 1
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("captured the prefill step for %d x %d tokens, page-table width %d in %.0f ms", st.bs, st.tb,
                 st.width, dt * 1e3)
