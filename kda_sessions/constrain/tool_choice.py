"""Constrained decoding for ``tool_choice``: "required" or a named function forces one well-formed tool call
whose JSON arguments stay a valid prefix of the tool's parameter schema at every token; "none" forbids the
tool-call envelope.

Output under a forcing choice (Kimi's envelope, which the built-in template uses too)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|><|tool_calls_section_end|><|im_end|>
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..engine.sampler import SamplingParams, sample
from ..tokenizer import Tokenizer
from .json_prefix import check_schema, decoding_schema, json_prefix

SECTION_BEGIN = "<|tool_calls_section_begin|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
SECTION_END = "<|tool_calls_section_end|>"
END_OF_TURN = "<|im_end|>"
_SAMPLE_POOL = 512
_ENVELOPE_AFTER_ARGS = 3  # CALL_END, SECTION_END, END_OF_TURN
_CLOSING_ORDER = b'"}],:0tn[{'


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Admission check of tool declarations: each names a function and its parameter schema is one constrained
    decoding can always finish (``check_schema``); ValueError naming the field otherwise."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of tool declarations, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        fn = _function(tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        params = fn.get("parameters")
        if params is not None:
            where = f"tools[{i}].function.parameters"
            check_schema(params, where)
            declared = params.get("type")
            if declared is not None and "object" not in ([declared] if isinstance(declared, str) else declared):
                raise ValueError(f"{where}.type must allow 'object' (a call's arguments are a JSON object), got {declared!r}")


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of a call's arguments: the declared parameters, always an object."""
    return decoding_schema({**(parameters or {}), "type": "object"})


def parse_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """None (auto), "none", "required" or a function name; ValueError naming what is wrong."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "none":
        return "none"
    names = [_function(t).get("name") for t in tools or []]
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice 'required' needs tools declared on the session")
        return "required"
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = _function(tool_choice).get("name")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the declared tools {names}")
    return name


class ToolChoiceConstraint:
    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None, choice: str) -> None:
        check_tools(tools)
        self.tok = tokenizer
        self.choice = choice
        self.forbid = {tokenizer.token_to_id(SECTION_BEGIN), tokenizer.token_to_id(CALL_BEGIN)} if choice == "none" else set()
        fns = [_function(t) for t in tools or []]
        if choice not in ("none", "required"):
            fns = [f for f in fns if f.get("name") == choice]
        self.schemas = {f"functions.{f['name']}:0".encode(): _arguments_schema(f.get("parameters")) for f in fns}
        sp = tokenizer.token_to_id
        self.script: list[tuple[str, Any]] = [] if choice == "none" else [
            ("force", sp(SECTION_BEGIN)), ("force", sp(CALL_BEGIN)), ("name", None), ("force", sp(ARG_BEGIN)),
            ("args", None), ("force", sp(CALL_END)), ("force", sp(SECTION_END)), ("force", sp(END_OF_TURN)),
        ]
        self.step = 0
        self.buf = b""
        self.name = b""
        self._bytes: dict[int, bytes | None] = {}
        self.max_arg_bytes = 512
        self._allowed: set[int] = set()

    @property
    def done(self) -> bool:
        return bool(self.script) and self.step >= len(self.script)

    def _token_bytes(self, t: int) -> bytes | None:
        if t not in self._bytes:
            if self.tok.is_special(t):
                self._bytes[t] = None
            else:
                fn = getattr(self.tok, "token_bytes", None)
                self._bytes[t] = fn(t) if fn is not None else self.tok.decode([t]).encode()
        return self._bytes[t]

    def _valid(self, t: int) -> bool:
        kind, _ = self.script[self.step]
        b = self._token_bytes(t)
        if not b:
            return False
        if kind == "name":
            cand = self.buf + b
            return any(opt.startswith(cand) for opt in self.schemas)
        allowed = self._allowed  # computed once per step in pick()
        if len(b) == 1:
            return b[0] in allowed
        return b[0] in allowed and json_prefix(self.buf + b, self.schemas[self.name])[0] != "bad"

    def pick(
        self, logits: Tensor, params: SamplingParams, generator: torch.Generator | None, remaining: int = 1 << 30
    ) -> tuple[int, float]:
        """The next token under the constraint, and its log-probability under the unconstrained model.
        ``remaining`` is the generation budget left; near its end the arguments are steered to a close."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if not self.script:  # "none": the envelope's opening tokens are masked
            masked = logits.clone()
            masked[list(self.forbid)] = float("-inf")
            tok, _ = sample(masked, params, generator)
            return tok, float(logprobs[tok])
        kind, arg = self.script[self.step]
        if kind == "force":
            return arg, float(logprobs[arg])
        if kind == "args":
            self._allowed = json_prefix(self.buf, self.schemas[self.name])[1]
        if kind == "args" and (len(self.buf) >= self.max_arg_bytes or self._must_close(remaining)):
            closing = self._closing_token()
            if closing is not None:
                return closing, float(logprobs[closing])
        tok = _choose(logits, self._valid, params, generator)
        return tok, float(logprobs[tok])

    def _closing_token(self) -> int | None:
        """Out of budget: steer the arguments to their shortest end (close strings, objects, arrays; the
        simplest value where one is still required) so the call always completes."""
        _, allowed = json_prefix(self.buf, self.schemas[self.name])
        if not allowed:
            return None
        b = _closing_byte(allowed)
        return next((t for t in self._byte_tokens() if self._token_bytes(t) == bytes([b])), None)

    def _must_close(self, remaining: int) -> bool:
        """The budget left is down to what the shortest end needs (and one token of slack)."""
        if remaining > self.max_arg_bytes + _ENVELOPE_AFTER_ARGS + 1:  # more than any end can need
            return False
        return remaining <= self._tokens_to_finish() + 1

    def _tokens_to_finish(self) -> int:
        """Tokens the call still needs if steered to its shortest end now: the closing bytes (one token each at
        most) and the envelope. The model writes freely until its budget comes down to this."""
        buf, schema, n = self.buf, self.schemas[self.name], 0
        while n < self.max_arg_bytes:
            status, allowed = json_prefix(buf, schema)
            if status == "complete" or not allowed:
                break
            buf += bytes([_closing_byte(allowed)])
            n += 1
        return n + _ENVELOPE_AFTER_ARGS

    def _byte_tokens(self) -> list[int]:
        if not hasattr(self, "_singles"):
            self._singles = [t for t in range(self.tok.vocab_size) if len(self._token_bytes(t) or b"") == 1]
        return self._singles

    def advance(self, t: int) -> None:
        if not self.script or self.done:
            return
        kind, _ = self.script[self.step]
        if kind == "force":
            self.step += 1
            return
        self.buf += self._token_bytes(t) or b""
        if kind == "name" and self.buf in self.schemas:
            self.name, self.buf = self.buf, b""
            self.step += 1
        elif kind == "args" and json_prefix(self.buf, self.schemas[self.name])[0] == "complete":
            self.buf = b""
            self.step += 1


def _closing_byte(allowed: set[int]) -> int:
    return next((c for c in _CLOSING_ORDER if c in allowed), min(allowed))


def _choose(logits: Tensor, valid: Callable[[int], bool], params: SamplingParams, generator: torch.Generator | None) -> int:
    order = torch.argsort(logits, descending=True).tolist()
    if params.greedy:
        for t in order:
            if valid(t):
                return t
        raise RuntimeError("constrained decoding found no valid token")
    pool = [t for t in order[:_SAMPLE_POOL] if valid(t)]
    if not pool:
        pool = [next((t for t in order if valid(t)), -1)]
        if pool[0] < 0:
            raise RuntimeError("constrained decoding found no valid token")
    scaled = logits[pool].float()
    probs = torch.softmax((scaled - scaled.max()) / params.temperature, dim=-1)  # max 0: no overflow
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)  # the request's own generator, where it lives
    return pool[int(torch.multinomial(probs, 1, generator=generator))]
