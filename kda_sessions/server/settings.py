"""Server configuration, validated once. The CLI builds it from flags; nothing here reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..dtypes import DTYPE_NAMES
from ..engine.config import EngineConfig
from ..generation_config import generation_defaults


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    """A built-in model name (``tiny``, ``tiny-random``) or a Kimi-Linear checkpoint directory."""
    store: str = "disk:"
    """``disk:PATH``, ``redis://host:port/db`` or ``memory:``."""
    device: str = "cpu"
    dtype: str = "auto"
    """The weights' dtype: ``auto`` (bfloat16 on CUDA, float32 on the CPU), ``float32``, ``bfloat16``, ``float16``."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port (tests)."""
    api_keys: list[str] = Field(default_factory=list)
    """Accepted bearer keys; empty means no auth, which is refused on a non-loopback host."""
    tenants: dict[str, list[str]] = Field(default_factory=dict)
    """Tenant name -> its API keys. Sessions, checkpoints, stored blobs and prefix reuse are scoped to a tenant;
    each key in ``api_keys`` is a tenant of its own."""
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    """Larger request bodies get 413, checked before the body is buffered."""
    rate_limit_per_minute: int | None = Field(default=None, ge=1)
    """Requests per minute per API key (token bucket); None: unlimited."""
    max_concurrent_per_key: int | None = Field(default=None, ge=1)
    """Requests in flight per API key (a stream counts until it ends); None: unlimited."""
    default_max_tokens: int | None = Field(default=None, ge=1)
    """max_tokens of a chat completion that names none; None: the model's generation config's
    ``max_new_tokens`` (256 for ``tiny``), else 512."""
    served_model_name: str | None = None
    """The id /v1/models reports; default: the model's name."""
    served_model_aliases: list[str] = Field(default_factory=list)
    """Other ``model`` names a request may give; any other name is refused with 404 ``model_not_found``."""
    stateless_session_ttl_s: float = Field(default=120.0, ge=0)
    """A session created by a chat completion without ``session_id`` is forgotten from memory (slot, pages,
    checkpoint states) after this long idle; it stays in the store (see server/stateless.py)."""
    max_stateless_sessions: int = Field(default=32, ge=1)
    """At most this many such sessions are held in memory; beyond it the least recently used idle ones are
    forgotten (they stay in the store). Each holds up to ``engine.max_checkpoints_in_memory`` checkpoint states
    on the host (40 MiB each at Kimi-Linear's shape), so this bounds their memory."""
    save_chat_sessions: bool = True
    """Save the session of every chat completion once its reply is sent, so its ``session_id`` answers after the
    server forgets it, evicts it or restarts. False: such sessions live in memory only (and answer 404 once
    forgotten), unless the client saves them (``POST /v1/sessions/{id}/save``)."""
    chat_session_retention_s: float = Field(default=7 * 86_400.0, ge=0)
    """A session created by a chat completion without ``session_id`` (id ``s_chat_...``) is deleted from the
    store once it has not been used for this long; 0 keeps it until it is deleted."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    log_level: str = "info"

    @field_validator("api_keys")
    @classmethod
    def _keys_not_blank(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k.strip()) < 8:
                raise ValueError("each API key must have at least 8 non-blank characters")
        return keys

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, name: str) -> str:

        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
        return name

    def sampling_defaults(self) -> dict[str, float | int]:
        """temperature, top_p and max_tokens of a request that names none: the model's generation config
        (greedy for ``tiny``) where it has one, else OpenAI's (1.0, 1.0) and ``default_max_tokens`` or 512."""

        gen = generation_defaults(self.model)
        return {
            "temperature": 1.0 if gen.temperature is None else gen.temperature,
            "top_p": 1.0 if gen.top_p is None else gen.top_p,
            "max_tokens": self.default_max_tokens or gen.max_tokens or 512,
        }

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]

    @property
    def model_names(self) -> set[str]:
        """Every name a request's ``model`` may give: the served name, the model as given and its folder
        name, and the aliases."""
        return {self.model_name, self.model, self.model.rstrip("/").rsplit("/", 1)[-1], *self.served_model_aliases}
