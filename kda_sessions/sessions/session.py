"""The user's handle on one session: calls go to the session manager's public methods. Bookkeeping lives in
``SessionState``; tensors in the pools."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from ..engine.sampler import SamplingParams
from ..engine.scheduler import Work
from ..storage import SaveResult
from ..tokenizer import (
    ContentDelta,
    ToolCall,
    ToolCallStreamParser,
    encode_chat_turn,
    encode_end_of_turn,
    parse_assistant_output,
)
from ..types import CheckpointInfo, Done, Reply, StreamEvent, TokenDelta, ToolCallEvent, TopLogprob, Usage
from .admission import check_request
from .manager import SessionManager
from .state import Checkpoint, SessionState


class Session:
    def __init__(self, manager: SessionManager, state: SessionState) -> None:
        self.manager = manager
        self.state = state
        self._turns_done: dict[Work, Reply] = {}
        """The reply of the last turn, once recorded (a stream's cleanup may finish a turn a second time)."""

    @property
    def id(self) -> str:
        return self.state.id

    @property
    def num_tokens(self) -> int:
        return self.state.num_tokens

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.state.messages]

    def __repr__(self) -> str:
        return f"Session({self.id!r}, num_tokens={self.num_tokens})"

    # -- raw tokens ------------------------------------------------------------------------------------------

    async def append(self, tokens: list[int] | str) -> Usage:
        """Feed token ids (or text, encoded without special tokens) into the context: prefill only."""
        ids = self.manager.tokenizer.encode(tokens) if isinstance(tokens, str) else list(tokens)
        self._check_ids(ids)
        s = self.state
        async with s.lock:
            before = s.num_tokens
            s.tokens.extend(ids)
            try:
                work = await self.manager.admission.start(s, SamplingParams(max_tokens=1), prefill_only=True)
            except BaseException:  # refused or cancelled: the session is as it was
                self.manager.admission.take_back(s, before)
                raise
            await self.manager.admission.wait(work)
            run = work.prompt_len + work.replayed
            return Usage(prompt_tokens=s.num_tokens, prefill_tokens=run, cached_tokens=max(0, s.num_tokens - run))

    async def generate(
        self,
        max_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        logprobs: bool = False,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
    ) -> Reply:
        """Continue the context with up to ``max_tokens`` new tokens (no chat template)."""
        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, _stops(stop), logprobs, ignore_eos,
                                top_logprobs)
        async with self.state.lock:
            work = await self.manager.admission.start(self.state, params)
            await self.manager.admission.wait(work)
            return self._reply(work, chat=False)

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.manager.core.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be ints in [0, {vocab}), got {bad[:5]}")

    # -- chat ------------------------------------------------------------------------------------------------

    async def send(self, content: str, **sampling: Any) -> Reply:
        """A user message through the chat template, then the assistant's reply (tool calls parsed).
        ``sampling``: max_tokens, temperature, top_p, top_k, seed, stop, logprobs, ignore_eos, and
        tool_choice ("auto", "none", "required" or a function name / {"type": "function", ...}), which
        constrains decoding to one valid call whose arguments match the tool's parameter schema, and
        response_format (OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema"}}),
        which constrains the reply to one JSON value valid against the schema."""
        return await self._turn([{"role": "user", "content": content}], sampling)

    async def send_tool_result(self, call_id: str, output: str, **sampling: Any) -> Reply:
        """A tool message answering ``call_id``, then the assistant's reply."""
        return await self._turn([{"role": "tool", "tool_call_id": call_id, "content": output}], sampling)

    async def send_messages(self, messages: list[dict[str, Any]], **sampling: Any) -> Reply:
        """Several new messages (user, tool, ...) at once, then the reply."""
        return await self._turn(messages, sampling)

    async def stream(self, content: str | list[dict[str, Any]], **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Like ``send`` but yields ``TokenDelta`` / ``ToolCallEvent`` as they come, then ``Done`` with usage.
        Leaving the loop early cancels the generation and frees its place in the batch."""
        messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
        send, recv = anyio.create_memory_object_stream[int](math.inf)
        s = self.state
        await s.lock.acquire()
        work: Work | None = None
        try:
            work = await self._start_turn(messages, sampling, on_token=send.send_nowait, on_finish=send.close)
            decoder = self.manager.tokenizer.incremental_decoder()
            parser = ToolCallStreamParser()
            async with recv:
                tk = self.manager.tokenizer
                markers = {tk.token_to_id(m) for m in _TOOL_MARKERS if m in tk.special_ids}
                async for tok in recv:
                    if tk.is_special(tok) and tok not in markers:  # end of turn etc. are not content
                        continue
                    for ev in parser.feed(decoder.feed(tok)):
                        out = _event(ev, tok)
                        if out is not None:
                            yield out
            for ev in parser.feed(decoder.flush()) + parser.finish():
                out = _event(ev, None)
                if out is not None:
                    yield out
            await self.manager.admission.wait(work)
            yield Done(reply=self._finish_turn(work))
        finally:
            if work is not None and not work.finished.is_set():
                await self.manager.admission.cancel(work)
                self._finish_turn(work)
            s.lock.release()

    async def _turn(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Reply:
        async with self.state.lock:
            work = await self._start_turn(messages, sampling)
            try:
                await self.manager.admission.wait(work)
            finally:
                reply = self._finish_turn(work)
            return reply

    async def _start_turn(
        self,
        messages: list[dict[str, Any]],
        sampling: dict[str, Any],
        on_token: Callable[[int], None] | None = None,
        on_finish: Callable[[], None] | None = None,
    ) -> Work:
        m, s = self.manager, self.state
        sampling = dict(sampling)
        tool_choice = sampling.pop("tool_choice", None)
        response_format = sampling.pop("response_format", None)
        params = _params(sampling)
        check_request(s, tool_choice, response_format)  # a bad request fails before the session changes
        tok, tpl = m.tokenizer, m.template
        checkpoints: list[Checkpoint] = []
        head_name = f"msg-{len(s.messages) - 1}"
        if s.messages and s.num_cached < s.num_tokens - 1 and head_name not in s.checkpoints:
            # the end of what is pending before this turn (a new conversation's system prompt + tools): indexed
            # once this prefill reaches it, so other conversations with the same head start from its state
            checkpoints.append(Checkpoint(
                name=head_name, position=s.num_tokens, state_pos=-1,
                num_messages=len(s.messages), turn_open=s.turn_open,
            ))
        ids: list[int] = encode_end_of_turn(tok, tpl) if s.turn_open else []
        body, full = encode_chat_turn(tok, messages, template=tpl, history=s.messages, tools=s.tools, scope=s.tenant)
        boundary = s.num_tokens + len(ids) + len(body)
        ids += full
        undo = (s.num_tokens, len(s.messages), s.turn_open)
        s.tokens.extend(ids)
        s.messages.extend(dict(m) for m in messages)
        s.turn_open = False
        name = f"msg-{len(s.messages) - 1}"
        # the input's end: captured by this very prefill, from the state at that position
        checkpoints.append(Checkpoint(name=name, position=boundary, state_pos=-1, num_messages=len(s.messages)))
        # the reply's end: captured by the step thread when the work ends (the assistant message comes next)
        end = Checkpoint(name=f"msg-{len(s.messages)}", position=-1, state_pos=-1, num_messages=len(s.messages) + 1)
        try:
            return await m.admission.start(s, params, checkpoints=checkpoints, end_checkpoint=end,
                                           on_token=on_token, on_finish=on_finish, tool_choice=tool_choice,
                                           response_format=response_format)
        except BaseException:  # refused (bad max_tokens, no room) or cancelled: the session is as it was
            m.admission.take_back(s, undo[0])
            del s.messages[undo[1] :]
            s.turn_open = undo[2]
            raise

    def _finish_turn(self, work: Work) -> Reply:
        """Record the assistant message and the checkpoint after it; build the reply."""
        m, s = self.manager, self.state
        if work in self._turns_done:
            return self._turns_done[work]
        reply = self._reply(work, chat=True)
        message: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if reply.tool_calls:
            message["tool_calls"] = [tc.model_dump() for tc in reply.tool_calls]
        s.messages.append(message)
        s.turn_open = not (work.output and work.output[-1] in m.tokenizer.eos_ids)
        for c in work.checkpoints:
            if c.state_pos >= 0:
                m.index(s, c)
        end = work.end_checkpoint
        if end is not None and end.resident and s.checkpoints.get(end.name) is end:
            end.turn_open = s.turn_open
            m.index(s, end)
        m.residency.trim_checkpoints(s)
        self._turns_done = {work: reply}
        return reply

    def _reply(self, work: Work, chat: bool) -> Reply:
        out = work.output
        parsed = parse_assistant_output(out, self.manager.tokenizer) if chat else None
        text = parsed.content if parsed is not None else self.manager.tokenizer.decode(out, skip_special=True)
        tool_calls: list[ToolCall] = list(parsed.tool_calls) if parsed is not None else []
        if work.params.stop:
            cut = min((i for i in (text.find(st) for st in work.params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
        finish = work.finish_reason or "cancelled"
        if tool_calls and finish == "stop":
            finish = "tool_calls"
        prompt = len(work.session.tokens) - len(out)
        run = work.prompt_len + work.replayed  # replayed: run again after a failed step rolled the session back
        usage = Usage(
            prompt_tokens=prompt, prefill_tokens=run, cached_tokens=max(0, prompt - run),
            completion_tokens=len(out),
        )
        counters = self.manager.counters
        counters["prefill_tokens"] += usage.prefill_tokens
        counters["cached_tokens"] += usage.cached_tokens
        counters["completion_tokens"] += usage.completion_tokens
        return Reply(
            session_id=self.id, text=text, token_ids=list(out), tool_calls=tool_calls, finish_reason=finish,  # type: ignore[arg-type]
            usage=usage, logprobs=list(work.logprobs) if work.params.logprobs else None,
            top_logprobs=[[TopLogprob(token_id=t, logprob=lp) for t, lp in row] for row in work.top_logprobs]
            if work.params.top_logprobs else None,
        )

    # -- checkpoints, save, fork -----------------------------------------------------------------------------

    async def checkpoint(self, name: str) -> CheckpointInfo:
        """Name the current position; ``engine.fork(session_id, checkpoint=name)`` continues from it. Tokens not
        yet run through the model are prefilled first, so a fork from it re-runs nothing of its prefix."""
        if not name or name == "head" or name.startswith("__"):
            raise ValueError(f"checkpoint name must be non-empty, not 'head' and not start with '__', got {name!r}")
        s = self.state
        async with s.lock:
            await self.manager.residency.make_resident(s)
            if s.num_cached < s.num_tokens - 1:  # pending tokens: prefill them so the checkpoint holds their state
                work = await self.manager.admission.start(s, SamplingParams(max_tokens=1), prefill_only=True)
                await self.manager.admission.wait(work)
            cp = await self.manager.checkpoint_here(s, name)
            return CheckpointInfo(session_id=self.id, name=name, position=cp.position)

    async def save(self) -> SaveResult:
        """Returns once the snapshot is durable in the store."""
        async with self.state.lock:
            return await self.manager.save(self.state)

    async def fork(self, checkpoint: str | None = None) -> Session:
        """A new session from ``checkpoint`` of this one (default: its current position)."""
        m = self.manager
        return Session(m, await m.fork(self.state.tenant, self.id, checkpoint, m.new_id(self.state.tenant)))


_TOOL_MARKERS = (
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)


def _stops(stop: list[str] | str | None) -> list[str] | None:
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


def _params(sampling: dict[str, Any]) -> SamplingParams:
    allowed = {"max_tokens", "temperature", "seed", "stop", "top_p", "top_k", "logprobs", "ignore_eos", "top_logprobs"}
    unknown = set(sampling) - allowed
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; allowed: {sorted(allowed)}")
    sampling = dict(sampling)
    sampling["stop"] = _stops(sampling.get("stop"))
    return SamplingParams(**sampling)


def _event(ev: ContentDelta | ToolCall, tok: int | None) -> StreamEvent | None:
    if isinstance(ev, ToolCall):
        return ToolCallEvent(tool_call=ev)
    if ev.text:
        return TokenDelta(text=ev.text, token_ids=[tok] if tok is not None else [])
    return None
