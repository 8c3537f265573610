"""The engine step, top to bottom: schedule -> run model -> sample -> postprocess.

Runs on one dedicated thread so the event loop never waits on the model; results are handed back to the
event loop once per step. Pools and allocators are touched only under ``mutex``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ..model import ForwardBatch, HybridModel, StatePools
from ..model.graphs import DecodeGraphs
from ..sessions.state import SessionState
from ..tokenizer import Tokenizer
from .pool import PageAllocator
from .rollback import roll_back
from .sampler import sample
from .scheduler import Scheduler, Work, pages_needed

log = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        model: HybridModel,
        pools: StatePools,
        pages: PageAllocator,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        mutex: threading.RLock,
        deliver: Callable[[list[Work], list[tuple[Work, int]]], None],
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.pools = pools
        self.pages = pages
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.mutex = mutex
        self.cv = threading.Condition(mutex)
        self.deliver = deliver
        self.stopping = False
        self.steps = 0
        self.tokens_prefilled = 0
        self.tokens_decoded = 0
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and model.device.type == "cuda" and pools.scratch_slot is not None:
            self.graphs = DecodeGraphs(model, pools, capture_lock=mutex)
        self.thread = threading.Thread(target=self._main, name="kda-engine", daemon=True)

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
        while True:
            with self.cv:
                while not self.stopping and not self.scheduler.has_work:
                    self.cv.wait()
                if self.stopping:
                    return
                plan = self.scheduler.plan()
            finished: list[Work] = []
            sampled: list[tuple[Work, int]] = []
            try:
                self._prefill(plan.prefill, finished, sampled)
                self._decode(plan.decode, finished, sampled)
            except BaseException as e:  # a fault outside the per-row guards: fail the plan, never the engine
                log.exception("engine step failed")
                for w in [w for w, _ in plan.prefill] + plan.decode:
                    if w.finish_reason is None and w.error is None:
                        self._fail(w, e, finished, rollback=True)
            finished.extend(plan.dropped)
            with self.mutex:
                self.scheduler.running = [w for w in self.scheduler.running if w not in finished]
            self.steps += 1
            self.deliver(finished, sampled)

    # -- failure isolation -----------------------------------------------------------------------------------
    #
    # A failure fails only the request it belongs to. Every other session of the step keeps the invariant that
    # its pool state (KDA slot, conv tails, KV rows below num_cached) equals a fresh prefill of
    # tokens[:num_cached]: bookkeeping advances for the whole batch right after the model call, before any
    # per-row sampling; a row that fails in sampling or in its constraint only ends its own request; a model call
    # that raises has advanced some layers of every row in place, so each row is rolled back to its newest exact
    # checkpoint (or the empty state) and, if the batch had other rows, each is run again alone: the rows that
    # fail alone fail, the others go on (their usage counts the tokens run again). A failed request's own session
    # is rolled back too, so the tokens after that checkpoint are pending again and the next call continues it.

    def _fail(self, w: Work, e: BaseException, finished: list[Work], rollback: bool = False) -> None:
        if rollback and w.session.slot is not None:
            try:
                self.rollback(w.session)
            except Exception:  # the session cannot be trusted any more: it will prefill from scratch
                log.exception("session %s: rollback after a failed step failed", w.session.id)
        w.error = w.error or e
        if w not in finished:
            finished.append(w)

    def rollback(self, s: SessionState) -> None:
        """``roll_back`` (see there) under the pools' mutex."""
        with self.mutex:
            roll_back(s, self.pools, self.pages)

    def _replay(self, w: Work) -> None:
        """Turn ``w`` (its session rolled back) into a prefill of everything its session has not cached."""
        s = w.session
        end = len(s.tokens) - (1 if w.prefill_only else 0)
        left = len(w.prompt) - w.done_prefill if w.in_prefill else 0
        if not w.in_prefill and not w.prefill_only:
            left = 1  # the pending sampled token
        w.prompt = s.tokens[s.num_cached : end]
        w.done_prefill = 0
        w.replayed += max(0, len(w.prompt) - left)

    def _retry_alone(self, works: list[Work], e: BaseException, finished: list[Work],
                     sampled: list[tuple[Work, int]]) -> None:
        """After a model call over ``works`` raised: roll all back; alone, a row fails; else each runs again alone."""
        log.warning("model step over %d sequences failed (%s: %s); rolling back", len(works), type(e).__name__, e)
        alone = len(works) == 1
        for w in works:
            try:
                self.rollback(w.session)
            except Exception as again:
                log.exception("session %s: rollback after a failed step failed", w.session.id)
                self._fail(w, again, finished)
        works = [w for w in works if w.error is None]
        if alone:
            for w in works:
                self._fail(w, e, finished)
            return
        for w in works:
            self._replay(w)
            while w.in_prefill and w.error is None and w.finish_reason is None and not w.cancelled:
                n = min(len(w.prompt) - w.done_prefill, self.scheduler.prefill_budget)
                self._prefill([(w, n)], finished, sampled)
            if w.cancelled and w not in finished:
                w.finish_reason = w.finish_reason or "cancelled"
                finished.append(w)

    def _with_pages(self, works: list[Work], need: list[int], finished: list[Work]) -> list[int]:
        """Indices of the works whose sessions got pages for ``need`` tokens; the others fail alone."""
        ok = []
        for i, (w, total) in enumerate(zip(works, need)):
            try:
                self._ensure_pages(w, total)
            except Exception as e:
                self._fail(w, e, finished)
            else:
                ok.append(i)
        return ok

    # -- model calls -----------------------------------------------------------------------------------------

    def _ensure_pages(self, w: Work, total: int) -> None:
        """Pages for ``total`` tokens of ``w``'s session, out of the work's reservation first."""
        s = w.session
        need = pages_needed(total, self.pools.page_size) - len(s.pages)
        if need > 0:
            with self.mutex:
                take = min(need, w.reserved_pages)
                s.pages.extend(self.pages.alloc(need, reserved=take))
                w.reserved_pages -= take

    def _table(self, sessions: list[SessionState]) -> torch.Tensor:
        width = max(len(s.pages) for s in sessions)
        rows = [s.pages + [0] * (width - len(s.pages)) for s in sessions]
        return torch.tensor(rows, dtype=torch.int32, device=self.model.device)

    def _rows(self, sessions: list[SessionState], num_new: list[int]) -> torch.Tensor:
        rows = ForwardBatch.rows_for([s.pages for s in sessions], [s.num_cached for s in sessions], num_new, self.pools.page_size)
        return torch.tensor(rows, dtype=torch.long, device=self.model.device)

    def _prefill(self, chunks: list[tuple[Work, int]], finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        ok = self._with_pages([w for w, _ in chunks], [w.session.num_cached + n for w, n in chunks], finished)
        chunks = [chunks[i] for i in ok]
        if not chunks:
            return
        ids: list[int] = []
        positions: list[list[int]] = []
        wanted: list[list] = []
        for w, n in chunks:
            s = w.session
            assert s.slot is not None
            ids.extend(w.prompt[w.done_prefill : w.done_prefill + n])
            lo, hi = s.num_cached, s.num_cached + n
            pending = [c for c in w.checkpoints if lo <= c.target <= hi and c.state_pos < c.target]
            for c in pending:
                if c.target == lo:  # exactly the state before this chunk
                    with self.mutex:
                        kda = torch.stack([st[s.slot] for st in self.pools.kda]).cpu()
                        conv = torch.stack([cv[s.slot] for cv in self.pools.conv]).cpu()
                    self._capture(s, c, kda, conv)
            cps = sorted((c for c in pending if c.target > lo), key=lambda c: c.target)
            positions.append(sorted({c.target - lo for c in cps}))
            wanted.append(cps)
        sessions = [w.session for w, _ in chunks]
        try:
            batch = ForwardBatch(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self.model.device),
                num_new=[n for _, n in chunks],
                start=[s.num_cached for s in sessions],
                slots=torch.tensor([s.slot for s in sessions], device=self.model.device),
                page_table=self._table(sessions),
                checkpoint_positions=positions if any(positions) else None,
                kv_rows=self._rows(sessions, [n for _, n in chunks]),
            )
            logits, states = self.model.step(batch, self.pools)
        except Exception as e:
            self._retry_alone([w for w, _ in chunks], e, finished, sampled)
            return
        # bookkeeping for every row first: the pools have advanced for all of them
        starts = [w.session.num_cached for w, _ in chunks]
        for w, n in chunks:
            w.session.num_cached += n
            w.done_prefill += n
            self.tokens_prefilled += n
        m = 0
        for i, (w, _) in enumerate(chunks):
            s = w.session
            try:
                if states is not None:
                    rel = positions[i]
                    for c in wanted[i]:
                        j = m + rel.index(c.target - starts[i])
                        self._capture(s, c, states.kda[j].cpu(), states.conv[j].cpu())
                    m += len(rel)
                if not w.in_prefill:
                    if w.prefill_only:
                        w.finish_reason = "stop"
                        finished.append(w)
                    else:
                        self._sample(w, logits[i], finished, sampled)
            except Exception as e:
                log.warning("session %s: request failed after the model step (%s: %s)", s.id, type(e).__name__, e)
                self._fail(w, e, finished, rollback=True)

    def _capture(self, s: SessionState, c, kda: torch.Tensor, conv: torch.Tensor) -> None:
        """Upgrade checkpoint ``c`` to hold the exact state at its position, sharing the session's pages."""
        with self.mutex:
            if c.pages:
                self.pages.decref(c.pages)
            keep = pages_needed(c.target, self.pools.page_size)
            c.pages = s.pages[:keep]
            self.pages.incref(c.pages)
            c.kda, c.conv, c.state_pos = kda, conv, c.target
            c.state_blob, c.page_blobs = None, None
            s.checkpoints[c.name] = c

    def _decode(self, works: list[Work], finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        works = [w for w in works if not w.cancelled and w.finish_reason is None and w.error is None]
        ok = self._with_pages(works, [w.session.num_cached + 1 for w in works], finished)
        works = [works[i] for i in ok]
        if not works:
            return
        sessions = [w.session for w in works]
        ids = [s.tokens[s.num_cached] for s in sessions]
        try:
            if self.graphs is not None and self.graphs.accepts(len(sessions)):
                # static buffers + a replayed CUDA graph: no per-step tensors, no host sync before sampling
                slots = [s.slot for s in sessions if s.slot is not None]
                assert len(slots) == len(sessions)
                lens = [s.num_cached + 1 for s in sessions]
                logits = self.graphs.run(ids, slots, lens, [s.pages for s in sessions])
            else:
                batch = ForwardBatch(
                    input_ids=torch.tensor(ids, dtype=torch.long, device=self.model.device),
                    num_new=[1] * len(works),
                    start=[s.num_cached for s in sessions],
                    slots=torch.tensor([s.slot for s in sessions], device=self.model.device),
                    page_table=self._table(sessions),
                    kv_rows=self._rows(sessions, [1] * len(sessions)),
                )
                logits, _ = self.model.step(batch, self.pools)
        except Exception as e:
            self._retry_alone(works, e, finished, sampled)
            return
        for s in sessions:  # every row advanced: bookkeeping before any row can fail
            s.num_cached += 1
        self.tokens_decoded += len(works)
        for i, w in enumerate(works):
            try:
                self._sample(w, logits[i], finished, sampled)
            except Exception as e:
                log.warning("session %s: request failed in sampling (%s: %s)", w.session.id, type(e).__name__, e)
                self._fail(w, e, finished, rollback=True)

    def _sample(self, w: Work, logits: torch.Tensor, finished: list[Work], sampled: list[tuple[Work, int]]) -> None:
        if w.constraint is not None:
            tok, lp = w.constraint.pick(logits, w.params, w.generator, w.params.max_tokens - len(w.output))
            w.constraint.advance(tok)
        else:
            tok, lp = sample(logits, w.params, w.generator)
        w.output.append(tok)
        w.session.tokens.append(tok)  # pending: fed by the next decode step or the next call
        if w.params.logprobs:
            w.logprobs.append(lp)
        if w.params.top_logprobs:
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), w.params.top_logprobs)
            w.top_logprobs.append(list(zip(top.indices.tolist(), top.values.tolist())))
        sampled.append((w, tok))
        if tok in self.tokenizer.eos_ids and not w.params.ignore_eos:
            w.finish_reason = "stop"
        elif len(w.output) >= w.params.max_tokens:
            w.finish_reason = "length"
        elif w.params.stop and self._hit_stop(w):
            w.finish_reason = "stop"
        if w.finish_reason is not None and w not in finished:
            finished.append(w)

    def _hit_stop(self, w: Work) -> bool:
        longest = max(len(s) for s in w.params.stop or [])
        # decode only a tail long enough to hold any stop string (byte tokens: 4 bytes per char at most)
        tail = self.tokenizer.decode(w.output[-(4 * longest + 8) :], skip_special=True)
        return any(s in tail for s in w.params.stop or [])
