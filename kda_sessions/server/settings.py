"""Server configuration, validated once. The CLI builds it from flags; nothing here reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.config import EngineConfig


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    """A built-in model name (``tiny``, ``tiny-random``) or a Kimi-Linear checkpoint directory."""
    store: str = "disk:"
    """``disk:PATH``, ``redis://host:port/db`` or ``memory:``."""
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port (tests)."""
    api_keys: list[str] = Field(default_factory=list)
    tenants: dict[str, list[str]] = Field(default_factory=dict)
    """Tenant name -> its API keys. Sessions, checkpoints, stored blobs and prefix reuse are scoped to a tenant;
    each key in ``api_keys`` is a tenant of its own."""
    """Accepted bearer keys; empty means no auth, which is refused on a non-loopback host."""
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    """Larger request bodies get 413, checked before the body is buffered."""
    rate_limit_per_minute: int | None = Field(default=None, ge=1)
    """Requests per minute per API key (token bucket); None: unlimited."""
    max_concurrent_per_key: int | None = Field(default=None, ge=1)
    """Requests in flight per API key (a stream counts until it ends); None: unlimited."""
    default_max_tokens: int = Field(default=512, ge=1)
    """max_tokens of a chat completion that names none."""
    served_model_name: str | None = None
    """The id /v1/models reports; default: the model's name."""
    stateless_session_ttl_s: float = Field(default=120.0, ge=0)
    """A session created by a chat completion without ``session_id`` is forgotten from memory after this long
    idle (see server/stateless.py); the store keeps it only if the client saved it."""
    max_stateless_sessions: int = Field(default=32, ge=1)
    """At most this many such sessions are held; beyond it the least recently used idle ones are forgotten. Each
    holds up to ``engine.max_checkpoints_in_memory`` checkpoint states on the host (40 MiB each at Kimi-Linear's
    shape), so this bounds their memory."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    log_level: str = "info"

    @field_validator("api_keys")
    @classmethod
    def _keys_not_blank(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if len(k.strip()) < 8:
                raise ValueError("each API key must have at least 8 non-blank characters")
        return keys

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]
