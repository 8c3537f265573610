"""Decode step of the Kimi-Linear-48B-A3B shape on one GPU: the fused MoE against the gathered-copy MoE it
replaces, next to the floor set by the bytes a step must read.

The model is built on the device in bf16 with random weights (D 2304, 27 layers: 20 KDA + 7 MLA, 256 experts top
8 of width 1024 plus a shared expert, layer 1 dense of width 9216, vocabulary 163,840; 49 B parameters, ~98 GB).
The context is not prefilled: latent KV pages and KDA states hold random values (content does not change the
cost). Each case captures ``DecodeGraphs`` and times back-to-back graph replays between two CUDA events.

MoE modes: ``fused`` (the library: ``kernels.moe.fused_moe``) and ``gather`` (the routed-expert code the fused
kernels replaced, kept here as the baseline: ``index_select`` copies of the chosen experts' weights and batched
matmuls when 3 T k < E, else every expert on every token weighted by the routing).

The floor counts the bytes a step reads at least: every non-routed weight once (attention, norms, router,
shared experts, dense layer, lm_head), each routed expert chosen in the step once (its three matrices), the
latent KV of every sequence, and the KDA states read and written; divided by 4.8 TB/s (the H200's HBM peak).

The greedy check (fused MoE, graphed, against its naive twin, eager, same tokens) runs on a real-width model of
``--greedy-layers`` layers, every run routed as the float32 twin's run and fed its tokens (``PinnedRoutes``):
random router weights leave near-ties among the 256 experts that rounding differences flip (a flipped expert moves
the logits by ~10%), so unpinned runs (``--greedy-pin off``) measure routing luck rather than the layers' math
(unpinned, the library's own step can read 0.17 relative RMS from its twin on one GPU and match it on another).

    python bench/decode_48b.py --moe-tokens 1,8,2048 --greedy-steps 4 --profile --out $OUT/d.json   # on the device
    python bench/decode_48b.py --cases= --moe-tokens= --greedy-steps 0 --moe-chain 1,8 --chain-sweep  # MoE slice
    python bench/decode_48b.py --cases= --moe-tokens= --greedy-steps 0 --stamps 131072  # phases, launch boundaries
    python bench/decode_48b.py --quick --device cpu                      # tiny sizes, to check the script
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import statistics
import time
import traceback
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from kda_sessions.config import ModelConfig
from kda_sessions.kernels.kda import decode_triton as _kda_dec_mod
from kda_sessions.kernels.linear import matvec_triton as _matvec_mod
from kda_sessions.kernels.mla import decode_prep as _prep_mod
from kda_sessions.kernels.mla import paged_decode as _paged_mod
from kda_sessions.kernels.moe import add_norm_route, fused_moe, fused_moe_add_norm, moe_route, triton_moe
from kda_sessions.kernels.moe import route as _route_mod
from kda_sessions.kernels.moe.naive import naive_fused_moe
from kda_sessions.kernels.moe.pdl import use_pdl as _USE_PDL
from kda_sessions.kernels.moe.route import moe_route_triton
from kda_sessions.kernels.moe.triton_moe import (
    ADD_NORM_MAX_TOKENS,
    DIRECT_LAUNCH,
    DIRECT_MAX_TOKENS,
    MoeLaunch,
    _down_direct_kernel,
    _up_direct_kernel,
    fused_moe_direct,
    fused_moe_direct_add_norm,
    fused_moe_triton,
    launch_config,
)
from kda_sessions.kernels.norm import add_rms_norm
from kda_sessions.model import HybridModel
from kda_sessions.model.ffn import MoE
from kda_sessions.model.graphs import DecodeGraphs
from kda_sessions.model.loader import FP32_PARAMS

try:
    from kda_sessions.kernels.moe import pdl
except ImportError:  # a tree whose MoE kernels predate PDL (``--moe-chain`` times such a tree too)
    pdl = None

HBM_BYTES_PER_S = 4.8e12
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def config(quick: bool, layers: int | None = None) -> ModelConfig:
    """The 48B shape (``quick``: tiny sizes); ``layers`` keeps only the first that many layers (real width)."""
    if quick:
        D, L, H, E, k, Fw, dense, vocab = 64, 4, 2, 16, 4, 32, 128, 512
        kda, mla = [1, 2, 3], [4]
    else:
        D, L, H, E, k, Fw, dense, vocab = 2304, 27, 32, 256, 8, 1024, 9216, 163840
        mla = [4, 8, 12, 16, 20, 24, 27]
        kda = [i for i in range(1, L + 1) if i not in mla]
    if layers is not None:
        L = min(L, layers)
        kda, mla = [i for i in kda if i <= L], [i for i in mla if i <= L]
    return ModelConfig.from_dict({
        "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": D, "intermediate_size": dense,
        "moe_intermediate_size": Fw, "num_hidden_layers": L, "num_attention_heads": H, "kv_lora_rank": 512 if not quick else 32,
        "qk_nope_head_dim": 128 if not quick else 16, "qk_rope_head_dim": 64 if not quick else 8,
        "v_head_dim": 128 if not quick else 16, "num_experts": E, "num_experts_per_token": k,
        "num_shared_experts": 1, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": mla, "num_heads": H,
                               "head_dim": 128 if not quick else 16, "short_conv_kernel_size": 4},
    })


@torch.no_grad()
def build(cfg: ModelConfig, device: str) -> HybridModel:
    """Random bf16 weights allocated on the device (fp32 where the loader keeps fp32), experts stacked."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = HybridModel(cfg)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith(FP32_PARAMS):
            p.data = torch.zeros(p.shape, dtype=torch.float32, device=device)
            if name.endswith("A_log"):
                p.data.uniform_(0.0, math.log(16.0), generator=gen)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            p.fill_(1.0)
        elif name.endswith("gate.weight"):
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    model.eval()
    model.stack_experts()
    return model


# -- the baseline MoE: the routed-expert code the fused kernels replaced ------------------------------------


def _gather_routed(x: Tensor, chosen: Tensor, weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    T, k = chosen.shape
    E, F2, D = w13.shape
    Fw = F2 // 2
    if 3 * T * k < E:
        idx = chosen.reshape(-1)
        xr = x[:, None, :].expand(T, k, D).reshape(T * k, D)
        h = torch.bmm(w13.index_select(0, idx), xr[:, :, None])[..., 0]
        a = F.silu(h[:, :Fw]) * h[:, Fw:]
        y = torch.bmm(w2.index_select(0, idx), a[:, :, None])[..., 0]
        return (y.view(T, k, D) * weights[..., None]).sum(1)
    dense = torch.zeros(T, E, dtype=x.dtype, device=x.device)
    dense.scatter_(1, chosen, weights)
    h = torch.matmul(x, w13.transpose(1, 2))
    a = F.silu(h[..., :Fw]) * h[..., Fw:]
    y = torch.bmm(a, w2.transpose(1, 2))
    return (y * dense.t()[:, :, None]).sum(0)


def _gather_forward(self: MoE, x: Tensor) -> Tensor:
    scores = torch.sigmoid(x.float() @ self.gate.weight.float().t())
    _, chosen = torch.topk(scores + self.gate.e_score_correction_bias.float(), self.top_k, dim=-1)
    weights = scores.gather(-1, chosen)
    weights = (weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale).to(x.dtype)
    stacked = self._stacked_weights()
    assert stacked is not None
    out = _gather_routed(x, chosen, weights, *stacked)
    assert self.shared_experts is not None
    return out + self.shared_experts(x)


def _twin_forward(self: MoE, x: Tensor) -> Tensor:
    """The layer with its routed experts from the fused kernels' naive twin (a loop with a host sync), routed by
    the library's router as the fused layer is (see the module docstring: near-ties)."""
    chosen, weights = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                self.renormalize, self.scale)
    stacked = self._stacked_weights()
    assert stacked is not None and self.shared_experts is not None
    return naive_fused_moe(x, *stacked, chosen, weights) + self.shared_experts(x)


def _twin32_forward(self: MoE, x: Tensor) -> Tensor:
    """The twin in float32 (the bf16 weights upcast, every sum in float32, one rounding to x's dtype at the end):
    the exact math the fused kernels and the bf16 twin both approximate; routed by the library's router."""
    chosen, weights = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k,
                                self.renormalize, self.scale)
    stacked = self._stacked_weights()
    sh = self.shared_experts
    assert stacked is not None and sh is not None
    xf = x.float()
    out = naive_fused_moe(xf, stacked[0].float(), stacked[1].float(), chosen, weights.float())
    shared = (F.silu(xf @ sh.gate_proj.weight.float().t()) * (xf @ sh.up_proj.weight.float().t())) @ (
        sh.down_proj.weight.float().t())
    return (out + shared).to(x.dtype)


def _residual_apart(self: MoE, x: Tensor, a: Tensor, norm, next_norm) -> tuple[Tensor, Tensor]:
    s, h = norm.residual(x, a)
    return next_norm.residual(s, self(h))


LIBRARY_DIRECT = DIRECT_LAUNCH


def direct_from_chain(path: Path) -> object:
    """The direct tiles of the fastest up and the fastest down variant of a ``--moe-chain ... --chain-sweep`` run
    at one token (its JSON ``--out``), the library's where the library was faster."""
    runs = json.loads(path.read_text()).get("moe_chain", [])
    run = next(r for r in runs if r["T"] == 1)
    best: dict[str, tuple[float, list[int]]] = {}
    for name, v in run.items():
        if isinstance(v, dict) and "moe_us_per_layer" in v:
            kind = "library" if name == "library" else name.split(" ")[0]
            nums = [int(n) for n in re.findall(r"\d+", name)]
            if kind not in best or v["moe_us_per_layer"] < best[kind][0]:
                best[kind] = (v["moe_us_per_layer"], nums)
    cfg = LIBRARY_DIRECT
    lib = best["library"][0]
    if "up" in best and best["up"][0] < lib:
        bn, bk, w = best["up"][1]
        cfg = dataclasses.replace(cfg, BN_UP=bn, BK_UP=bk, WARPS_UP=w)
    if "down" in best and best["down"][0] < lib:
        bn, bk, w, pre, g = best["down"][1]
        cfg = dataclasses.replace(cfg, BN_DOWN=bn, BK_DOWN=bk, WARPS_DOWN=w, PRE_DOWN=pre, GROUP_DOWN=g)
    return cfg


ALT_DIRECT: list = []


PDL_ABLATIONS = {
    "fused-nomatvecpdl": (_matvec_mod, "the Triton matvecs (and W_uv's) without PDL"),
    "fused-nokdapdl": (_kda_dec_mod, "both KDA decode launches without PDL"),
    "fused-noprep-pdl": (_prep_mod, "MLA's decode prep without PDL"),
}
"""Modes that turn one PDL use of the decode step off (the others as the library has them)."""


def _flag_modes() -> dict[str, list[tuple[types.ModuleType, str, object]]]:
    import kda_sessions.model.ffn as ffn_mod

    dense = (ffn_mod, "DENSE_DIRECT", False)
    uv = [(_matvec_mod, "HEAD_ROWS", 1), (_paged_mod, "COMBINE_EARLY_TRIGGER", False)]
    shared = (triton_moe, "FIXED_FIRST", False)
    return {"old-dense": [dense], "old-uv": uv, "old-shared": [shared], "old-all": [dense, *uv, shared],
            **{f"kda-bv{bv}w{w}": [(_kda_dec_mod, "decode_launch_config",
                                    lambda N, V, bv=bv, w=w: (bv, w) if N < 8 else (128, 4))]
               for bv, w in ((64, 8), (128, 8), (32, 4), (32, 2))},
            "old-route": [(_route_mod, "SELECT_LANES", False)]}


FLAG_MODES = _flag_modes()
"""Modes that turn a library option off (an A/B of an option against the step without it): ``old-dense`` the
dense FFN in cuBLAS rather than as a one-expert MoE in the direct kernels (``ffn.DENSE_DIRECT``), ``old-uv``
MLA's W_uv matvec on one row a program (``matvec_triton.HEAD_ROWS``) and the MLA merge letting W_uv's launch start
only after its wait (``paged_decode.COMBINE_EARLY_TRIGGER``), ``old-shared`` the MoE up kernel reading the shared
expert's rows after its PDL wait with the others (``triton_moe.FIXED_FIRST``), ``old-all`` all three;
``kda-bvBwW`` the KDA decode kernel below 8 sequences on V blocks of B and W warps (``decode_launch_config``);
``old-route`` the router's one-token selection by block reductions rather than warp shuffles (``route.SELECT_LANES``).
``--greedy-modes`` runs the greedy check under them."""


def _set_ablation(mode: str) -> None:
    for patches in FLAG_MODES.values():  # every switch as the library has it, then the mode's
        for mod, attr, _ in patches:
            setattr(mod, attr, _SKIP_ORIGINALS.setdefault((mod.__name__, attr), getattr(mod, attr)))
    for mod, attr, value in FLAG_MODES.get(mode, []):
        setattr(mod, attr, value)
    for name, (mod, _) in PDL_ABLATIONS.items():
        mod.use_pdl = (lambda device: False) if mode == name else _USE_PDL
    for patches in SKIPS.values():  # every patched name as the library has it, then the mode's patches
        for mod, attr, _ in patches:
            setattr(mod, attr, _SKIP_ORIGINALS.setdefault((mod.__name__, attr), getattr(mod, attr)))
    for mod, attr, value in SKIPS.get(mode, []):
        setattr(mod, attr, value)


# -- skip modes: a class of the step's launches left out, to read its share of the step off the replay time -------

_FIXED: dict[str, Tensor] = {}
"""Router outputs of the skip-router mode (valid expert ids), made outside any capture by ``prepare_skips``."""
_SKIP_ORIGINALS: dict[tuple[str, str], object] = {}


def prepare_skips(model: HybridModel) -> None:
    """The fixed router outputs skip-router hands the MoE kernels: experts 0..k-1 and the shared one, weight 1/k."""
    for m in model.modules():
        if isinstance(m, MoE):
            fused = m._fused_weights()
            if fused is None or fused[2] is None:
                continue
            k = m.top_k
            dev = m.gate.weight.device
            _FIXED["chosen"] = torch.tensor([[*range(k), fused[2]]], dtype=torch.int64, device=dev)
            _FIXED["weights"] = torch.full((1, k + 1), 1.0 / k, dtype=m.gate.weight.dtype, device=dev)
            return


def _skip_route(x: Tensor, res: Tensor, *args: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n = x.shape[0]
    return x, res, _FIXED["chosen"].expand(n, -1), _FIXED["weights"].expand(n, -1)


def _skip_moe(h: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor, s: Tensor, *args: object
              ) -> tuple[Tensor, Tensor]:
    return s, h


def _skip_kda(qkv: Tensor, raw: Tensor, b: Tensor, *args: object, **kw: object) -> Tensor:
    state = args[5]
    assert isinstance(state, Tensor)
    return qkv.new_empty(b.shape[0], b.shape[1], state.shape[-1])


def _skip_linear(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _skip_head_linear(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[1])


def _skip_prep(y: Tensor, w_kv_b: Tensor, norm_w: Tensor, eps: float, kv_pages: Tensor, kv_rows: Tensor, H: int,
               dn: int) -> tuple[Tensor, Tensor]:
    r, dr = w_kv_b.shape[1], kv_pages.shape[-1] - w_kv_b.shape[1]
    return y.new_empty(y.shape[0], H, r), y.new_empty(y.shape[0], H, dr)


def _skip_paged(q_lat: Tensor, *args: object) -> Tensor:
    return torch.empty_like(q_lat)


def _skips() -> dict[str, list[tuple[types.ModuleType, str, object]]]:
    import kda_sessions.model.ffn as ffn_mod
    import kda_sessions.model.kda as kda_mod
    import kda_sessions.model.mla as mla_mod

    return {
        "skip-router": [(ffn_mod, "add_norm_route", _skip_route)],
        "skip-moe": [(ffn_mod, "fused_moe_add_norm", _skip_moe)],
        "skip-kda": [(kda_mod, "kda_decode", _skip_kda)],
        "skip-matvec": [(kda_mod, "linear", _skip_linear), (mla_mod, "linear", _skip_linear),
                        (mla_mod, "head_linear", _skip_head_linear)],
        "skip-mla": [(mla_mod, "mla_decode_prep", _skip_prep), (mla_mod, "mla_decode_paged", _skip_paged)],
    }


SKIPS = _skips()
"""Modes that leave one class of the step's launches out (their outputs: uninitialised buffers, or the inputs
passed through): the step's replay time less that of such a mode is what the class costs the step, waits and
overlaps included, which a profile's per-kernel times (PDL waits inside them) cannot tell. Timing only: the
logits are garbage."""


def set_moe_mode(model: HybridModel, mode: str) -> None:
    """fused (the library), fused-nopdl (the library with ``kernels.moe.pdl.ENABLED`` off: no programmatic
    dependent launch), the ``PDL_ABLATIONS`` (one PDL use off), fused-alt (the library with
    ``triton_moe.DIRECT_LAUNCH`` set to ``--alt-direct-from``'s tiles), gather (the replaced code), twin (the naive
    twin, bf16; not capturable) or twin32 (the twin in float32). A mode may end in ``@N`` (``fused@2``): the same
    mode run again in one case, for an A/B that alternates (a case keys its results by mode)."""
    mode = mode.split("@")[0]
    _set_ablation(mode)
    if pdl is not None:
        pdl.ENABLED = mode != "fused-nopdl"
    triton_moe.DIRECT_LAUNCH = ALT_DIRECT[0] if mode == "fused-alt" and ALT_DIRECT else LIBRARY_DIRECT
    forwards = {"gather": _gather_forward, "twin": _twin_forward, "twin32": _twin32_forward}
    for m in model.modules():
        if isinstance(m, MoE):
            if mode in forwards:
                m.forward = types.MethodType(forwards[mode], m)  # type: ignore[method-assign]
                # the model calls residual_block (the norms inside the MoE launches): the norms apart, forward
                m.residual_block = types.MethodType(_residual_apart, m)  # type: ignore[method-assign]
            else:
                for name in ("forward", "residual_block"):
                    m.__dict__.pop(name, None)


# -- bytes a step reads -------------------------------------------------------------------------------------


def expected_distinct(E: int, k: int, n: int) -> float:
    """Expected distinct experts among n tokens each choosing k of E uniformly."""
    return E * (1 - (1 - k / E) ** n)


def floor_bytes(model: HybridModel, batch: int, L: int) -> dict:
    cfg = model.config
    routed = 0
    for m in model.modules():
        if isinstance(m, MoE):
            for ex in m.experts:
                routed += sum(p.numel() * p.element_size() for p in ex.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    dense_w = total - routed - embed.numel() * embed.element_size()  # an embedding lookup reads N rows only
    n_moe = sum(isinstance(m, MoE) for m in model.modules())
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    experts = n_moe * expected_distinct(cfg.num_experts, cfg.num_experts_per_token, batch) * per_expert
    kv = len(cfg.mla_layer_ids) * batch * (L + 1) * cfg.latent_dim * 2
    H, K = cfg.kda_heads, cfg.kda_head_dim
    states = len(cfg.kda_layer_ids) * batch * H * K * K * 4 * 2
    b = dense_w + experts + kv + states
    return {"bytes": int(b), "non_routed_weights": int(dense_w), "routed_experts": int(experts), "kv": kv,
            "kda_states": states, "floor_ms": b / HBM_BYTES_PER_S * 1e3}


# -- timing -------------------------------------------------------------------------------------------------


def replay_ms(graphs: DecodeGraphs, batch: int, pages: int, reps: int) -> float | None:
    g = graphs.graph_for(batch, pages)
    if g is None:
        return None
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / reps


def decode_case(model: HybridModel, batch: int, L: int, modes: list[str], reps: int, device: str) -> dict:
    cfg = model.config
    P = 64
    pages = -(-(L + 1) // P)
    if device == "cuda":
        torch.cuda.empty_cache()
    pools = model.allocate_pools(batch, batch * pages, P)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for t in pools.kv:
            t.normal_(0.0, 1.0, generator=gen)
        for t in pools.kda:
            t.normal_(0.0, 0.01, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(2)).tolist()
    table = [list(range(n * pages, (n + 1) * pages)) for n in range(batch)]
    out: dict = {"batch": batch, "context": L, **floor_bytes(model, batch, L)}
    saved = [t.clone() for t in pools.kda + pools.conv]
    logits: dict[str, Tensor] = {}
    for mode in modes:
        for t, v in zip(pools.kda + pools.conv, saved):
            t.copy_(v)
        set_moe_mode(model, mode)
        graphs = DecodeGraphs(model, pools, max_batch=max(batch, 1))
        t0 = time.perf_counter()
        logits[mode] = graphs.run(ids, list(range(batch)), [L + 1] * batch, table).float().clone()
        first_s = time.perf_counter() - t0
        r: dict = {"first_call_s": round(first_s, 2), "captured": graphs.captures, "capture_error": graphs.capture_error}
        if device == "cuda":
            ms = replay_ms(graphs, batch, pages, reps)
            r["replay_ms"] = None if ms is None else round(ms, 4)
            times = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                graphs.run(ids, list(range(batch)), [L + 1] * batch, table)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t1) * 1e3)
            r["run_ms_median"] = round(statistics.median(times), 4)
            if ms is not None:
                r["floor_over_replay"] = round(out["floor_ms"] / ms, 3)
        out[mode] = r
        del graphs
    set_moe_mode(model, "fused")
    if "fused" in logits and "gather" in logits:
        a, b = logits["fused"], logits["gather"]
        out["fused_vs_gather_logits_rel_rms"] = float((a - b).norm() / b.norm())
        out["fused_vs_gather_argmax_agree"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    return out


SWEEP_SMALL = [MoeLaunch(16, 64, 128, 4, 4), MoeLaunch(16, 32, 128, 4, 4), MoeLaunch(16, 64, 128, 8, 4),
               MoeLaunch(16, 32, 64, 4, 6), MoeLaunch(16, 64, 256, 8, 3)]
SWEEP_LARGE = [MoeLaunch(64, 256, 64, 8, 2), MoeLaunch(64, 256, 32, 8, 4), MoeLaunch(64, 256, 32, 8, 5),
               MoeLaunch(128, 256, 32, 8, 3), MoeLaunch(128, 256, 64, 8, 2), MoeLaunch(128, 128, 64, 8, 4),
               MoeLaunch(128, 128, 64, 8, 3), MoeLaunch(64, 128, 64, 4, 4), MoeLaunch(64, 128, 64, 8, 5),
               MoeLaunch(64, 256, 64, 8, 3)]


def graph_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    e1.synchronize()
    return round(e0.elapsed_time(e1) / reps * 1e3, 2)


SWEEP_DIRECT_UP = [(4, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 1024, 4), (4, 512, 2), (8, 256, 4), (8, 512, 8),
                   (16, 256, 8), (2, 512, 2), (8, 256, 2), (16, 128, 4), (4, 1024, 8)]
SWEEP_DIRECT_DOWN = [(4, 1024, 4), (2, 1024, 4), (2, 1024, 8), (4, 1024, 8), (1, 1024, 4), (2, 1024, 2), (2, 512, 2),
                     (4, 512, 4), (8, 256, 4), (8, 512, 8), (8, 1024, 8), (16, 256, 4)]


def direct_stage_us(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, wts: Tensor, reps: int) -> dict:
    """The direct (decode) kernels one at a time under the tiles of ``SWEEP_DIRECT_UP`` / ``_DOWN``: us and
    TB/s of the expert bytes each reads (the chosen experts' w13 for up, w2 for down)."""
    T, k = chosen.shape
    D, Fw = x.shape[1], w2.shape[2]
    flat = chosen.reshape(-1).contiguous()
    rw = wts.reshape(-1).contiguous()
    act = torch.randn(T * k, Fw, device=x.device).to(x.dtype)
    y = torch.empty_like(x)
    distinct = int(torch.unique(chosen).numel())
    out: dict = {}
    for bn, bk, nw in SWEEP_DIRECT_UP:
        us = graph_us(lambda bn=bn, bk=bk, nw=nw: _up_direct_kernel[(T * k, triton.cdiv(Fw, bn))](
            x, w13, act, flat, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            D=D, Fw=Fw, TOP_K=k, BN=bn, BK=bk, PDL=False, num_warps=nw), reps)
        out[f"up {bn}/{bk}/w{nw}"] = [us, round(distinct * w13[0].numel() * 2 / us / 1e6, 2)]
    for bn, bk, nw in SWEEP_DIRECT_DOWN:
        us = graph_us(lambda bn=bn, bk=bk, nw=nw: _down_direct_kernel[(T, triton.cdiv(D, bn))](
            act, w2, y, flat, rw, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), y, y, y, y, flat, T, 0.0,
            D=D, Fw=Fw, TOP_K=k, BN=bn, BK=bk, NORM=False, BD=triton.next_power_of_2(D), PRE=0, GROUP=k, PDL=False,
            num_warps=nw), reps)
        out[f"down {bn}/{bk}/w{nw}"] = [us, round(distinct * w2[0].numel() * 2 / us / 1e6, 2)]
    return out


CHAIN_UP = [(1, 1024, 1), (1, 512, 1), (2, 1024, 2), (2, 512, 4), (4, 512, 4), (2, 256, 2), (4, 256, 4)]
CHAIN_DOWN = [(2, 512, 2, 2, 1), (2, 512, 2, 2, 3), (2, 512, 2, 2, 9), (2, 512, 2, 0, 2), (2, 1024, 2, 2, 2),
              (1, 1024, 2, 2, 9), (1, 512, 2, 2, 9), (1, 1024, 1, 2, 9), (2, 512, 4, 2, 9), (2, 1024, 4, 2, 9),
              (4, 512, 4, 2, 9), (4, 256, 4, 2, 9), (2, 512, 4, 2, 3)]


def moe_chain_case(T: int, reps: int, sweep: bool, layers: int = 26, groups: int = 4) -> dict:
    """The decode step's MoE slice alone at the 48B shape, as a step runs it: ``layers`` times a stand-in for the
    attention's output projection (a cuBLAS matvec of a [2304, 4096] weight, one per layer), then the library's
    MoE block (router with the add and norm, up, down with the add and norm at one token), in one CUDA graph.
    Routers random per layer, experts (the shared one stacked last) from ``groups`` stacked copies in turn (a
    layer's experts are not in L2 from the layer before). Per layer: the chain's us over ``layers``, and minus the
    matvecs alone (the MoE block with its launch gaps). Variants: the library with and without PDL, and with
    ``sweep`` other direct tiles (``CHAIN_UP``: BN/BK/warps of up; ``CHAIN_DOWN``: of down, with PRE_DOWN)."""
    D, Fw, E, k, A = 2304, 1024, 256, 8, 4096
    gen = torch.Generator(device="cuda").manual_seed(T)

    def randn(*shape: int, scale: float) -> Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * scale)

    experts = [(randn(E + 1, 2 * Fw, D, scale=D**-0.5), randn(E + 1, D, Fw, scale=Fw**-0.5)) for _ in range(groups)]
    gates = [randn(E, D, scale=0.02) for _ in range(layers)]
    bias = torch.zeros(E, device="cuda")
    wo = [randn(D, A, scale=A**-0.5) for _ in range(layers)]
    a = randn(T, A, scale=1.0)
    s0 = randn(T, D, scale=1.0)
    nw = torch.ones(D, device="cuda", dtype=torch.bfloat16)

    def chain(cfg=None, moe: bool = True) -> tuple[Tensor, Tensor]:
        s, h = s0, s0
        for i in range(layers):
            o = a @ wo[i].t()  # [T, D]
            if not moe:
                continue
            s, h, chosen, w = add_norm_route(o, s, nw, 1e-6, gates[i], bias, k, True, 2.446, E)
            w13, w2 = experts[i % groups]
            if cfg is None:
                s, h = fused_moe_add_norm(h, w13, w2, chosen, w, s, nw, 1e-6)
            elif T <= ADD_NORM_MAX_TOKENS:
                s, h = fused_moe_direct_add_norm(h, w13, w2, chosen, w, s, nw, 1e-6, cfg)
            else:
                s, h = add_rms_norm(s, fused_moe_direct(h, w13, w2, chosen, w, cfg), nw, 1e-6)
        return s, h

    variants: list[tuple[str, bool, object]] = [("library", True, None)]
    if pdl is not None:
        variants.insert(0, ("library, no PDL", False, None))
        if sweep:
            variants += [(f"up {bn}/{bk}/w{nw_}", True, dataclasses.replace(DIRECT_LAUNCH, BN_UP=bn, BK_UP=bk,
                                                                            WARPS_UP=nw_)) for bn, bk, nw_ in CHAIN_UP]
            variants += [(f"down {bn}/{bk}/w{nw_}/pre{pre}/g{g}", True, dataclasses.replace(
                DIRECT_LAUNCH, BN_DOWN=bn, BK_DOWN=bk, WARPS_DOWN=nw_, PRE_DOWN=pre, GROUP_DOWN=g))
                for bn, bk, nw_, pre, g in CHAIN_DOWN]
    out: dict = {"T": T, "layers": layers, "pdl_module": pdl is not None}
    matvec_us = graph_us(lambda: chain(moe=False), reps)
    out["matvecs_only_us_per_layer"] = round(matvec_us / layers, 2)
    for name, on, cfg in variants:
        if pdl is not None:
            pdl.ENABLED = on
        try:
            us = graph_us(lambda cfg=cfg: chain(cfg), reps)
            out[name] = {"us_per_layer": round(us / layers, 2), "moe_us_per_layer": round((us - matvec_us) / layers, 2)}
        except Exception as err:  # a variant that fails to compile or capture: recorded, the others still run
            out[name] = f"{type(err).__name__}: {err}"[:300]
        log(f"chain T={T} {name}: {out[name]}")
    if pdl is not None:
        pdl.ENABLED = True
    ref = chain(None)[1].float()
    for name, on, cfg in variants:
        if name != "library" and isinstance(out.get(name), dict):
            if pdl is not None:
                pdl.ENABLED = on
            out[name]["h_rel_rms_vs_library"] = float((chain(cfg)[1].float() - ref).norm() / ref.norm())
    from torch.profiler import ProfilerActivity, profile

    if pdl is not None:
        pdl.ENABLED = False  # each kernel's own time (with PDL it would include its wait for the one before)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chain(None)
        torch.cuda.synchronize()
    if pdl is not None:
        pdl.ENABLED = True
    out["eager_kernels_calls_us"] = {name[:60]: [n, round(t / n, 2)] for name, n, t in device_kernels(prof)}
    return out


SWEEP_DOWN = [(256, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3), (256, 128, 8, 2),
              (64, 128, 4, 4), (128, 64, 4, 6), (256, 64, 8, 4)]


def sweep_tile(fn, reps: int) -> list | str:
    """[graph replay us, the grouped kernels' us (up, down) from one profiled call], or the error's name (a tile
    over the device's shared memory fails alone)."""
    try:
        us = graph_us(fn, reps)
        kern = profile_kernels_us(fn)
    except Exception as e:
        torch.cuda.synchronize()
        return f"{type(e).__name__}"
    return [us] + [v for name, v in kern.items() if "_up_kernel" in name or "_down_kernel" in name]


def device_kernels(prof) -> list[tuple[str, int, float]]:
    """A finished ``torch.profiler.profile``'s kernels: (name, calls, device us in all), longest first."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            rows.append((ev.key, ev.count, t))
    return sorted(rows, key=lambda r: -r[2])


def profile_kernels_us(fn) -> dict:
    """One eager call of ``fn`` under the profiler: {kernel name (60 chars): device us}."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {name[:60]: round(t, 1) for name, _, t in device_kernels(prof)}


def moe_layer_case(model: HybridModel, T: int, reps: int, sweep: bool) -> dict:
    """One MoE layer alone, its shared expert stacked as the always-on 257th: the router (the library's, and the
    two-kernel one it uses above ``ROUTE_DECODE_MAX_TOKENS``), the fused kernels (direct up to
    ``DIRECT_MAX_TOKENS`` tokens, and the grouped ones), the gathered-copy baseline (routed experts only), and the
    floor; with ``sweep`` also other tile sizes (grouped: ``MoeLaunch``; direct: each kernel alone)."""
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    fused_w = moe._fused_weights()
    assert fused_w is not None and fused_w[2] is not None
    w13, w2, shared = fused_w
    E, k = shared, moe.top_k
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, w13.shape[2], device="cuda", generator=gen).bfloat16()
    chosen = torch.argsort(torch.rand(T, E, device="cuda", generator=gen), dim=1)[:, :k]
    chosen = torch.cat([chosen, chosen.new_full((T, 1), shared)], 1)  # [T, k + 1]
    wts = torch.rand(T, k + 1, device="cuda", generator=gen).bfloat16()
    g, b = moe.gate.weight, moe.gate.e_score_correction_bias
    res: dict = {"T": T, "launch": "direct" if T <= DIRECT_MAX_TOKENS else str(launch_config(T * (k + 1)))}
    res["route_us"] = graph_us(lambda: moe_route(x, g, b, k, True, moe.scale, shared), reps)
    res["route_two_kernels_us"] = graph_us(lambda: moe_route_triton(x, g, b, k, True, moe.scale, shared), reps)
    res["fused_us"] = graph_us(lambda: fused_moe(x, w13, w2, chosen, wts), reps)
    res["grouped_us"] = graph_us(lambda: fused_moe_triton(x, w13, w2, chosen, wts, direct=False), reps)
    res["grouped_pointers_us"] = graph_us(
        lambda: fused_moe_triton(x, w13, w2, chosen, wts, direct=False, tma=False), reps)
    if T > DIRECT_MAX_TOKENS:  # the TMA kernels a program a tile rather than in persistent loops
        triton_moe.PERSISTENT_PROGRAMS = 1 << 30
        try:
            res["grouped_a_program_a_tile"] = sweep_tile(
                lambda: fused_moe_triton(x, w13, w2, chosen, wts, direct=False), reps)
        finally:
            triton_moe.PERSISTENT_PROGRAMS = None
    if T <= 32:
        res["direct_us"] = graph_us(lambda: fused_moe_triton(x, w13, w2, chosen, wts, direct=True), reps)
    res["gather_us"] = graph_us(lambda: _gather_routed(x, chosen[:, :k], wts[:, :k], w13[:E], w2[:E]), reps)
    if sweep:
        for c in SWEEP_SMALL if T * k <= 256 else SWEEP_LARGE:
            name = f"sweep {c.BM}/{c.BN}/{c.BK}/w{c.num_warps}/s{c.num_stages}"
            res[name] = sweep_tile(lambda c=c: fused_moe_triton(x, w13, w2, chosen, wts, c), reps)
        if T * k > 256:  # the down kernel's own tiles under the library's up tile (BN/BK/warps/stages)
            base = launch_config(T * (k + 1), 2, None, E + 1)
            for d in SWEEP_DOWN:
                c = dataclasses.replace(base, down=d)
                res["sweep down {}/{}/w{}/s{}".format(*d)] = sweep_tile(
                    lambda c=c: fused_moe_triton(x, w13, w2, chosen, wts, c), reps)
        if T <= 32:
            res["direct_stages us, TB/s"] = direct_stage_us(x, w13, w2, chosen, wts, reps)
    if T > DIRECT_MAX_TOKENS:  # the grouped call kernel by kernel (us)
        res["grouped_kernels_us"] = profile_kernels_us(lambda: fused_moe(x, w13, w2, chosen, wts))
    distinct = int(torch.unique(chosen).numel())
    b = distinct * (w13[0].numel() + w2[0].numel()) * 2
    res["distinct_experts"] = distinct
    res["floor_us"] = round(b / HBM_BYTES_PER_S * 1e6, 2)
    ref = _gather_routed(x.float(), chosen, wts.float(), w13.float(), w2.float())
    res["fused_rel_rms_vs_fp32"] = float((fused_moe(x, w13, w2, chosen, wts).float() - ref).norm() / ref.norm())
    res["fused_TB_per_s"] = round(b / res["fused_us"] / 1e6, 2)
    flops = 2 * T * (k + 1) * (w13[0].numel() + w2[0].numel())  # up (w1 and w3) and down, every pair
    res["fused_TFLOP_per_s"] = round(flops / res["fused_us"] / 1e6, 1)
    return res


class PinnedRoutes:
    """The routers' choices of one run (``record``), handed to the next runs' routers step by step (``pin``), so
    that a greedy check compares the layers' arithmetic rather than which near-ties flipped: with random router
    weights the 8th and 9th of 256 experts are often within rounding of each other, and one flipped expert moves a
    token's logits by ~10% (``--greedy-pin off`` shows it). Wraps ``moe_route`` (the twins' and the prefill
    path's) and ``add_norm_route`` (the graphed decode's) where the model and this script call them; pinning
    copies into the routers' outputs, so it is captured in a CUDA graph and replays with the buffers the host
    fills before each step. ``flips``: rows whose own choice differed from the pinned one, over the pinned steps."""

    def __init__(self, model: HybridModel) -> None:
        import kda_sessions.model.ffn as ffn_mod

        self.n = sum(isinstance(m, MoE) for m in model.modules())
        self.mode = "off"
        self.calls = 0
        self.recorded: list[tuple[Tensor, Tensor]] = []
        self.pins: list[tuple[Tensor, Tensor, Tensor]] = []  # per layer: chosen, weights, the router's own choice
        self.flips = 0
        self._patched = [(ffn_mod, "moe_route", ffn_mod.moe_route), (ffn_mod, "add_norm_route", ffn_mod.add_norm_route),
                         (globals(), "moe_route", moe_route)]
        route, add_norm = ffn_mod.moe_route, ffn_mod.add_norm_route

        def wrapped_route(x, gate, bias, top_k, *args, **kwargs):
            chosen, weights = route(x, gate, bias, top_k, *args, **kwargs)
            return self._apply(chosen, weights, top_k)

        def wrapped_add_norm(x, a, nw, eps, gate, bias, top_k, *args, **kwargs):
            s_, h, chosen, weights = add_norm(x, a, nw, eps, gate, bias, top_k, *args, **kwargs)
            return (s_, h, *self._apply(chosen, weights, top_k))

        ffn_mod.moe_route, ffn_mod.add_norm_route = wrapped_route, wrapped_add_norm
        globals()["moe_route"] = wrapped_route

    def close(self) -> None:
        for where, name, fn in self._patched:
            if isinstance(where, dict):
                where[name] = fn
            else:
                setattr(where, name, fn)

    def _apply(self, chosen: Tensor, weights: Tensor, k: int) -> tuple[Tensor, Tensor]:
        j = self.calls % self.n
        self.calls += 1
        if self.mode == "record":
            self.recorded.append((chosen[:, :k].clone(), weights[:, :k].clone()))
        elif self.mode == "pin":
            pc, pw, own = self.pins[j]
            own.copy_(chosen[:, :k])
            chosen[:, :k].copy_(pc)
            weights[:, :k].copy_(pw.to(weights.dtype))
        return chosen, weights

    def start(self, mode: str) -> None:
        self.mode, self.calls = mode, 0
        if mode == "record":
            self.recorded = []
        if mode == "pin" and not self.pins:
            self.pins = [(c.clone(), w.clone(), c.clone()) for c, w in self.recorded[: self.n]]

    def before_step(self, i: int) -> None:
        """Fill the pins with step i's recorded choices."""
        if self.mode == "pin":
            for j, (pc, pw, _) in enumerate(self.pins):
                c, w = self.recorded[i * self.n + j]
                pc.copy_(c)
                pw.copy_(w)

    def after_step(self) -> None:
        if self.mode == "pin":
            for pc, _, own in self.pins:
                self.flips += int((own.sort(-1).values != pc.sort(-1).values).any(-1).sum())


def greedy_case(model: HybridModel, L: int, steps: int, device: str, graphed: tuple[str, ...] = ("fused",),
                pin: bool = True) -> dict:
    """Batch 1 at context L: ``steps`` greedy decode steps with the fused MoE (graph replays), with its naive
    twin (eager, bf16) and with the twin in float32, from the same states; the tokens of each and the first
    step's logits difference (relative RMS) of each pair. ``graphed``: the graph-replayed modes (``fused`` and
    others, e.g. ``new``), each compared with both twins. ``pin``: every run routed as the float32 twin's run
    (``PinnedRoutes``; it runs first), its greedy tokens fed to the others' steps too, so one flipped near-tie in
    one run cannot send the runs down different tokens; ``route_flips`` counts the rows whose own router chose
    otherwise."""
    P = 64
    pages = -(-(L + steps + 1) // P)
    pools = model.allocate_pools(1, pages, P)
    gen = torch.Generator(device=device).manual_seed(3)
    with torch.no_grad():
        for t in pools.kv:
            t.normal_(0.0, 1.0, generator=gen)
        for t in pools.kda:
            t.normal_(0.0, 0.01, generator=gen)
    saved = [t.clone() for t in pools.kda + pools.conv + pools.kv]
    table = [list(range(pages))]
    out: dict = {"context": L, "steps": steps, "pinned_routes": pin}
    first: dict[str, Tensor] = {}
    pins = PinnedRoutes(model) if pin else None
    feed: list[int] = []
    try:
        for mode in ("twin32", *graphed, "twin"):
            for t, v in zip(pools.kda + pools.conv + pools.kv, saved):
                t.copy_(v)
            set_moe_mode(model, mode)
            if pins is not None:
                pins.start("record" if mode == "twin32" else "pin")
            graphs = DecodeGraphs(model, pools, max_batch=1, enabled=mode not in ("twin", "twin32"))
            tok, toks = 1, []
            for i in range(steps):
                if pins is not None:
                    pins.before_step(i)
                logits = graphs.run([tok], [0], [L + 1 + i], table)
                if pins is not None:
                    pins.after_step()
                if i == 0:
                    first[mode] = logits.float().clone()
                toks.append(int(logits[0].argmax()))
                tok = feed[i] if pins is not None and mode != "twin32" else toks[-1]
            if mode == "twin32":
                feed = toks
            out[f"{mode}_tokens"] = toks
            del graphs
    finally:
        if pins is not None:
            pins.close()
    set_moe_mode(model, "fused")
    if pins is not None:
        out["route_flips"] = pins.flips
    out["same_tokens"] = all(out[f"{g}_tokens"] == out["twin_tokens"] for g in graphed)
    for g in graphed:
        out[f"same_tokens_{g}_twin32"] = out[f"{g}_tokens"] == out["twin32_tokens"]
    out["same_tokens_twin_twin32"] = out["twin_tokens"] == out["twin32_tokens"]
    for a, b in [*((g, t) for g in graphed for t in ("twin", "twin32")), ("twin", "twin32")]:
        out[f"first_logits_rel_rms_{a}_{b}"] = float((first[a] - first[b]).norm() / first[b].norm())
    return out


def _profiled_steps(model: HybridModel, L: int, graphed: bool, n: int) -> tuple[DecodeGraphs, tuple, object]:
    """n decode steps (batch 1, context L; eager or graph replays, after three untimed) under the torch profiler,
    each synchronised: (the DecodeGraphs, the step's ``run`` arguments, the profiler)."""
    P = 64
    pages = -(-(L + 1) // P)
    pools = model.allocate_pools(1, pages, P)
    graphs = DecodeGraphs(model, pools, max_batch=1, enabled=graphed)
    args = ([1], [0], [L + 1], [list(range(pages))])
    for _ in range(3):
        graphs.run(*args)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graphs.run(*args)
            torch.cuda.synchronize()
    return graphs, args, prof


def profile_case(model: HybridModel, L: int, device: str, top: int = 40, graphed: bool = False) -> dict:
    """The decode step (batch 1, context L) under the torch profiler, eager or (``graphed``) as CUDA-graph
    replays: kernel launches and device time per step, the top kernels by device time, and for graph replays the
    step's wall time between CUDA events (its excess over the summed kernel time is launch gaps)."""
    n = 5
    graphs, args, prof = _profiled_steps(model, L, graphed, n)
    rows, kernels = [], []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            row = {"name": e.key[:120], "calls_per_step": e.count / n, "us_per_step": round(t / n, 1)}
            rows.append(row)
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:  # a kernel, not an op around one
                kernels.append(row)
    rows = kernels or rows
    rows.sort(key=lambda r: -r["us_per_step"])
    out = {"context": L, "graphed": graphed, "kernels_per_step": sum(r["calls_per_step"] for r in rows),
           "device_us_per_step": round(sum(r["us_per_step"] for r in rows), 1), "top": rows[:top]}
    if graphed:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.run(*args)
        end.record()
        torch.cuda.synchronize()
        out["step_us_wall"] = round(start.elapsed_time(end) * 1e3 / 20, 1)
    del graphs
    return out


KERNEL_CLASSES = [  # (class, pattern of the kernel's name), first match wins
    ("router", r"_route_decode_kernel"), ("moe_up", r"_up_direct_kernel"), ("moe_down", r"_down_direct_kernel"),
    ("kda_decode", r"_decode_kernel"), ("matvec", r"_matvec_kernel"),
    ("cublas", r"gemv|gemm|cublas|sm90_xmma|nvjet|splitK"),  # the lm_head; the dense FFN where it runs there
    ("mla_split", r"_split_kernel"), ("mla_combine", r"combine"), ("mla_prep", r"prep"), ("norm", r"norm"),
    ("embedding", r"index|embedding"), ("elementwise", r"elementwise|copy|fill|Memset"),
]


def _kernel_class(name: str) -> str:
    for cls, pat in KERNEL_CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def timeline_case(model: HybridModel, L: int, device: str, keep: int = 40) -> dict:
    """One graph replay of the decode step (batch 1, context L) under the torch profiler, kernel by kernel in
    launch order: each kernel's start, end and what it adds to the step (its end past the latest end before it;
    with PDL a kernel starts before the one before ends, so its duration includes that wait). Summed by class
    (``KERNEL_CLASSES``): where the step's time goes, waits and tails included, to set against each class's
    bytes. ``keep``: the first that many kernels listed one by one."""
    n = 5
    graphs, _, prof = _profiled_steps(model, L, True, n)
    ev = sorted((e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith("Memcpy")),  # the inputs' copy before each replay is not the step's
                key=lambda e: e.time_range.start)
    per = len(ev) // n
    steps = []
    for i in range(n):
        one = ev[i * per:(i + 1) * per]
        t0, last = one[0].time_range.start, one[0].time_range.start
        rows = []
        for e in one:
            end = e.time_range.end
            rows.append({"name": e.name[:80], "class": _kernel_class(e.name), "start_us": round(e.time_range.start - t0, 2),
                         "dur_us": round(end - e.time_range.start, 2), "adds_us": round(max(0.0, end - last), 2)})
            last = max(last, end)
        steps.append(rows)
    by_class: dict[str, list[float]] = {}
    for rows in steps:
        sums: dict[str, float] = {}
        for r in rows:
            sums[r["class"]] = sums.get(r["class"], 0.0) + r["adds_us"]
        for c, v in sums.items():
            by_class.setdefault(c, []).append(v)
    spans = [rows[-1]["start_us"] + rows[-1]["dur_us"] for rows in steps]
    counts: dict[str, int] = {}
    for r in steps[-1]:
        counts[r["class"]] = counts.get(r["class"], 0) + 1
    del graphs
    return {"context": L, "kernels_per_step": per, "span_us_median": round(statistics.median(spans), 1),
            "adds_us_median_by_class": {c: round(statistics.median(v), 1) for c, v in
                                        sorted(by_class.items(), key=lambda kv: -statistics.median(kv[1]))},
            "launches_by_class": counts, "first_kernels": steps[-1][:keep], "last_kernels": steps[-1][-8:]}


STAMP_PHASES = {
    "kda_decode": ["wait", "decay_gate", "output_gate", "conv", "qk_norm", "state_read", "state_update",
                   "arrive_norm"],
    "route": ["wait", "norm", "logits", "arrive", "select"],
    "moe_down": ["wait", "experts", "arrive", "add_norm"],
    "matvec": ["wait", "read"],
}
"""The phases of the kernels that stamp (``kernels.stamps``), each ending at the next clock column of a program's
row, as their docstrings list them. KDA decode: the wait for the launch before, the decay gate's logits (f_b's rows
times the low-rank input), the output gate's, the conv tails and input row read and the conv, the q and k norms,
the state slice read with the prediction summed, the update stored with o summed, then the arrival and (a head's
last program) the gated norm. Router: the wait, the add and norm's sums of squares, the logits, the arrival, then
(the last program) the top-k selection. MoE down: the wait, the experts' rows summed, the arrival, then (the last
program) the residual add and norm. Matvec (Triton's one-row projections): the wait (its weight slab requested
before it), then x read, the products summed and stored."""


def stamps_case(model: HybridModel, L: int, device: str, n: int = 5) -> dict:
    """Where the latency-bound kernels' time goes inside the graphed 1 x L step: the step captured with the KDA
    decode, router and MoE down launches built with clock stamps (``kernels.stamps.ROWS``), replayed n times;
    per kernel (``STAMP_PHASES``), per program, each phase's cycles as us (the program's cycles scaled to its
    globaltimer span) and when it started after the launch's first program (``stamp_summary``)."""
    from kda_sessions.kernels import stamps

    if device != "cuda":
        return {"context": L, "skipped": "the stamps need a CUDA device"}
    P = 64
    pages = -(-(L + 1) // P)
    pools = model.allocate_pools(1, pages, P)
    stamps.ROWS = rows = {}
    stamps.LAUNCHES.clear()
    try:
        graphs = DecodeGraphs(model, pools, max_batch=1)
        args = ([1], [0], [L + 1], [list(range(pages))])
        graphs.run(*args)  # two warm-up steps and the captured one: the last third of each list is the graph's
        made = {k: len(v) for k, v in rows.items()}
        assert graphs.captures == 1 and all(v % 3 == 0 for v in made.values()), made
        assert len(stamps.LAUNCHES) % 3 == 0
        graph_launches = stamps.LAUNCHES[-len(stamps.LAUNCHES) // 3:]
        samples: dict[str, list[list[Tensor]]] = {k: [] for k in rows}
        sequences: list[list[tuple[str, Tensor]]] = []
        for _ in range(n):
            graphs.run(*args)
            torch.cuda.synchronize()
            for k, v in rows.items():
                samples[k].append([b.cpu() for b in v[-made[k] // 3:]])
            sequences.append([(k, b.cpu()) for k, b in graph_launches])
        assert {k: len(v) for k, v in rows.items()} == made, "replays must not launch anew"
    finally:
        stamps.ROWS = None
        stamps.LAUNCHES.clear()
    del graphs
    return {"context": L, "replays": n,
            **{k: {"launches": made[k] // 3, **stamp_summary(v, STAMP_PHASES[k])} for k, v in samples.items()},
            "after_the_launch_before": boundary_summary(sequences)}


def boundary_summary(sequences: list[list[tuple[str, Tensor]]]) -> dict:
    """Each pair of stamped launches one right after the other in the step (another launch may run between, where
    it is not a stamping kernel: MoE up, MLA's, cuBLAS's), by kernel names "before>after", medians over pairs and
    replays, us against the end of the one before (its last program's): ``first_start`` when the later launch's
    first program started (negative: it started early, PDL), ``first_past_wait`` when its first program left the
    PDL wait, ``last_end`` its end; ``late_starts`` the share of its programs that started after the one before
    ended (not resident beside it), ``median_end`` its programs' median end."""
    by: dict[str, dict[str, list[float]]] = {}
    for seq in sequences:
        times = []
        for name, b in seq:
            last = len(STAMP_PHASES[name]) + 2
            g0, g1, c0, cw, ce = (b[:, i].double() for i in (0, 1, 2, 3, last))
            ns_per_cycle = (g1 - g0) / (ce - c0).clamp(min=1)
            times.append((name, float(g0.min()), float((g0 + (cw - c0) * ns_per_cycle).min()), float(g1.max()),
                          g0, g1))
        for (a, _, _, a_end, _, _), (b_name, b_start, b_wait, b_end, b_g0, b_g1) in itertools.pairwise(times):
            d = by.setdefault(f"{a}>{b_name}", {"first_start": [], "first_past_wait": [], "last_end": [],
                                                "late_starts": [], "median_end": []})
            d["first_start"].append((b_start - a_end) / 1e3)
            d["first_past_wait"].append((b_wait - a_end) / 1e3)
            d["last_end"].append((b_end - a_end) / 1e3)
            d["late_starts"].append(float((b_g0 > a_end).double().mean()))
            d["median_end"].append((float(b_g1.median()) - a_end) / 1e3)
    return {k: {"pairs": len(v["first_start"]) // len(sequences),
                **{m: round(statistics.median(x), 2) for m, x in v.items()}} for k, v in by.items()}


def stamp_summary(samples: list[list[Tensor]], phases: list[str]) -> dict:
    """One kernel's figures from its stamp rows (per replay, per launch, [programs, 16] int64): medians over
    programs, launches and replays of each phase's us; ``phase_us_slowest``: per launch the phase's longest
    program, median over launches and replays; ``span_us``: a launch's first program start to its last end;
    ``after_wait_us``: from the first of its programs to leave the PDL wait (the launch before it done) to its last
    end, the launch's own share of the step's critical path."""
    phase: dict[str, list[float]] = {p: [] for p in phases}
    slowest: dict[str, list[float]] = {p: [] for p in phases}
    spans, skews, rates, own = [], [], [], []
    for launches in samples:
        for b in launches:
            g0, g1, c = b[:, 0].double(), b[:, 1].double(), b[:, 2:2 + len(phases) + 1].double()
            ns_per_cycle = (g1 - g0) / (c[:, -1] - c[:, 0]).clamp(min=1)
            rates.append(float(ns_per_cycle.median()))
            d = (c[:, 1:] - c[:, :-1]) * ns_per_cycle[:, None] / 1e3  # [programs, phases] us
            for i, p in enumerate(phases):
                phase[p].extend(d[:, i].tolist())
                slowest[p].append(float(d[:, i].max()))
            spans.append(float(g1.max() - g0.min()) / 1e3)
            waited = g0 + (c[:, 1] - c[:, 0]) * ns_per_cycle  # globaltimer ns when each program left the wait
            own.append(float(g1.max() - waited.min()) / 1e3)
            skews.extend(((g0 - g0.min()) / 1e3).tolist())
    med = statistics.median
    return {"programs": int(samples[0][0].shape[0]), "span_us_median": round(med(spans), 2),
            "after_wait_us_median": round(med(own), 2),
            "ns_per_cycle_median": round(med(rates), 4),
            "start_after_first_us_median": round(med(skews), 2), "start_after_first_us_max": round(max(skews), 2),
            "phase_us_median": {p: round(med(v), 3) for p, v in phase.items()},
            "phase_us_slowest": {p: round(med(v), 3) for p, v in slowest.items()}}


def read_rate_case(reps: int, gb: float = 1.2) -> dict:
    """HBM rates on this GPU over ``gb`` GB (beyond the L2): a copy (read + write, bytes counted both ways), a
    float32 sum of a bf16 tensor (read only), graph replays: the ceilings the step's kernels stand against."""
    n = int(gb * 1e9 / 2)
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    copy_us = graph_us(lambda: b.copy_(a), reps)
    sum_us = graph_us(lambda: a.sum(dtype=torch.float32), reps)
    return {"GB": gb, "copy_us": round(copy_us, 1), "copy_TB_per_s": round(2 * n * 2 / copy_us / 1e6, 3),
            "sum_us": round(sum_us, 1), "read_TB_per_s": round(n * 2 / sum_us / 1e6, 3)}


def gemv_case(reps: int) -> list[dict]:
    """cuBLAS ``x @ W.T`` at 1 and 8 rows for the step's non-routed weight shapes, as graph replays: GB/s of weight
    read (what the decode step's dense matvecs achieve). ``_t`` rows hold the weight as [D, N] (the layout of the
    merged KDA weights)."""
    shapes = {"kda_in_merged": (12576, 2304), "kda_in_merged_t": (12576, 2304), "kda_o_proj": (2304, 4096),
              "mla_q_proj": (6144, 2304), "dense_up": (9216, 2304), "lm_head": (163840, 2304),
              "kda_gate_merged_t": (8192, 256), "expert_up": (1024, 2304)}
    out = []
    for name, (n, d) in shapes.items():
        copies = max(1, int(2e8 // (n * d * 2)))  # cycle through > L2 of weights: every replay reads DRAM
        ws = [torch.randn(n, d, device="cuda").bfloat16() for _ in range(copies)]
        if name.endswith("_t"):
            ws = [w.t().contiguous().t() for w in ws]  # [N, D] views of [D, N] storage
        for T in (1, 8):
            x = torch.randn(T, d, device="cuda").bfloat16()
            us = graph_us(lambda x=x, ws=ws: [x @ w.t() for w in ws], reps) / copies
            out.append({"name": name, "T": T, "N": n, "D": d, "us": round(us, 2),
                        "GB_per_s": round(n * d * 2 / us / 1e3, 0)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script")
    ap.add_argument("--cases", default="1x8192,1x131072,8x32768,32x32768,1x1048576",
                    help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--modes", default="fused", help="fused (the library), gather (the replaced MoE), comma-separated")
    ap.add_argument("--moe-tokens", default="1,8,32,256,2048", help="token counts of the MoE-layer-alone timings")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--greedy-steps", type=int, default=8, help="greedy steps, fused MoE vs its naive twin")
    ap.add_argument("--greedy-modes", default="fused",
                    help="graph-replayed modes of the greedy check, each against the twins (e.g. fused,new)")
    ap.add_argument("--greedy-pin", default="on", choices=["on", "off"],
                    help="route every greedy run as the float32 twin's (PinnedRoutes), its tokens fed to all")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the first N layers of the 48B shape in the timed cases (real width; to fit an 80 GB GPU)")
    ap.add_argument("--greedy-layers", type=int, default=4,
                    help="depth of the real-width model of the greedy check (27 random layers amplify bf16 rounding)")
    ap.add_argument("--gemv", action="store_true", help="also time cuBLAS matvecs of the non-routed weight shapes")
    ap.add_argument("--profile", action="store_true",
                    help="top kernels of the step at batch 1, eager and graphed (context: --profile-context)")
    ap.add_argument("--profile-context", type=int, default=131072, help="context of --profile")
    ap.add_argument("--sweep", action="store_true", help="also time the MoE layer under other tile sizes")
    ap.add_argument("--moe-chain", default="", help="token counts of the MoE-slice chain (moe_chain_case), e.g. 1,8")
    ap.add_argument("--chain-sweep", action="store_true", help="the chain at one token also under other direct tiles (PDL on)")
    ap.add_argument("--alt-direct-from", type=Path,
                    help="a --moe-chain --chain-sweep JSON: mode fused-alt runs its fastest up and down tiles")
    ap.add_argument("--timeline", default="", help="contexts of a one-replay kernel timeline (batch 1), e.g. 131072")
    ap.add_argument("--stamps", default="",
                    help="contexts (batch 1) at which to time the KDA decode, router, MoE down and matvec kernels' "
                         "phases from clock stamps (kernels.stamps), and when each such launch starts against the "
                         "end of the one before")
    ap.add_argument("--stamps-modes", default="fused", help="modes (--modes) of the --stamps runs, comma-separated")
    ap.add_argument("--read-rate", action="store_true", help="also time a copy and a read-only sum beyond the L2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())}

    def dump() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1))

    def guarded(name: str, fn) -> None:
        """Run one part; a failure is recorded under ``errors`` and the next part still runs."""
        try:
            fn()
        except Exception as e:
            results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            log(f"{name} failed: {traceback.format_exc()}")
        dump()

    def greedy() -> None:
        small = build(config(args.quick, args.greedy_layers), args.device)
        results["greedy"] = {"layers": small.config.num_hidden_layers,
                             **greedy_case(small, 8192 if not args.quick else 100, args.greedy_steps, args.device,
                                           tuple(args.greedy_modes.split(",")), args.greedy_pin == "on")}
        log(json.dumps(results["greedy"]))

    if args.alt_direct_from is not None:
        ALT_DIRECT.append(direct_from_chain(args.alt_direct_from))
        results["alt_direct"] = str(ALT_DIRECT[0])
        log(f"fused-alt: {ALT_DIRECT[0]}")
    for T in [int(t) for t in args.moe_chain.split(",") if t] if args.device == "cuda" else []:
        guarded(f"moe_chain {T}", lambda T=T: results.setdefault("moe_chain", []).append(
            moe_chain_case(T, args.reps, args.chain_sweep and T == 1)))
        torch.cuda.empty_cache()
    if args.greedy_steps:
        guarded("greedy", greedy)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if not args.cases and not (args.moe_tokens and args.device == "cuda") and not args.profile \
            and not args.timeline and not args.read_rate and not args.stamps:
        return
    model = build(config(args.quick, args.layers), args.device)
    results["params"] = sum(p.numel() for p in model.parameters())
    results["layers"] = model.config.num_hidden_layers
    prepare_skips(model)
    log(f"built {results['params'] / 1e9:.2f} B parameters")
    results["decode"] = []
    for case in [c for c in args.cases.split(",") if c]:
        batch, L = (int(v) for v in case.split("x"))
        if args.quick:
            L = min(L, 256)
        modes = args.modes.split(",")

        def one(batch: int = batch, L: int = L, modes: list[str] = modes) -> None:
            results["decode"].append(decode_case(model, batch, L, modes, args.reps, args.device))
            log(json.dumps(results["decode"][-1]))

        guarded(f"decode {case}", one)
    if args.device != "cuda":
        return
    for T in [int(t) for t in args.moe_tokens.split(",") if t]:
        guarded(f"moe_layer {T}", lambda T=T: results.setdefault("moe_layer", []).append(
            moe_layer_case(model, T, args.reps, args.sweep)))
    if args.profile:
        def prof() -> None:
            L = min(args.profile_context, 256) if args.quick else args.profile_context
            for graphed in (False, True) if args.device == "cuda" else (False,):
                key = f"profile_{'graphed' if graphed else 'eager'}_1x{L}"
                results[key] = profile_case(model, L, args.device, graphed=graphed)
                log(json.dumps(results[key]))
                torch.cuda.empty_cache()

        guarded("profile", prof)
    for L in [int(v) for v in args.stamps.split(",") if v]:
        for mode in args.stamps_modes.split(","):
            _set_ablation(mode)
            guarded(f"stamps {L} {mode}", lambda L=L, mode=mode: results.setdefault("stamps", []).append(
                {"mode": mode, **stamps_case(model, min(L, 256) if args.quick else L, args.device)}))
            log(json.dumps(results.get("stamps", [{}])[-1]))
        _set_ablation("fused")
    for L in [int(v) for v in args.timeline.split(",") if v]:
        guarded(f"timeline {L}", lambda L=L: results.setdefault("timeline", []).append(
            timeline_case(model, min(L, 256) if args.quick else L, args.device)))
        log(json.dumps({k: v for k, v in results["timeline"][-1].items() if k.endswith("class")}))
        torch.cuda.empty_cache()
    if args.read_rate:
        guarded("read_rate", lambda: results.__setitem__("read_rate", read_rate_case(args.reps)))
    if args.gemv:
        guarded("gemv", lambda: results.__setitem__("gemv", gemv_case(args.reps)))
    log(json.dumps({k: v for k, v in results.items() if k in ("moe_layer", "gemv", "errors")}))


if __name__ == "__main__":
    main()
