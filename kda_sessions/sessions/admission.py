"""Admission of one call on a session: everything a request can get wrong is refused here (a ValueError naming
the field, a 400 over HTTP), before the session or the pools change."""

from __future__ import annotations

from typing import Any

import torch

from ..constrain.json_prefix import check_top_level, decoding_schema
from ..constrain.json_reply import JsonReplyConstraint, response_schema
from ..constrain.tool_choice import ToolChoiceConstraint, parse_tool_choice
from ..engine.core import EngineCore
from ..engine.rollback import roll_back
from ..engine.sampler import SamplingParams
from ..engine.scheduler import Constraint, Work
from ..tokenizer import Tokenizer
from .prefix_cache import PrefixCache
from .residency import Residency
from .state import Checkpoint, SessionState


def check_request(s: SessionState, tool_choice: Any, response_format: Any) -> None:
    """Raise ValueError for a tool_choice or response_format the session cannot honour."""
    choice = parse_tool_choice(tool_choice, s.tools)
    schema = response_schema(response_format)
    if schema is not None and choice not in (None, "none"):
        raise ValueError("response_format cannot be combined with a tool_choice that forces a tool call")
    if schema is not None:
        check_top_level(schema, "response_format.json_schema.schema")


def work_for(
    s: SessionState, params: SamplingParams, core: EngineCore, tokenizer: Tokenizer, *, prefill_only: bool,
    tool_choice: Any, response_format: Any,
) -> Work:
    """A work for the session's pending tokens (its prompt, checkpoints and callbacks are set by the caller);
    ``response_format`` (OpenAI's shape) constrains the reply to JSON, ``tool_choice`` to a tool call."""
    cfg = core.config
    capacity = cfg.num_pages * cfg.page_size
    if s.num_tokens + (0 if prefill_only else params.max_tokens) > capacity:
        raise ValueError(
            f"max_tokens={params.max_tokens} after a context of {s.num_tokens} tokens exceeds this engine's KV "
            f"capacity of {capacity} tokens"
        )
    check_request(s, tool_choice, response_format)
    schema = response_schema(response_format)
    choice = parse_tool_choice(tool_choice, s.tools)
    constraint: Constraint | None = None
    if schema is not None:
        constraint = JsonReplyConstraint(tokenizer, decoding_schema(schema))
    elif choice is not None:
        constraint = ToolChoiceConstraint(tokenizer, s.tools, choice)
    if s.num_tokens <= s.num_cached and not prefill_only:
        raise ValueError(f"session {s.id!r} has no tokens to continue from; append some first")
    # on the model's device: a draw then never waits for the device (a step queued ahead keeps running)
    generator = None if params.seed is None else torch.Generator(device=core.device).manual_seed(params.seed)
    return Work(session=s, prompt=[], params=params, prefill_only=prefill_only, generator=generator,
                constraint=constraint)


class Admission:
    """Turns calls on sessions into works for the step machinery: checks, residency, pages, submission."""

    def __init__(self, core: EngineCore, residency: Residency, tokenizer: Tokenizer, prefix_cache: PrefixCache) -> None:
        self.core = core
        self.residency = residency
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer

    async def start(
        self,
        s: SessionState,
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        checkpoints: list[Checkpoint] | None = None,
        end_checkpoint: Checkpoint | None = None,
        on_token: Any = None,
        on_finish: Any = None,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> Work:
        """Queue the session's pending tokens for prefill and (unless prefill_only) generation. Caller holds
        ``s.lock`` until the work has finished (see ``wait``). Everything a request can get wrong is refused
        before the session or the pools change."""
        work = work_for(s, params, self.core, self.tokenizer, prefill_only=prefill_only, tool_choice=tool_choice,
                        response_format=response_format)
        await self.residency.make_resident(s)
        end = s.num_tokens - (1 if prefill_only else 0)
        await self.prefix_cache.reuse(s, end)  # another session may hold a longer prefix of these tokens
        # Pages: the worst case (the whole max_tokens) is set aside when the pool has it; while other requests
        # run, the prompt and first token are enough to start: later pages come from the free pool, and
        # preemption parks younger requests to make room (engine/preemption.py). With nothing running, a
        # request waits for its worst case (idle sessions are evicted), as preemption would have no one to park.
        worst = s.num_tokens + (0 if prefill_only else params.max_tokens)
        least = s.num_tokens + (0 if prefill_only else 1)
        admit = least if self.core.busy else worst
        await self.residency.ensure_pages(s, admit)
        work.prompt = s.tokens[s.num_cached : s.num_tokens - (1 if prefill_only else 0)]
        work.prompt_len = len(work.prompt)
        work.checkpoints = [c for c in s.checkpoints.values() if c.state_pos < c.target] + list(checkpoints or [])
        work.checkpoints += self.prefix_cache.interval_checkpoints(s, end, len(work.checkpoints) + 1)
        work.end_checkpoint = end_checkpoint
        work.on_token, work.on_finish = on_token, on_finish
        if not work.prompt:
            work.finish_reason = "stop"
            work.finished.set()
            if on_finish is not None:
                on_finish()
            return work
        # set the pages aside (ensure_pages just made them free, with no await since)
        self.core.submit(work, reserve=max(0, self.core.pages_for(admit) - len(s.pages)))
        return work

    def take_back(self, s: SessionState, before: int) -> None:
        """After ``start`` raised (refused, or cancelled): drop the tokens from ``before`` on that the caller added
        for it. ``start`` may have seated the session on another session's checkpoint inside those tokens
        (``PrefixCache.reuse``) before it raised; its state is then past what stays, so it goes back to its newest
        exact checkpoint before them (else the empty state: the next call prefills again)."""
        del s.tokens[before:]
        if s.resident and s.num_cached > max(0, s.num_tokens - 1):
            with self.core.pools.mutex:
                s.num_cached = max(0, s.num_tokens - 1)
                roll_back(s, self.core.pools)

    async def wait(self, work: Work) -> Work:
        """Wait for ``work`` (cancelled with the waiting task); raises its error."""
        try:
            return await self.core.wait(work)
        finally:
            s = work.session
            assert isinstance(s, SessionState)
            s.touch()
            self.prefix_cache.settle(work)

    async def cancel(self, work: Work) -> None:
        await self.core.cancel(work)
