"""Load and save models in the Kimi-Linear safetensors format; built-in models by name.

Weights go into a model built on the meta device, so no random weights are ever materialised. A checkpoint on
disk streams tensor by tensor from memory-mapped shards into storage allocated on the target device in the
target dtype (the routed experts straight into their stacked tensors): host memory holds one shard's mapping and
one tensor at a time, never the whole model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from ..config import ModelConfig
from ..errors import CheckpointError
from .ffn import MoE, SwiGLU
from .model import HybridModel

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_MODELS = ("tiny-random", "tiny")
# parameters kept in float32 whatever the model dtype: they feed exp/softplus or the router's selection
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_PARAMS) else dtype


def _assign(model: HybridModel, tensors: dict[str, Tensor], device: str | torch.device, dtype: torch.dtype) -> None:
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = sorted(
        f"{n} (expected {expected[n]}, got {tuple(tensors[n].shape)})"
        for n in set(expected) & set(tensors)
        if tuple(tensors[n].shape) != expected[n]
    )
    _refuse_mismatch(missing, unexpected, misshaped)
    state = {n: t.to(device=device, dtype=_param_dtype(n, dtype)) for n, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)


def _refuse_mismatch(missing: list[str], unexpected: list[str], misshaped: list[str]) -> None:
    """CheckpointError listing every tensor the checkpoint lacks, has in excess, or has in another shape."""
    problems = [f"{what} tensors: {', '.join(names)}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
    if problems:
        raise CheckpointError("checkpoint does not match the config: " + "; ".join(problems))


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
        if not names:
            raise CheckpointError(f"no *.safetensors files in {path}")
    files = []
    for fname in names:
        fpath = path / fname
        if fpath.parent != path or not fpath.exists():
            raise CheckpointError(f"shard {fname!r} named by the index is missing from {path}")
        files.append(fpath)
    return files


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint, on the CPU in its stored dtype: a folder (single file or sharded with an
    index) or one ``.safetensors`` file. For tools that edit weights (training, averaging); loading a model for
    inference streams instead (``load_model``)."""
    path = Path(path)
    tensors: dict[str, Tensor] = {}
    for fpath in _shard_files(path) if path.is_dir() else [path]:
        with safe_open(str(fpath), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} is in more than one shard of {path}")
                tensors[name] = f.get_tensor(name)
    return tensors


@dataclass
class LoadStats:
    """What a streamed load moved: checkpoint bytes read, seconds, and their rate."""

    bytes_read: int
    seconds: float
    shards: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9


def _allocate(model: HybridModel, device: str | torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Uninitialised storage on the device for every parameter of a meta-built model (routed experts stacked);
    returns the parameters by checkpoint name."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.allocate_stacked(device, dtype)
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SwiGLU):
            mlp.allocate_stacked(device, dtype)
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                full = f"{mod_name}.{pname}" if mod_name else pname
                t = torch.empty(p.shape, device=device, dtype=_param_dtype(full, dtype))
                mod._parameters[pname] = nn.Parameter(t, requires_grad=p.requires_grad)
    params = dict(model.state_dict(keep_vars=True))
    assert not any(t.is_meta for t in params.values()), "a parameter kept no storage"
    return params


@torch.no_grad()
def load_weights(model: HybridModel, files: list[Path], device: str | torch.device, dtype: torch.dtype) -> LoadStats:
    """Stream the tensors of ``files`` (safetensors shards) into a meta-built ``model`` on ``device`` in ``dtype``
    (float32 for FP32_PARAMS), one tensor at a time, checking names and shapes against the model."""
    t0 = time.perf_counter()
    params = _allocate(model, device, dtype)
    expected = {n: tuple(p.shape) for n, p in params.items()}
    seen: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    nbytes = 0
    for fpath in files:
        try:
            with safe_open(str(fpath), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in seen:
                        raise CheckpointError(f"tensor {name} appears in more than one shard")
                    if name not in expected:
                        unexpected.append(name)
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        misshaped.append(f"{name} (expected {expected[name]}, got {shape})")
                        continue
                    t = f.get_tensor(name)  # read from the mapping: one tensor in host memory
                    params[name].copy_(t)
                    nbytes += t.numel() * t.element_size()
                    seen.add(name)
                    del t
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {fpath}: {e}") from None
    missing = sorted(set(expected) - seen - {m.split(" ")[0] for m in misshaped})
    _refuse_mismatch(missing, sorted(unexpected), sorted(misshaped))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    stats = LoadStats(nbytes, time.perf_counter() - t0, len(files))
    log.info("loaded %.2f GB from %d shard(s) in %.1f s (%.2f GB/s)", nbytes / 1e9, len(files), stats.seconds,
             stats.gb_per_s)
    return stats


def _seeded(name: str, shape: tuple[int, ...], std: float) -> Tensor:
    """Uniform noise of the given std from a splitmix64 hash of (name, index): identical on every machine and
    torch version, unlike torch's RNG streams."""
    n = math.prod(shape)
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")
    z = torch.arange(n, dtype=torch.int64) + seed

    def lsr(x: Tensor, s: int) -> Tensor:  # logical shift right on int64
        return (x >> s) & ((1 << (64 - s)) - 1)

    def wrap(c: int) -> int:
        return c - (1 << 64) if c >= 1 << 63 else c

    z = z + wrap(0x9E3779B97F4A7C15)
    z = (z ^ lsr(z, 30)) * wrap(0xBF58476D1CE4E5B9)
    z = (z ^ lsr(z, 27)) * wrap(0x94D049BB133111EB)
    z = z ^ lsr(z, 31)
    u = lsr(z, 40).double() / float(1 << 24)  # [0, 1)
    return ((u * 2 - 1) * (std * math.sqrt(3.0))).float().view(shape)


@functools.lru_cache(maxsize=1)
def _tiny_random_cached(config_json: str) -> dict[str, Tensor]:
    with torch.device("meta"):
        model = HybridModel(ModelConfig.model_validate_json(config_json))
    return _tiny_random_weights(model)


def _tiny_random_weights(model: HybridModel) -> dict[str, Tensor]:
    cfg = model.config
    out: dict[str, Tensor] = {}
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        if name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = torch.ones(shape)
        elif name.endswith("A_log"):
            out[name] = torch.log(1 + 15 * (_seeded(name, shape, 1.0) / math.sqrt(3.0) + 1) / 2)  # A in [1, 16]
        elif name.endswith("dt_bias"):
            out[name] = _seeded(name, shape, 0.5) - 2.0
        elif name.endswith("e_score_correction_bias"):
            out[name] = torch.zeros(shape)
        elif name.endswith("embed_tokens.weight"):
            out[name] = _seeded(name, shape, 1.0)
        elif name.endswith("conv1d.weight"):
            out[name] = _seeded(name, shape, 0.5)
        else:  # projections: std 1 / sqrt(fan_in) keeps activations at unit scale
            out[name] = _seeded(name, shape, 1.0 / math.sqrt(shape[-1]))
    assert len(out) == len(model.state_dict()) and cfg.vocab_size == model.lm_head.weight.shape[0]
    return out


def load_model(
    path_or_name: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> HybridModel:
    """A built-in name (``tiny-random``, ``tiny``) or a directory with a Kimi-Linear ``config.json`` and
    ``*.safetensors`` (single or sharded with ``model.safetensors.index.json``), streamed to ``device`` in ``dtype``
    (``load_weights``; the routed experts stacked). Returns the model in eval mode."""
    name = str(path_or_name)
    if name in BUILTIN_MODELS:
        cfg = ModelConfig.from_file(BUILTIN_DIR / f"{name}.json")
        with torch.device("meta"):
            model = HybridModel(cfg)
        if name == "tiny-random":
            # generated once per process (seconds of hashing), then copied: every engine owns its weights
            tensors = {n: t.clone() for n, t in _tiny_random_cached(cfg.model_dump_json()).items()}
            _assign(model, tensors, device, dtype)
            if torch.device(device).type == "cuda":
                model.stack_experts()
            return model.eval()
        weights = BUILTIN_DIR / "tiny.safetensors"
        if not weights.exists():
            raise CheckpointError("the built-in model 'tiny' has no weights in this install")
        files = [weights]
    else:
        path = Path(path_or_name)
        if not path.is_dir():
            raise CheckpointError(f"{name!r} is neither a built-in model {BUILTIN_MODELS} nor a directory")
        cfg = ModelConfig.from_file(path)
        with torch.device("meta"):
            model = HybridModel(cfg)
        files = _shard_files(path)
    load_weights(model, files, device, dtype)
    return model.eval()


def save_model(model: HybridModel, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (sharded with an index when over ``max_shard_bytes``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(model.config.model_dump_json(indent=2, exclude_none=True))
    # stacked experts are views of one tensor: each saved tensor gets its own storage, as safetensors requires
    state = {n: _own(t.detach().cpu()) for n, t in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for n, t in state.items():
        b = t.numel() * t.element_size()
        if shards[-1] and size + b > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += b
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _own(t: Tensor) -> Tensor:
    """t, contiguous and the sole user of its storage (a copy when it views part of a larger one)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
