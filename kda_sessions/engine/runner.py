"""The engine step, top to bottom: plan -> run (model calls, then sampling of the whole batch) -> postprocess.

Runs on one dedicated thread so the event loop never waits on the model; results are handed back to the
event loop once per step. Pools and allocators are touched only under ``pools.mutex``.

Failure isolation: a failure fails only the request it belongs to. Every other sequence of the step keeps the
invariant that its pool state (KDA slot, conv tails, KV rows below num_cached) equals a fresh prefill of
``tokens[:num_cached]``: bookkeeping advances for the whole batch right after the model call, before any
per-row sampling; a row that fails in sampling or in its constraint only ends its own request; a model call
that raises has advanced some layers of every row in place, so each row is rolled back to its newest exact
checkpoint (or the empty state) and, if the batch had other rows, each is run again alone: the rows that fail
alone fail, the others go on (their usage counts the tokens run again). A failed request's own sequence is
rolled back too, so the tokens after that checkpoint are pending again and the next call continues it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import OutOfPages
from ..model import CheckpointStates, ForwardBatch, HybridModel
from ..model.fused import half_row_weights
from ..model.graphs import DecodeGraphs, Feed
from ..model.prefill_graphs import PrefillGraphs
from ..tokenizer import Tokenizer
from .checkpoints import capture
from .cpu_batch import CpuDecodeBatches
from .cpu_threads import StepThreads
from .pool import Pools, State, pages_needed
from .postprocess import Sampled, postprocess
from .preemption import Preemption
from .rollback import roll_back
from .sampler import PendingSample, sample_batch_async, sample_batch_top, top_logprobs
from .scheduler import Scheduler, StepPlan, Work
from .sequence import Checkpoint, Sequence
from .undo import StepUndo

log = logging.getLogger(__name__)

PARKED_POLL_S = 0.05
"""How often the step thread looks for pages for parked works when nothing else runs."""

Deliver = Callable[[list[Work], list[tuple[Work, int]]], None]


@dataclass
class Queued:
    """A decode step queued on the device (``Runner._launch``): its works, in batch order, and their draws."""

    works: list[Work]
    pending: PendingSample
    undo: list[tuple[Work, int]] = field(default_factory=list)
    """Rows fed unread that have ``stop`` strings, each with its row of ``Runner.undo`` (their states before it)."""


def runs_ahead(w: Work) -> bool:
    """Whether ``w``'s tokens can be fed on the device, unread (``EngineConfig.decode_ahead``): whether its tokens
    do not depend on the host's reading of the ones before (a constraint's masks do); top logprobs come with the
    draw. It ends by a stop token or its length, which the device and the host decide alike, or
    by a ``stop`` string, which the host finds a step late: that step is undone (``StepUndo``)."""
    return w.constraint is None


@dataclass
class StepResult:
    """What one step produced, for postprocess: sampled tokens (not yet appended) and works that ended."""

    sampled: list[Sampled] = field(default_factory=list)
    finished: list[Work] = field(default_factory=list)


class Runner:
    def __init__(
        self,
        model: HybridModel,
        pools: Pools,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        deliver: Deliver,
        cuda_graphs: bool = True,
        park_timeout_s: float = 30.0,
        cpu_threads: int | None = None,
        cpu_decode_threads: int | Literal["auto"] | None = "auto",
        cpu_compile: bool = False,
        cpu_compile_dtype: torch.dtype | None = None,
        cpu_half_weights: bool = True,
        decode_ahead: bool = False,
    ) -> None:
        self.model = model
        self.pools = pools
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.cv = threading.Condition(pools.mutex)
        self.deliver = deliver
        self.stopping = False
        self.steps = 0
        self.tokens_prefilled = 0
        self.tokens_decoded = 0
        self.preemption = Preemption(pools, scheduler, park_timeout_s)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and model.device.type == "cuda" and pools.tensors.scratch_slot is not None:
            self.graphs = DecodeGraphs(model, pools.tensors, capture_lock=pools.mutex)
        self.prefill_graphs: PrefillGraphs | None = None
        """Short prefill steps (an agent's tool output) as CUDA graphs, where ``graphs`` are (``PrefillGraphs``)."""
        if self.graphs is not None and self.graphs.use_graphs:
            self.prefill_graphs = PrefillGraphs(model, pools.tensors, capture_lock=pools.mutex,
                                                mempool=self.graphs.mempool)
        self.decode_ahead = decode_ahead
        """``EngineConfig.decode_ahead``: with ``graphs``, decode steps whose rows all ``runs_ahead`` queue the next
        step before the host reads their tokens (``_decode_ahead``)."""
        self.undo = StepUndo(pools.tensors)
        """The states, from before a step queued ahead, of its rows with ``stop`` strings (``_finish_step``)."""
        self.steps_ahead = 0
        """Decode steps queued before the host had read the step before them."""
        self.rows_undone = 0
        """Rows of steps queued ahead whose advance was undone: a stop string found a step late (``StepUndo``)."""
        self._stop_ids: tuple[frozenset[int], Tensor] | None = None
        self.cpu_threads = cpu_threads
        """Torch threads the step thread sets (None: torch's default). torch keeps the last count any thread set and
        gives it to threads started later, so the step thread sets the caller's count back when it ends."""
        self.threads_before = torch.get_num_threads()
        self.check_weights = True
        """Whether the next decode step checks that the model's parameters are unchanged (``HybridModel.step``): after
        any step that ran a prefill, i.e. once a request arrived (its caller's code ran since the last check), not on
        every token of the requests already running (a weight changed while they generate races with this thread's
        matmuls anyway)."""
        self.cpu_batches = CpuDecodeBatches(pools.page_size) if model.device.type == "cpu" else None
        """Decode batches on a CPU, from buffers reused every step (``CpuDecodeBatches``)."""
        self.cpu_half_weights = cpu_half_weights
        """``EngineConfig.cpu_half_weights``: every model call of this runner runs under ``fused.half_row_weights``."""
        self.cpu_decode_threads = cpu_decode_threads if model.device.type == "cpu" else None
        """Torch threads of the model call of decode rows on a CPU (None: the step thread's count; "auto":
        ``step_threads`` chooses, for prefill steps too)."""
        self.step_threads: StepThreads | None = None
        """With "auto" and a step thread on more than one thread: the count each step runs on, by timing the steps
        (made on the step thread, which knows its count)."""
        self.cpu_compile = cpu_compile and model.device.type == "cpu"
        self.cpu_compile_dtype = cpu_compile_dtype
        self.compiled = False
        """Whether one-sequence CPU decode steps run compiled (``EngineConfig.cpu_compile``), once the step thread
        has compiled them."""
        self.thread = threading.Thread(target=self._main, name="kda-engine", daemon=True)
        self.warmed = threading.Event()
        """Set once the step thread has run its CPU warm-up (``_warm_up``), or at once where it runs none."""

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        self.thread.join(timeout=30)

    def notify(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _main(self) -> None:
        if self.cpu_threads is None:
            self._loop()
            return
        torch.set_num_threads(self.cpu_threads)
        try:
            self._loop()
        finally:
            torch.set_num_threads(self.threads_before)

    def _loop(self) -> None:
        if self.cpu_decode_threads == "auto":
            threads = torch.get_num_threads()
            if self.cpu_compile or threads == 1:  # dynamo guards the count: compiled steps keep one
                self.cpu_decode_threads = 1
            else:
                self.step_threads = StepThreads((1, threads))
        try:
            if self.cpu_compile:
                self.warmed.set()  # requests may queue while the step compiles (EngineConfig.cpu_compile)
                self._compile_decode()
            elif self.model.device.type == "cpu":
                self._warm_up()
        finally:
            self.warmed.set()
        while True:
            with self.cv:
                while True:
                    if self.stopping:
                        return
                    timed_out = self.preemption.resume_ready()
                    if timed_out or self.scheduler.runnable:
                        break
                    self.cv.wait(PARKED_POLL_S if self.scheduler.parked else None)
                plan = self.scheduler.plan()
                for w in plan.dropped:
                    self.preemption.discard(w)
            if not timed_out and self._can_run_ahead(plan):
                try:
                    self._decode_ahead(plan.decode)
                except BaseException as e:  # a fault outside the per-row guards: fail the works, never the engine
                    log.exception("engine step failed")
                    out = StepResult()
                    for w in plan.decode:
                        if w.finish_reason is None and w.error is None:
                            self._fail(w, e, out, rollback=True)
                    self._finish_step(None, None, out)
                continue
            result = self.run(plan)
            result.finished.extend(timed_out)
            sampled = postprocess(plan, result.sampled, result.finished, self.pools, self.scheduler, self.tokenizer)
            self.steps += 1
            self.deliver(result.finished, sampled)

    def _warm_up(self) -> None:
        """A 4-token prefill and one decode step on the scratch slot and page, before any request: the first steps
        of a CPU engine build what later steps reuse (the fused weights of the CPU paths, the decode batch buffers,
        the BLAS's set-up: ``tiny``'s first 29-token prefill took 290 ms, the next 35), and that belongs to opening
        the engine, not to the first request's time to first token (a resumed session's, say). A failure is logged
        and left to the first real step."""
        tensors = self.pools.tensors
        if tensors.scratch_slot is None or tensors.scratch_page is None or tensors.page_size < 5:
            return
        dev, P, page = self.model.device, tensors.page_size, tensors.scratch_page
        slots = torch.tensor([tensors.scratch_slot], device=dev)
        table = torch.tensor([[page]], dtype=torch.int32, device=dev)
        try:
            for start, n in ((0, 4), (4, 1)):
                batch = ForwardBatch(
                    input_ids=torch.zeros(n, dtype=torch.long, device=dev), num_new=[n], start=[start], slots=slots,
                    page_table=table, kv_rows=torch.arange(page * P + start, page * P + start + n, device=dev),
                )
                self._step(batch)  # on the counts real steps use (a decode lane's first step is not timed)
        except Exception:
            log.exception("warm-up step failed; the first request's step will build what it needs")

    def _compile_decode(self) -> None:
        """``HybridModel.compile_cpu_decode``, then one decode step on the scratch slot and page, so the compile
        happens before the first request's step instead of inside it. A failure leaves the eager path."""
        tensors = self.pools.tensors
        try:
            if not self.model.compile_cpu_decode(self.cpu_compile_dtype):
                log.warning("cpu_compile: the model has layers without a CPU decode path; decoding eagerly")
                return
            self.compiled = True
            if tensors.scratch_slot is None or tensors.scratch_page is None or tensors.page_size < 4:
                return  # no rows of its own to warm up on: the first step compiles
            dev = self.model.device
            batch = ForwardBatch(
                input_ids=torch.zeros(1, dtype=torch.long, device=dev), num_new=[1], start=[3],
                slots=torch.tensor([tensors.scratch_slot], device=dev),
                page_table=torch.tensor([[tensors.scratch_page]], dtype=torch.int32, device=dev),
                kv_rows=torch.tensor([tensors.scratch_page * tensors.page_size + 3], device=dev),
            )
            self._step(batch)  # on the decode steps' thread count: dynamo guards the count
        except Exception:
            log.exception("cpu_compile: compiling the decode step failed; decoding eagerly")
            self.model.decode_eagerly()
            self.compiled = False

    def run(self, plan: StepPlan) -> StepResult:
        """The model calls of ``plan`` (one packed prefill, one decode batch) and the sampling of their rows."""
        out = StepResult()
        try:
            self._prefill(plan.prefill, out)
            self._decode(plan.decode, out)
        except BaseException as e:  # a fault outside the per-row guards: fail the plan, never the engine
            log.exception("engine step failed")
            for w in [w for w, _ in plan.prefill] + plan.decode:
                if w.finish_reason is None and w.error is None:
                    self._fail(w, e, out, rollback=True)
        return out

    # -- failure isolation (see the module docstring) --------------------------------------------------------

    def _fail(self, w: Work, e: BaseException, out: StepResult, rollback: bool = False) -> None:
        if rollback and w.session.slot is not None:
            try:
                self.rollback(w.session)
            except Exception:  # the sequence cannot be trusted any more: it will prefill from scratch
                log.exception("session %s: rollback after a failed step failed", w.session.id)
        w.error = w.error or e
        if w not in out.finished:
            out.finished.append(w)

    def rollback(self, s: Sequence) -> None:
        """``roll_back`` (see there) under the pools' mutex."""
        with self.pools.mutex:
            roll_back(s, self.pools)

    def _to_host(self, kda: Tensor, conv: Tensor) -> State:
        """A prefill's checkpoint state on the host (on CUDA: ``Pools.to_host_async``, no waiting)."""
        if kda.device.type == "cuda" and self.pools.async_capture:
            return self.pools.to_host_async(kda, conv)
        return kda.cpu(), conv.cpu()

    def _replay(self, w: Work) -> None:
        """Turn ``w`` (its sequence rolled back) into a prefill of everything its sequence has not cached."""
        s = w.session
        end = len(s.tokens) - (1 if w.prefill_only else 0)
        left = len(w.prompt) - w.done_prefill if w.in_prefill else 0
        if not w.in_prefill and not w.prefill_only:
            left = 1  # the pending sampled token
        w.prompt = s.tokens[s.num_cached : end]
        w.done_prefill = 0
        w.replayed += max(0, len(w.prompt) - left)

    def _retry_alone(self, works: list[Work], e: BaseException, out: StepResult) -> None:
        """After a model call over ``works`` raised: roll all back; alone, a row fails; else each runs again alone."""
        log.warning("model step over %d sequences failed (%s: %s); rolling back", len(works), type(e).__name__, e)
        alone = len(works) == 1
        for w in works:
            try:
                self.rollback(w.session)
            except Exception as again:
                log.exception("session %s: rollback after a failed step failed", w.session.id)
                self._fail(w, again, out)
        works = [w for w in works if w.error is None]
        if alone:
            for w in works:
                self._fail(w, e, out)
            return
        for w in works:
            self._replay(w)
            while w.in_prefill and w.error is None and w.finish_reason is None and not w.cancelled:
                n = min(len(w.prompt) - w.done_prefill, self.scheduler.prefill_budget)
                self._prefill([(w, n)], out)
            if w.cancelled and w not in out.finished:
                w.finish_reason = w.finish_reason or "cancelled"
                out.finished.append(w)

    def _with_pages(self, works: list[Work], need: list[int], out: StepResult) -> list[int]:
        """Indices of the works whose sequences got pages for ``need`` tokens. Short of pages, a generating work
        parks younger ones of ``works`` (see preemption.py), or is parked itself; others fail alone."""
        ok = []
        for i, (w, total) in enumerate(zip(works, need)):
            if w.parked is not None:  # parked for an older work earlier in this loop
                continue
            try:
                self._ensure_pages(w, total)
            except OutOfPages as e:
                if w.in_prefill or w.prefill_only:
                    self._fail(w, e, out)
                    continue
                with self.pools.mutex:
                    pages = pages_needed(total, self.pools.page_size) - len(w.session.pages)
                    if not self.preemption.make_room(w, pages, works):
                        self.preemption.park(w)
                        continue
                self._ensure_pages(w, total)
                ok.append(i)
            except Exception as e:
                self._fail(w, e, out)
            else:
                ok.append(i)
        return [i for i in ok if works[i].parked is None]

    # -- model calls -----------------------------------------------------------------------------------------

    def _ensure_pages(self, w: Work, total: int) -> None:
        """Pages for ``total`` tokens of ``w``'s sequence, out of the work's reservation first."""
        s = w.session
        need = pages_needed(total, self.pools.page_size) - len(s.pages)
        if need > 0:
            with self.pools.mutex:
                take = min(need, w.reserved_pages)
                s.pages.extend(self.pools.pages.alloc(need, reserved=take))
                w.reserved_pages -= take

    def _batch(self, works: list[Work], ids: list[int], num_new: list[int],
               positions: list[list[int]] | None = None) -> ForwardBatch:
        seqs = [w.session for w in works]
        dev = self.model.device
        width = max(len(s.pages) for s in seqs)
        table = [s.pages + [0] * (width - len(s.pages)) for s in seqs]
        rows = ForwardBatch.rows_for([s.pages for s in seqs], [s.num_cached for s in seqs], num_new, self.pools.page_size)

        def put(values: list[Any], dtype: torch.dtype = torch.long) -> Tensor:
            # non-blocking: from pageable memory the copy waits for its staging, not for the kernels queued before
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        return ForwardBatch(
            input_ids=put(ids),
            num_new=num_new,
            start=[s.num_cached for s in seqs],
            slots=put([s.slot for s in seqs]),
            page_table=put(table, torch.int32),
            checkpoint_positions=positions if positions and any(positions) else None,
            kv_rows=put(rows),
        )

    def _prefill(self, chunks: list[tuple[Work, int]], out: StepResult) -> None:
        ok = self._with_pages([w for w, _ in chunks], [w.session.num_cached + n for w, n in chunks], out)
        chunks = [chunks[i] for i in ok]
        if not chunks:
            return
        ids: list[int] = []
        positions: list[list[int]] = []
        wanted = []
        for w, n in chunks:
            s = w.session
            assert s.slot is not None
            ids.extend(w.prompt[w.done_prefill : w.done_prefill + n])
            lo, hi = s.num_cached, s.num_cached + n
            pending = [c for c in w.checkpoints if lo <= c.target <= hi and c.state_pos < c.target]
            for c in pending:
                if c.target == lo:  # exactly the state before this chunk
                    with self.pools.mutex:
                        capture(s, c, c.target, self.pools.read_slot_async(s.slot), self.pools)
            cps = sorted((c for c in pending if c.target > lo), key=lambda c: c.target)
            positions.append(sorted({c.target - lo for c in cps}))
            wanted.append(cps)
        works = [w for w, _ in chunks]
        self.check_weights = True
        num_new = [n for _, n in chunks]
        starts = [w.session.num_cached for w in works]
        try:
            if self.prefill_graphs is not None and self.prefill_graphs.accepts(num_new, starts):
                # short chunks (tool outputs, chat turns): replayed CUDA graphs, cut at the checkpoints
                logits, states = self._prefill_graphed(works, ids, num_new, starts, positions, wanted), None
            else:
                logits, states = self._step(self._batch(works, ids, num_new, positions))
        except Exception as e:
            self._retry_alone(works, e, out)
            return
        # bookkeeping for every row first: the pools have advanced for all of them
        for w, n in chunks:
            w.session.num_cached += n
            w.done_prefill += n
            self.tokens_prefilled += n
        m = 0
        to_sample: list[int] = []
        for i, w in enumerate(works):
            s = w.session
            try:
                if states is not None:
                    rel = positions[i]
                    for c in wanted[i]:
                        j = m + rel.index(c.target - starts[i])
                        state = self._to_host(states.kda[j], states.conv[j])
                        with self.pools.mutex:
                            capture(s, c, c.target, state, self.pools)
                    m += len(rel)
            except Exception as e:
                log.warning("session %s: checkpoint capture failed (%s: %s)", s.id, type(e).__name__, e)
                self._fail(w, e, out, rollback=True)
                continue
            if not w.in_prefill:
                if w.prefill_only:
                    w.finish_reason = "stop"
                    out.finished.append(w)
                else:
                    to_sample.append(i)
        self._sample(works, logits, to_sample, out)

    def _prefill_graphed(self, works: list[Work], ids: list[int], num_new: list[int], starts: list[int],
                         positions: list[list[int]], wanted: list[list[Checkpoint]]) -> Tensor:
        """The prefill step of short chunks through ``prefill_graphs``: one graph replay, which also returns the
        state at one checkpoint inside each chunk (a chat turn's input: its message's end, then the assistant's
        header); where a chunk holds more, in rounds: round r runs every sequence's r-th piece, each cut at its
        checkpoint positions. Checkpoints at a piece's end, the chunk's own included, are captured from the slot
        after it (the state there, in the stream's order). Returns logits [N, vocab], each chunk's last token's."""
        graphs = self.prefill_graphs
        assert graphs is not None
        inside = [[p for p in rel if p < t] for t, rel in zip(num_new, positions)]
        if all(len(p) <= 1 for p in inside):
            pieces = [[(0, t)] for t in num_new]
            at: list[int] | None = [p[0] if p else t for p, t in zip(inside, num_new)] if any(inside) else None
        else:
            pieces = [list(zip([0, *cuts], [*cuts, t])) for cuts, t in zip(inside, num_new)]
            at = None
        first = [0]
        for t in num_new:
            first.append(first[-1] + t)
        rounds = max(len(p) for p in pieces)
        rows: list[tuple[int, Tensor]] = []
        for r in range(rounds):
            act = [n for n in range(len(works)) if r < len(pieces[n])]
            seqs = [works[n].session for n in act]
            slots = [s.slot for s in seqs if s.slot is not None]
            assert len(slots) == len(seqs)
            logits, states = graphs.run(
                [t for n in act for t in ids[first[n] + pieces[n][r][0] : first[n] + pieces[n][r][1]]],
                [pieces[n][r][1] - pieces[n][r][0] for n in act], slots, [starts[n] + pieces[n][r][0] for n in act],
                [s.pages for s in seqs], at)
            for i, n in enumerate(act):
                end, s = starts[n] + pieces[n][r][1], works[n].session
                for c in wanted[n]:
                    if c.target == end:  # a piece's end, the chunk's own included
                        with self.pools.mutex:
                            capture(s, c, c.target, self.pools.read_slot_async(slots[i]), self.pools)
                    elif states is not None and inside[n] and c.target == starts[n] + inside[n][0]:
                        # copied off the graph's static outputs before any later replay can write them
                        state = self._to_host(states.kda[i].clone(), states.conv[i].clone())
                        with self.pools.mutex:
                            capture(s, c, c.target, state, self.pools)
                if rounds > 1 and r == len(pieces[n]) - 1:
                    rows.append((n, logits[i : i + 1].clone()))
            if rounds == 1:
                return logits
        return torch.cat([row for _, row in sorted(rows, key=lambda x: x[0])])

    def _decode(self, works: list[Work], out: StepResult) -> None:
        works = [w for w in works if not w.cancelled and w.finish_reason is None and w.error is None]
        ok = self._with_pages(works, [w.session.num_cached + 1 for w in works], out)
        works = [works[i] for i in ok]
        if not works:
            return
        seqs = [w.session for w in works]
        ids = [s.tokens[s.num_cached] for s in seqs]
        try:
            if self.graphs is not None and self.graphs.accepts(len(seqs)):
                # static buffers + a replayed CUDA graph: no per-step tensors, no host sync before sampling
                slots = [s.slot for s in seqs if s.slot is not None]
                assert len(slots) == len(seqs)
                logits = self.graphs.run(ids, slots, [s.num_cached + 1 for s in seqs], [s.pages for s in seqs])
            elif self.cpu_batches is not None:
                logits, _ = self._step(self.cpu_batches.batch(seqs, ids), self.check_weights)
                self.check_weights = False
            else:
                logits, _ = self._step(self._batch(works, ids, [1] * len(works)))
        except Exception as e:
            self._retry_alone(works, e, out)
            return
        for s in seqs:  # every row advanced: bookkeeping before any row can fail
            s.num_cached += 1
        self.tokens_decoded += len(works)
        self._sample(works, logits, list(range(len(works))), out)

    def _step(self, batch: ForwardBatch, check_weights: bool = True) -> tuple[torch.Tensor, CheckpointStates | None]:
        """``model.step``; one token per row on ``cpu_decode_threads`` torch threads: a decode step's few-microsecond
        ops each pay an OpenMP region's wake-up on more than one (docs/benchmarks.md, "`tiny` on the CPU"). With
        "auto", each step on the count ``step_threads`` picks by timing steps like it (decode steps by batch size, others
        by the tokens they feed)."""
        threads = torch.get_num_threads()
        tuner, rows, tokens = self.step_threads, len(batch.num_new), sum(batch.num_new)
        if tuner is not None:
            want = tuner.pick(rows) if batch.is_decode else tuner.prefill(tokens)
        elif batch.is_decode and isinstance(self.cpu_decode_threads, int):  # "auto" is resolved when the loop starts
            want = self.cpu_decode_threads
        else:
            want = threads
        if want != threads:
            torch.set_num_threads(want)
        t = time.perf_counter()
        try:
            with half_row_weights(self.cpu_half_weights):
                out = self.model.step(batch, self.pools.tensors, check_weights)
            if tuner is not None:
                if batch.is_decode:
                    tuner.record(rows, time.perf_counter() - t)
                else:
                    tuner.record_prefill(tokens, time.perf_counter() - t)
            return out
        finally:
            if want != threads:
                torch.set_num_threads(threads)

    # -- decode ahead (EngineConfig.decode_ahead) --------------------------------------------------------------

    def _can_run_ahead(self, plan: StepPlan) -> bool:
        return (self.decode_ahead and self.graphs is not None and not plan.prefill and not plan.dropped
                and self.graphs.accepts(len(plan.decode)) and all(runs_ahead(w) for w in plan.decode))

    def _decode_ahead(self, works: list[Work]) -> None:
        """Decode steps of ``works`` (all ``runs_ahead``) while nothing else asks for the step thread: each step is
        queued, with its rows' draws, before the host reads the step before it, its ids taken on the device from
        that step's tokens (``graphs.Feed``), so the GPU runs while the host reads, checks and delivers tokens. A row
        is in the next step unless its length ends it; a row whose token is a stop token runs there as a dummy
        (scratch slot and page), so its state and cache stay at the sequence's pending token, as without this."""
        out = StepResult()
        works = [w for w in works if not w.cancelled and w.finish_reason is None and w.error is None]
        ok = self._with_pages(works, [w.session.num_cached + 1 for w in works], out)
        works = [works[i] for i in ok]
        step: Queued | None = None
        if works:
            try:
                step = self._launch(works, None)
            except Exception as e:
                self._retry_alone(works, e, out)
        while step is not None:
            nxt, failed, error = None, [], None
            rows = self._going_on(step)
            if rows:
                failed = [step.works[j] for j in rows]
                try:
                    nxt = self._launch(failed, step, rows)
                    failed = []
                except Exception as e:
                    error = e
            self._finish_step(step, nxt, out)
            out, step = StepResult(), nxt
            if error is not None:
                self._retry_alone([w for w in failed if w.finish_reason is None and w.error is None], error, out)
        if out.sampled or out.finished:
            self._finish_step(None, None, out)

    def _going_on(self, step: Queued) -> list[int]:
        """Rows of ``step`` the next step can feed on the device before the host reads it: those drawn whose length
        does not end with this token, when nothing else waits for the step thread (else none)."""
        s = self.scheduler
        if self.stopping or s.waiting or s.parked or any(w.cancelled for w in step.works):
            return []
        drawn = set(step.pending.ok)
        rows = [j for j, w in enumerate(step.works) if j in drawn and w.finish_reason is None and w.error is None
                and len(w.output) + 1 < w.params.max_tokens]
        if not rows or not self.graphs or not self.graphs.accepts(len(rows)):
            return []
        if not self.undo.reserve(sum(1 for j in rows if step.works[j].params.stop)):
            return []
        for j in rows:  # pages for the token after this one; never a preemption while a step is queued
            w = step.works[j]
            try:
                self._ensure_pages(w, w.session.num_cached + 1)
            except OutOfPages:
                return []
        return rows

    def _launch(self, works: list[Work], before: Queued | None, rows: list[int] | None = None) -> Queued:
        """Queue a decode step of ``works`` and their draws; without ``before`` each feeds its pending token, with it
        work i feeds ``before``'s token of its row ``rows[i]`` on the device (``graphs.Feed``)."""
        assert self.graphs is not None
        seqs = [w.session for w in works]
        slots = [s.slot for s in seqs if s.slot is not None]
        assert len(slots) == len(seqs)
        feed = None
        if before is None:
            ids = [s.tokens[s.num_cached] for s in seqs]
        else:
            assert rows is not None
            ids = [0] * len(seqs)
            drawn = {i: j for j, i in enumerate(before.pending.ok)}
            assert before.pending.tokens is not None
            feed = Feed(before.pending.tokens, [drawn[j] for j in rows], self._stop_tensor(),
                        [not w.params.ignore_eos for w in works])
            self.steps_ahead += 1
        undo: list[tuple[Work, int]] = []
        if feed is not None:  # the states of rows whose stop strings the host checks after this step is queued
            stopping = [i for i, w in enumerate(works) if w.params.stop]
            undo = [(works[i], row) for row, i in enumerate(stopping)]
            self.undo.save([slots[i] for i in stopping])
        logits = self.graphs.run(ids, slots, [s.num_cached + 1 for s in seqs], [s.pages for s in seqs], feed)
        pending = sample_batch_async(logits, [w.params for w in works], [w.generator for w in works])
        # every row advanced (a fed row that stops is undone by _finish_step); counted only once nothing here can
        # raise: a launch that raised leaves the counts as they were, and the caller rolls its rows back
        for s in seqs:
            s.num_cached += 1
        self.tokens_decoded += len(works)
        return Queued(works, pending, undo)

    def _finish_step(self, step: Queued | None, nxt: Queued | None, out: StepResult) -> None:
        """Read ``step``'s tokens into ``out`` (rows that ended at the step before are skipped: they ran as dummies),
        undo ``nxt``'s advance of rows whose token ends them (a stop token: the device ran the row as a dummy; a
        stop string: its state from before ``nxt`` is put back before postprocess checkpoints it), then postprocess
        and deliver."""
        if step is not None:
            for w, res in zip(step.works, step.pending.result_with_top()):
                if w.finish_reason is not None or w.error is not None:
                    continue
                if isinstance(res, Exception):
                    self._fail(w, res, out, rollback=True)
                else:
                    out.sampled.append(Sampled(w, *res))
        stops = {smp.work for smp in out.sampled
                 if smp.token in self.tokenizer.eos_ids and not smp.work.params.ignore_eos}
        for w in nxt.works if nxt is not None else []:
            if w in stops:  # the device ran it as a dummy: its pending token is this one, as without nxt
                w.session.num_cached -= 1
                self.tokens_decoded -= 1
        undone: set[Work] = set()

        def undo_ended(finished: list[Work]) -> None:  # before the end checkpoints are captured
            for w, row in nxt.undo if nxt is not None else []:
                if w.finish_reason is not None and w.error is None and w not in stops and w.session.slot is not None:
                    self.undo.restore(row, w.session.slot)
                    w.session.num_cached -= 1
                    self.tokens_decoded -= 1
                    self.rows_undone += 1
                    undone.add(w)

        works = step.works if step is not None else []
        sampled = postprocess(StepPlan([], works, []), out.sampled, out.finished, self.pools, self.scheduler,
                              self.tokenizer, undo_ended)
        for w in nxt.works if nxt is not None else []:
            if w.finish_reason is not None and w not in stops and w not in undone and w.error is None:
                # runs_ahead and _going_on rule this out
                log.error("session %s ended in a step whose next was queued (%s)", w.session.id, w.finish_reason)
        self.steps += 1
        self.deliver(out.finished, sampled)

    def _stop_tensor(self) -> Tensor:
        """The tokenizer's stop tokens on the model's device (-1, which no token is, when it has none), made again
        if the set changed: the device and ``_finish_step`` must stop the same rows."""
        key = frozenset(self.tokenizer.eos_ids)
        if self._stop_ids is None or self._stop_ids[0] != key:
            self._stop_ids = (key, torch.tensor(sorted(key) or [-1], dtype=torch.long, device=self.model.device))
        return self._stop_ids[1]

    # -- sampling --------------------------------------------------------------------------------------------

    def _sample(self, works: list[Work], logits: torch.Tensor, rows: list[int], out: StepResult) -> None:
        """Sample row ``i`` of ``logits`` for ``works[i]``, for every ``i`` in ``rows``: unconstrained rows together
        on the device (one host copy), constrained ones on the host. A row that fails ends only its request."""
        free = [i for i in rows if works[i].constraint is None]
        picked: dict[int, tuple[int, float, list[tuple[int, float]]] | Exception] = {}
        if free:
            rows_logits = logits if len(free) == logits.shape[0] else torch.stack([logits[i] for i in free])
            got = sample_batch_top(rows_logits, [works[i].params for i in free], [works[i].generator for i in free])
            picked.update(zip(free, got))
        for i in rows:
            w = works[i]
            try:
                top: list[tuple[int, float]] = []
                if w.constraint is not None:
                    tok, lp = w.constraint.pick(logits[i], w.params, w.generator, w.params.max_tokens - len(w.output))
                    w.constraint.advance(tok)
                    if w.params.top_logprobs:
                        ids, lps = top_logprobs(logits[i][None], w.params.top_logprobs)
                        top = list(zip(ids[0].tolist(), lps[0].tolist()))
                else:
                    res = picked[i]
                    if isinstance(res, Exception):
                        raise res
                    tok, lp, top = res
            except Exception as e:
                log.warning("session %s: request failed in sampling (%s: %s)", w.session.id, type(e).__name__, e)
                self._fail(w, e, out, rollback=True)
            else:
                out.sampled.append(Sampled(w, tok, lp, top))
