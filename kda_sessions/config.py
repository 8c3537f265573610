"""Model configuration: a Kimi-Linear ``config.json`` (``model_type: kimi_linear``), validated once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError


class LinearAttnConfig(BaseModel):
    """``linear_attn_config`` of Kimi-Linear; layer numbers are 1-based."""

    model_config = ConfigDict(extra="allow")

    kda_layers: list[int]
    full_attn_layers: list[int]
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    short_conv_kernel_size: int = Field(default=4, ge=1)


class ModelConfig(BaseModel):
    """The fields of KDA.md. Unknown keys of a real checkpoint's config are kept, not used."""

    model_config = ConfigDict(extra="allow")

    model_type: Literal["kimi_linear"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(ge=0)
    v_head_dim: int = Field(gt=0)
    mla_use_nope: bool = True
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_token: int = Field(default=0, ge=0)
    num_shared_experts: int = Field(default=0, ge=0)
    moe_renormalize: bool = True
    moe_router_activation_func: Literal["sigmoid"] = "sigmoid"
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = Field(default=0, ge=0)
    moe_layer_freq: int = Field(default=1, ge=1)
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    tie_word_embeddings: bool = False
    linear_attn_config: LinearAttnConfig
    kda_gate_lower_bound: float | None = Field(default=None, lt=0)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _math_keys(cls, data: Any) -> Any:
        """Keys of real checkpoints' configs that change the math: ``linear_attn_config.gate_lower_bound`` (the
        K3 spelling of ``kda_gate_lower_bound``) is moved there; ``mla_use_output_gate`` true and
        ``num_expert_group`` / ``topk_group`` other than 1 are refused. Done on
        the raw dict so that configs without them dump (and fingerprint) as before."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("mla_use_output_gate", False) is not False:
            raise ValueError("mla_use_output_gate: the MLA output gate is not implemented; only false is supported")
        for key in ("num_expert_group", "topk_group"):  # group-limited routing (DeepSeek-V3 style); Kimi-Linear uses 1
            if data.get(key, 1) not in (1, None):
                raise ValueError(f"{key}={data[key]}: group-limited expert routing is not implemented; only 1 is supported")
        lac = data.get("linear_attn_config")
        if isinstance(lac, dict) and "gate_lower_bound" in lac:
            lac = dict(lac)
            lb = lac.pop("gate_lower_bound")
            data["linear_attn_config"] = lac
            if lb is not None:
                if data.get("kda_gate_lower_bound") not in (None, lb):
                    raise ValueError(f"linear_attn_config.gate_lower_bound={lb} disagrees with "
                                     f"kda_gate_lower_bound={data['kda_gate_lower_bound']}")
                data["kda_gate_lower_bound"] = lb
        return data

    @model_validator(mode="after")
    def _adds_up(self) -> ModelConfig:
        lac = self.linear_attn_config
        layers = set(range(1, self.num_hidden_layers + 1))
        kda, full = set(lac.kda_layers), set(lac.full_attn_layers)
        if kda & full:
            raise ValueError(f"linear_attn_config: layers {sorted(kda & full)} are in both kda_layers and full_attn_layers")
        if missing := layers - kda - full:
            raise ValueError(f"linear_attn_config: layers {sorted(missing)} are in neither kda_layers nor full_attn_layers")
        if extra := (kda | full) - layers:
            raise ValueError(f"linear_attn_config: layers {sorted(extra)} exceed num_hidden_layers={self.num_hidden_layers}")
        if len(lac.kda_layers) != len(kda) or len(lac.full_attn_layers) != len(full):
            raise ValueError("linear_attn_config: a layer is listed twice")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope: only NoPE MLA (true) is supported")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: the hybrid model has an untied lm_head (false)")
        if any(self.is_moe(i) for i in range(self.num_hidden_layers)) and (
            self.num_experts <= 0 or not 0 < self.num_experts_per_token <= self.num_experts
        ):
            raise ValueError(
                f"num_experts_per_token must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_token}"
            )
        return self

    # 0-based layer kinds
    def is_kda(self, layer: int) -> bool:
        return layer + 1 in self.linear_attn_config.kda_layers

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda(i)]

    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config.num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def conv_size(self) -> int:
        return self.linear_attn_config.short_conv_kernel_size

    @property
    def latent_dim(self) -> int:
        """Numbers an MLA layer caches per token: the normed latent c and k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def fingerprint(self) -> str:
        """A stable hash of every field that shapes the computation."""
        return hashlib.sha256(self.model_dump_json(exclude_none=False).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"invalid model config: {problems}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(data)
