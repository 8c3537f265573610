"""Translation between OpenAI chat completions and sessions: history splitting, tool-call checks, response
and chunk bodies. Pure functions, so the tool-call path is tested without a model that calls tools."""

from __future__ import annotations

import secrets
import time
from typing import Any

from ..engine.types import Reply, Usage
from ..tokenizer import ToolCall, validate_arguments
from .schemas import ChatCompletionRequest, NamedToolChoice
from .settings import ServerSettings


def split_history(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(closed prefix, new messages): the prefix ends after the last assistant message (or after the leading
    system messages when there is none); its tokens are what a stored checkpoint can already hold."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        last = -1
        while last + 1 < len(messages) and messages[last + 1]["role"] == "system":
            last += 1
    prefix, new = messages[: last + 1], messages[last + 1 :]
    if not new:
        raise ValueError("the last message must be a user, tool or system message: nothing to answer")
    return prefix, new


def sampling_args(req: ChatCompletionRequest, settings: ServerSettings) -> dict[str, Any]:
    """Session.send_messages keyword arguments; unset fields take the model's generation config, else OpenAI's
    defaults (ServerSettings.sampling_defaults)."""
    default = settings.sampling_defaults()
    args: dict[str, Any] = {
        "max_tokens": req.max_completion_tokens or req.max_tokens or default["max_tokens"],
        "temperature": default["temperature"] if req.temperature is None else req.temperature,
        "top_p": default["top_p"] if req.top_p is None else req.top_p,
        "seed": req.seed,
        "stop": req.stop,
        "logprobs": bool(req.logprobs),
    }
    if req.top_logprobs:
        args["top_logprobs"] = req.top_logprobs
    if req.response_format is not None and req.response_format.plain() is not None:
        args["response_format"] = req.response_format.plain()
    if req.ignore_eos:
        args["ignore_eos"] = True
    if req.top_k:
        args["top_k"] = req.top_k
    return args


def check_tool_calls(
    calls: list[ToolCall], tools: list[dict[str, Any]] | None, tool_choice: Any
) -> tuple[list[ToolCall], list[str]]:
    """The calls that name a declared tool (the named one, under a named tool_choice) with arguments valid
    against its schema, and a description of each call dropped. tool_choice 'none' drops every call."""
    if tool_choice == "none" or not calls:
        return [], [f"tool_choice is 'none': dropped a call to {c.function.name!r}" for c in calls]
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or []}
    only = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    valid, problems = [], []
    for c in calls:
        name = c.function.name
        if name not in schemas or (only is not None and name != only):
            problems.append(f"call to undeclared or unrequested function {name!r}")
            continue
        errors = validate_arguments(c.function.arguments, schemas[name])
        if errors:
            problems.append(f"arguments of {name!r} do not match its schema: {'; '.join(errors[:3])}")
            continue
        valid.append(c)
    return valid, problems


def tool_choice_met(tool_choice: Any, calls: list[ToolCall]) -> bool:
    if tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
        return bool(calls)
    return True


def finish_reason(reply_reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish_reason. A reply cut by max_tokens is "length" even when it holds a call (a forced
    call's arguments may be cut short; a complete one is still returned)."""
    if reply_reason == "length":
        return "length"
    if calls:
        return "tool_calls"
    return "stop"  # also when every call was dropped


def unique_call_ids(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls with ids unique to this reply: the model's own id (``functions.NAME:0``, what the chat
    template renders) plus ``#`` and 8 random hex digits, which schemas.model_call_id strips from a resent
    history, so the tokens re-encode exactly."""
    return [c.model_copy(update={"id": f"{c.id}#{secrets.token_hex(4)}"}) for c in calls]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.function.name, "arguments": call.function.arguments}}
    if index is not None:
        body["index"] = index
    return body


def logprobs_body(reply: Reply, decode: Any) -> dict[str, Any] | None:
    """OpenAI's ``choices[i].logprobs``: each generated token, and the most likely ones at its position when
    ``top_logprobs`` was asked for."""
    if reply.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    tops = reply.top_logprobs or [[] for _ in reply.token_ids]
    content = [{**entry(tok, lp), "top_logprobs": [entry(t.token_id, t.logprob) for t in top]}
               for tok, lp, top in zip(reply.token_ids, reply.logprobs, tops)]
    return {"content": content, "refusal": None}


def new_completion_id(prefix: str = "chatcmpl-") -> str:
    return prefix + secrets.token_hex(12)


def choice_body(index: int, reply: Reply, calls: list[ToolCall], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice; ``session_id`` (extension) names the session holding it: the request's for choice 0, a
    fork of the prompt's state for the others."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text if (reply.text or not calls) else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = [tool_call_body(c) for c in calls]
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(reply.finish_reason, calls), "session_id": reply.session_id}


def completion_body(
    reply: Reply, calls: list[ToolCall], model: str, completion_id: str, logprobs: dict[str, Any] | None = None,
    more: list[tuple[Reply, list[ToolCall], dict[str, Any] | None]] | None = None,
) -> dict[str, Any]:
    """The chat.completion object: ``reply`` is choice 0, ``more`` the other choices (n > 1); usage counts the
    prompt once and every choice's completion tokens."""
    choices = [choice_body(0, reply, calls, logprobs)]
    more = more or []
    choices += [choice_body(i, r, c, lp) for i, (r, c, lp) in enumerate(more, 1)]
    usage = reply.usage
    if more:
        usage = usage.model_copy(update={"completion_tokens": usage.completion_tokens
                                         + sum(r.usage.completion_tokens for r, _, _ in more)})
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
        "system_fingerprint": None,
        "session_id": reply.session_id,
    }


def text_completion_body(reply: Reply, model: str, completion_id: str, with_logprobs: bool, decode: Any) -> dict[str, Any]:
    """``/v1/completions``' text_completion object."""
    logprobs = None
    if with_logprobs and reply.logprobs is not None:
        tokens = [decode([t]) for t in reply.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        logprobs = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": None, "text_offset": offsets}
    finish = "length" if reply.finish_reason == "length" else "stop"
    usage = usage_body(reply.usage)
    usage.pop("completion_tokens_details")
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": reply.text, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage,
        "system_fingerprint": None,
        "session_id": reply.session_id,
    }


class ChunkWriter:
    """``chat.completion.chunk`` bodies for one streamed completion."""

    def __init__(self, completion_id: str, model: str, session_id: str) -> None:
        self.id = completion_id
        self.model = model
        self.session_id = session_id
        self.created = int(time.time())
        self.num_calls = 0

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, usage: Usage | None = None) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "system_fingerprint": None, "choices": choices,
                                "session_id": self.session_id}
        if usage is not None:
            body["usage"] = usage_body(usage)
        return body

    def role(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def content(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text})

    def tool_call(self, call: ToolCall) -> dict[str, Any]:
        body = self._chunk({"tool_calls": [tool_call_body(call, index=self.num_calls)]})
        self.num_calls += 1
        return body

    def finish(self, reason: str) -> dict[str, Any]:
        return self._chunk({}, finish=reason)

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self._chunk(None, usage=usage)
