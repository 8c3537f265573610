"""Request bodies. Chat completions follow OpenAI's field names; unknown OpenAI fields are accepted and
ignored (agent frameworks send many), except the ones whose meaning the server cannot honour."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..types import MAX_TOP_LOGPROBS

MAX_CHOICES = 8
"""``n`` accepted by chat completions: each extra choice is a fork of the prompt's state."""

_CALL_ID_SUFFIX = re.compile(r"#[0-9a-f]{8}$")


def model_call_id(call_id: str) -> str:
    """The id the model wrote for a tool call, from the unique id the server gave it (see chat.unique_call_id):
    what the chat template renders, so a resent history encodes to the tokens the session holds."""
    return _CALL_ID_SUFFIX.sub("", call_id)


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """What the chat template sees: developer is system; OpenAI-only fields are dropped."""
        m: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = [_with_model_id(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = model_call_id(self.tool_call_id)
        if self.name is not None and self.role == "tool":
            m["name"] = self.name
        return m


def _with_model_id(call: dict[str, Any]) -> dict[str, Any]:
    return {**call, "id": model_call_id(call["id"])} if isinstance(call.get("id"), str) else call


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, json_object, or json_schema (enforced by constrained decoding)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {\"name\": ..., \"schema\": {...}}")
        return self

    def plain(self) -> dict[str, Any] | None:
        """The engine's ``response_format`` argument; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        assert self.json_schema is not None
        return {"type": "json_schema", "json_schema": {"name": self.json_schema.name, "schema": self.json_schema.schema_}}


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    session_id: str | None = Field(default=None, max_length=128)
    """Extension: continue this session; ``messages`` are then only the new ones."""
    ignore_eos: bool = False
    """Extension (as in vLLM): keep generating past end-of-turn."""
    top_k: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.n not in (None, 1) and self.stream:
            raise ValueError("n > 1 is served without streaming only; send stream=false or n=1")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with a tool_choice that forces a tool call")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tools_plain(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(BaseModel):
    """``/v1/completions``: a raw prompt (no chat template), continued as is."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=0)
    """Only 0 (the sampled tokens' logprobs); alternatives are not returned."""
    echo: bool = False
    suffix: str | None = None
    session_id: str | None = Field(default=None, max_length=128)
    """Extension: continue this session's raw context with ``prompt``."""
    ignore_eos: bool = False
    top_k: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (a list of several is not served)")
            self.prompt = self.prompt[0]  # type: ignore[assignment]
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return self


# -- /v1/sessions ------------------------------------------------------------------------------------------


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system: str | None = None
    tools: list[ToolSpec] | None = None
    session_id: str | None = Field(default=None, max_length=128)


class Sampling(BaseModel):
    """The Python API's sampling arguments and defaults (greedy)."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)

    def sampling(self) -> dict[str, Any]:
        return self.model_dump(include=set(Sampling.model_fields))


class SendMessages(Sampling):
    content: str | None = None
    messages: list[ChatMessage] | None = None
    stream: bool = False
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    """As in chat completions: json_object / json_schema constrain the reply to JSON."""

    def sampling(self) -> dict[str, Any]:
        out = super().sampling()
        fmt = self.response_format.plain() if self.response_format is not None else None
        if fmt is not None:
            out["response_format"] = fmt
        return out

    @model_validator(mode="after")
    def _one_input(self) -> SendMessages:
        if (self.content is None) == (self.messages is None):
            raise ValueError("give exactly one of content (a user message) or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def new_messages(self) -> list[dict[str, Any]]:
        if self.content is not None:
            return [{"role": "user", "content": self.content}]
        return [m.to_template() for m in self.messages or []]


class Append(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] | str


class CreateCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)


class Fork(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str | None = None
    session_id: str | None = Field(default=None, max_length=128)
    """Id for the new session (default: a random one)."""
