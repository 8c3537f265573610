# ruff: noqa: E402  (the package is imported after the device shim is set up)
"""Train ``tiny``, the built-in hybrid model (3:1 KDA : MLA, byte vocabulary, about 9M parameters), on
synthetic coding-agent transcripts generated offline by tools/tiny_data.py.

    python tools/train_tiny.py --out DIR --steps N [--seed 0] [--batch 16] [--seq 8192]   # on a GPU
    python tools/train_tiny.py --out DIR --device cpu --quick                               # smoke test

The model is the library's own ``HybridModel`` (same modules, same parameter names); only the forward used for
training differs in how it runs, never in its math:

- KDA: the same projections, the same depthwise causal conv + SiLU (zero tail at the start of each row), the
  same gate (``naive_kda_gate``), the same beta, output norm and output gate; the delta rule itself runs through
  fla-core's ``chunk_kda`` on a GPU (it has a backward) and the library's ``naive_chunk_kda`` on a CPU.
- MLA: the same latent, the same decompression, causal SDPA with the same scale (NoPE: no positions).
- FFN, embedding and head: the library's modules, called as they are; the RMSNorms through the kernels' naive
  twin (same math), since on CUDA the modules run a Triton kernel with no backward. The first step checks that
  every parameter got a gradient.

Checks printed in the log: at the start, the training forward against the library's own inference forward
(``HybridModel.forward``, which uses the library's Triton kernels on a GPU) on the same ids; at the end, the
held-out loss of the training forward (``heldout_loss`` in train_log.json), which tools/eval_tiny.py
``--loss`` reproduces with the library's forward on a CPU. Data order is fixed by ``--seed``; with ``--steps``
the run is reproducible up to GPU non-determinism. ``--minutes`` caps the wall time (the schedule still follows
``--steps``; the log records the steps done). ``--checkpoint-every MIN`` saves the float32 weights and the log
every MIN minutes, so that a run killed from outside keeps its latest weights (a new copy is written beside the
old one and renamed into place); SIGTERM ends training after the current step, and the run then saves and checks
as after its last step.

Recall data: ``--recall-curriculum A:B:S`` asks recall questions at a minimum distance from their fact that grows
geometrically from A to B tokens over the first S steps (of the whole schedule: ``--start-step`` continues it),
then draws it per question (half at B or more, the rest log-uniform in [A, B)); without it, 2,000 tokens as
before. ``--drill-fraction`` makes that share of rows dense recall drills, and ``--fact-weight`` weighs the
recalled or looked-up value inside the assistant's answers (mask 2 of tiny_data.make_row) in the loss. The
logged ``assistant_loss`` stays the unweighted mean over all of the assistant's tokens (comparable across runs);
``fact_loss`` is the mean over the value tokens alone. ``--near-miss`` makes that share of the renamed
projects' names start like a stdlib name and run on without a separator (tiny_data.RenamedCorpus);
``--near-miss-defs`` gives that share of their files such names for their definitions, in the file text too;
``--near-miss-entries`` gives that share of their listed directories new entry names. ``--line-recall`` makes that
share of recall sources line reads ("What was on line N of F?"), which the rows otherwise almost never ask.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _shim() -> None:
    """Import the package without the server's dependencies (the GPU machine has torch, triton, and the
    carried wheels only): a folder with an empty ``__init__`` and links to the parts training needs."""
    try:
        import kda_sessions  # noqa: F401

        return
    except ImportError:
        for m in [m for m in sys.modules if m.startswith("kda_sessions")]:
            del sys.modules[m]
    root = Path("/tmp/kda_train_shim")
    pkg = root / "kda_sessions"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""shim for tools/train_tiny.py"""\n')
    links = {n: REPO / "kda_sessions" / n for n in ("config.py", "errors.py", "model", "builtin", "tokenizer", "tools.py")}
    links["kernels"] = REPO / "kernels"
    links["storage"] = REPO / "storage"
    for name, target in links.items():
        p = pkg / name
        if p.is_symlink() or p.exists():
            p.unlink()
        p.symlink_to(target)
    sys.path.insert(0, str(root))


_shim()
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # steady steps, no refragmenting
sys.path.append(str(REPO))  # for `tools`, after the shim so it cannot shadow it

import torch
import torch.nn.functional as F
from torch import Tensor

from kda_sessions.config import ModelConfig
from kda_sessions.kernels.gate.naive import naive_kda_gate
from kda_sessions.kernels.kda.naive import naive_chunk_kda
from kda_sessions.kernels.norm.naive import naive_rms_norm
from kda_sessions.model import HybridModel, save_model
from kda_sessions.model.kda import KDAAttention
from kda_sessions.model.mla import MLAttention
from tools import tiny_data, tiny_general

CONFIG = REPO / "kda_sessions" / "builtin" / "tiny.json"
MAX_SHIPPED_BYTES = 60_000_000  # issue 31: the weights in the package at most, as bf16 safetensors
PAD_WEIGHT = 0.0
CONTEXT_WEIGHT = 0.05  # loss weight of tokens the assistant does not write (prompts, tool output)


# ---------------------------------------------------------------- model


def init_weights(model: HybridModel, seed: int) -> None:
    """GPT-style init; KDA's A_log and dt_bias as in Kimi Linear / Mamba."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
                dt = dt.clamp(min=1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "norm" in name:
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 / math.sqrt(2 * n_layers))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _causal_conv(x: Tensor, weight: Tensor) -> Tensor:
    """x [B, T, Dc], weight [Dc, W]: the library's conv (zero tail) + SiLU, in float32, back to x's dtype."""
    W = weight.shape[1]
    xt = F.pad(x.float().transpose(1, 2), (W - 1, 0))
    y = F.conv1d(xt, weight.float().unsqueeze(1), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y).to(x.dtype)


def trim_fla_autotune(keep: int) -> int:
    """Keep at most ``keep`` configs in each of fla's autotuned kernels (0: all of them).

    fla 0.6.0 autotunes every kernel of its forward and backward over 6-24 configs; on a fresh machine that is
    ~400 s of compiling before the first step (docs/tiny.md). The configs kept are those nearest 4 warps and 2
    stages, which fit in shared memory for any head size; Triton still picks the faster of the ones left.
    Returns the number of kernels trimmed."""
    import fla.ops.kda  # noqa: F401  (imports every kernel module chunk_kda uses)
    from triton.runtime.autotuner import Autotuner

    if keep <= 0:
        return 0
    trimmed = 0
    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # an autotuner may sit under @triton.heuristics: follow .fn down
                if isinstance(obj, Autotuner):
                    if id(obj) not in seen and len(obj.configs) > keep:
                        obj.configs = sorted(obj.configs, key=lambda c: (abs(c.num_warps - 4), abs(c.num_stages - 2)))[:keep]
                        trimmed += 1
                    seen.add(id(obj))
                    break
                obj = getattr(obj, "fn", None)
    return trimmed


def _norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """The library's RMSNorm module through its differentiable twin: on CUDA the module itself runs a Triton
    kernel with no backward, whose output would cut every gradient below it (only lm_head would learn)."""
    return naive_rms_norm(x, norm.weight, norm.eps)


def check_gradients(model: HybridModel) -> None:
    """Stop at once when a parameter got no gradient from the step's backward: a module of the training forward
    ran a kernel without autograd (a run that trains the head alone otherwise looks healthy)."""
    dead = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    if dead:
        raise SystemExit(f"{len(dead)} parameters got no gradient (first: {dead[:3]}): a module of the training "
                         "forward runs a kernel without a backward on this device")


def _kda(layer: KDAAttention, x: Tensor, use_fla: bool) -> Tensor:
    B, T, _ = x.shape
    H, K, V = layer.H, layer.K, layer.V
    qkv = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
    qkv = _causal_conv(qkv, layer.conv_weight())
    q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V)
    g = naive_kda_gate(layer.f_b_proj(layer.f_a_proj(x)).view(B, T, H, K), layer.A_log, layer.dt_bias, layer.lower_bound)
    beta = torch.sigmoid(layer.b_proj(x).float())
    if use_fla:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        o, _ = fla_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    else:
        o, _, _ = naive_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o = layer.o_norm(o) * torch.sigmoid(layer.g_b_proj(layer.g_a_proj(x)).view(B, T, H, V))
    return layer.o_proj(o.reshape(B, T, H * V).to(x.dtype))


def _mla(layer: MLAttention, x: Tensor) -> Tensor:
    B, T, _ = x.shape
    H, r, dn, dr, dv = layer.H, layer.r, layer.dn, layer.dr, layer.dv
    q = (layer.q_proj(x) if hasattr(layer, "q_proj") else
         layer.q_b_proj(_norm(layer.q_a_layernorm, layer.q_a_proj(x)))).view(B, T, H, dn + dr)
    kv_a = layer.kv_a_proj_with_mqa(x)
    latent = torch.cat([_norm(layer.kv_a_layernorm, kv_a[..., :r]), kv_a[..., r:]], dim=-1)
    kv = layer.kv_b_proj(latent[..., :r]).view(B, T, H, dn + dv)
    k = torch.cat([kv[..., :dn], latent[:, :, None, r:].expand(B, T, H, dr)], dim=-1)
    # v zero-padded to the q/k head size: flash attention needs one head size (dv 64 < 96 otherwise sends
    # SDPA to a slower kernel); the padded columns of the output are zeros and are cut off
    v = F.pad(kv[..., dn:], (0, dn + dr - dv))
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=layer.scale
    )
    return layer.o_proj(o[..., :dv].transpose(1, 2).reshape(B, T, H * dv))


def train_logits(model: HybridModel, ids: Tensor, use_fla: bool) -> Tensor:
    """ids [B, T] (fresh rows) -> logits [B, T, vocab], differentiable."""
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        h = _norm(layer.input_layernorm, x)
        attn = layer.self_attn
        h = _kda(attn, h, use_fla) if isinstance(attn, KDAAttention) else _mla(attn, h)
        x = x + h
        x = x + layer.ffn(_norm(layer.post_attention_layernorm, x))
    return model.lm_head(_norm(model.model.norm, x)).float()


def masked_losses(logits: Tensor, ids: Tensor, weights: Tensor, kinds: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(weighted training loss, mean loss on the assistant's tokens, mean loss on the fact tokens) over next-token
    targets. weights [B, T] float32; kinds [B, T] uint8, make_row's mask (0 context, 1 assistant, 2 fact)."""
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    w = weights[:, 1:].reshape(-1)
    k = kinds[:, 1:].reshape(-1)
    train = (ce * w).sum() / w.sum().clamp(min=1e-6)
    mine = (k > 0).float()
    fact = (k == tiny_data.FACT).float()
    return train, (ce * mine).sum() / mine.sum().clamp(min=1.0), (ce * fact).sum() / fact.sum().clamp(min=1.0)


# ---------------------------------------------------------------- data


# seed, split, max_len, recall distance, drill, near_miss, near_miss_defs, near_miss_entries, line_recall,
# general, tree_share, general_recall, copy_drill, general_focus, general_listing, general_recall_late
RowJob = tuple[
    int, str, int, tuple[int, int], float, float, float, float, float, float, float, float, float, float, float, float
]


@dataclass(frozen=True)
class RecallData:
    """The recall part of the data: ``curriculum`` (A, B, S) of --recall-curriculum or None (2,000 tokens),
    ``drill`` the fraction of drill rows."""

    curriculum: tuple[int, int, int] | None = None
    drill: float = 0.0

    def distance(self, step: int) -> tuple[int, int]:
        """make_row's ``distance`` for the rows of training step ``step``."""
        if self.curriculum is None:
            return tiny_data.RECALL_DISTANCE, tiny_data.RECALL_DISTANCE
        return tiny_data.curriculum_distances(step, *self.curriculum)


def parse_curriculum(text: str) -> tuple[int, int, int]:
    """'A:B:S' -> (A, B, S), validated."""
    try:
        a, b, s = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--recall-curriculum must be A:B:S (integers), got {text!r}") from None
    if not 0 < a <= b or s < 0:
        raise argparse.ArgumentTypeError(f"--recall-curriculum needs 0 < A <= B and S >= 0, got {text!r}")
    return a, b, s


def _row(args: RowJob) -> tuple[list[int], list[int]]:
    seed, split, max_len, distance, drill, near_miss, near_miss_defs, near_miss_entries, line_recall, general, \
        tree_share, general_recall, copy_drill, general_focus, general_listing, general_recall_late = args
    # a row of tiny_general for a share ``general`` of the seeds, drawn from a stream of its own: at 0 the rows of
    # runs before the option are unchanged
    is_general = general > 0 and random.Random(f"general:{seed}").random() < general
    for attempt in range(8):  # a file the tools refuse (a link out of the stdlib, say): another draw
        try:
            if is_general:
                return tiny_general.make_general_row(random.Random(seed + attempt * 10**7), split, max_len, tree_share,
                                                     general_recall, distance, copy_drill, general_focus,
                                                     general_listing, general_recall_late)
            return tiny_data.make_row(
                random.Random(seed + attempt * 10**7), split, max_len, distance, drill, near_miss, near_miss_defs,
                near_miss_entries, line_recall,
            )
        except ValueError:
            continue
    raise RuntimeError(f"no row for seed {seed}")


def _packed_row(args: RowJob) -> tuple[bytes, bytes]:
    """A row as compact bytes (uint16 ids, uint8 mask 0/1/2): cheap to send back from a worker."""
    ids, mask = _row(args)
    return array("H", ids).tobytes(), bytes(mask)


def _row_worker(w: int, workers: int, jobs: Callable[[int], RowJob], out: Any) -> None:
    """Data worker ``w`` of ``workers``: rows w, w + workers, w + 2 workers, ... in order, into its own queue."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked from a parent that defers SIGTERM: this one just dies
    for i in itertools.count(w, workers):
        out.put(_packed_row(jobs(i)))


def batches(
    seed: int, split: str, batch: int, seq: int, workers: int, pad_id: int, prefetch: int = 4,
    recall: RecallData = RecallData(), first_step: int = 1, fact_weight: float = 1.0, near_miss: float = 0.0,
    near_miss_defs: float = 0.0, near_miss_entries: float = 0.0, line_recall: float = 0.0, general: float = 0.0,
    tree_share: float = 0.5, general_recall: float = 0.0, copy_drill: float = 0.0, general_focus: float = 0.0,
    general_listing: float = 0.0, general_recall_late: float = 0.0,
):
    """Endless batches (ids [B, T] int64, weights [B, T] float32, kinds [B, T] uint8: make_row's mask), rows from
    seeds seed*10**9 + i; the i-th row belongs to training step first_step + i // batch, whose recall distance
    it is generated with. Weights: 1 on the assistant's tokens, ``fact_weight`` on the fact tokens inside its
    answers, CONTEXT_WEIGHT elsewhere, PAD_WEIGHT on padding. ``near_miss``, ``near_miss_defs``, ``near_miss_entries``,
    ``line_recall``: make_row's. ``general``: the share of rows made by tiny_general.make_general_row (grammar
    phrasings, package trees, multi-step, tool errors, off-task refusals), ``tree_share`` its share on package trees,
    ``general_recall`` its share that holds recall questions (make_general_row's ``recall``), ``copy_drill`` its
    share of copy drills (make_general_row's ``copy``), ``general_focus`` its share of focus rows (``focus``),
    ``general_listing`` its share of listing rows (``listing``), ``general_recall_late`` the share of its recall rows
    whose facts come after other episodes (``recall_late``).

    Each of ``workers`` processes makes every workers-th row, in order, into a queue of its own that holds about
    ``prefetch`` batches' worth of rows between them (an unbounded backlog let the workers run ahead and the
    parent spend its time unpickling rows nobody needed yet). The parent reads row i from queue i % workers
    when it needs it: no thread of its own hands out jobs or collects results, so a parent busy launching GPU
    work (holding the GIL) does not slow the rows down. Rows are the same for any number of workers."""
    base = seed * 10**9 + (0 if split == "train" else 5 * 10**8)

    def jobs(i: int) -> RowJob:
        return (base + i, split, seq, recall.distance(first_step + i // batch), recall.drill, near_miss,
                near_miss_defs, near_miss_entries, line_recall, general, tree_share, general_recall, copy_drill,
                general_focus, general_listing, general_recall_late)

    ctx = mp.get_context("fork")
    queues = [ctx.Queue(maxsize=-(-prefetch * batch // workers) + 1) for _ in range(workers)]
    procs = [ctx.Process(target=_row_worker, args=(w, workers, jobs, queues[w]), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()

    def row(i: int) -> tuple[bytes, bytes]:
        if not workers:
            return _packed_row(jobs(i))
        q, p = queues[i % workers], procs[i % workers]
        while True:
            try:
                return q.get(timeout=10)
            except queue.Empty:
                if not p.is_alive():
                    raise RuntimeError(f"data worker {i % workers} stopped (exit code {p.exitcode})") from None

    try:
        for i in itertools.count(0, batch):
            ids = torch.full((batch, seq), pad_id, dtype=torch.long)
            w = torch.full((batch, seq), PAD_WEIGHT)
            kinds = torch.zeros((batch, seq), dtype=torch.uint8)
            for b in range(batch):
                r_ids, r_mask = row(i + b)
                n = len(r_mask)
                ids[b, :n] = torch.frombuffer(bytearray(r_ids), dtype=torch.uint16).long()
                m = torch.frombuffer(bytearray(r_mask), dtype=torch.uint8)
                kinds[b, :n] = m
                w[b, :n] = torch.where(m == tiny_data.FACT, fact_weight, torch.where(m > 0, 1.0, CONTEXT_WEIGHT))
            yield ids, w, kinds
    finally:  # the generator closed (or collected): stop the workers rather than leave them to the interpreter
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


def heldout_rows(seed: int, n: int, seq: int) -> list[tuple[list[int], list[int]]]:
    """Held-out rows as before any curriculum: recall at 2,000+ tokens (the eval's distance), no drill rows."""
    d = tiny_data.RECALL_DISTANCE
    zero = 0.0
    return [_row((seed * 10**9 + 5 * 10**8 + i, "heldout", seq, (d, d), zero, zero, zero, zero, zero, zero, zero,
                  zero, zero, zero, zero, zero)) for i in range(n)]


def heldout_loss(
    model: HybridModel, rows: list[tuple[list[int], list[int]]], device: torch.device, use_fla: bool
) -> dict[str, float]:
    """Masked mean cross-entropy of the rows under the training forward: on the assistant's tokens (``loss``)
    and on the facts of its answers (``fact_loss``)."""
    tot = cnt = tot_f = cnt_f = 0.0
    with torch.no_grad():
        for r_ids, r_mask in rows:
            ids = torch.tensor([r_ids], device=device)
            m = torch.tensor(r_mask[1:], device=device)
            w, wf = (m > 0).float(), (m == tiny_data.FACT).float()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = train_logits(model, ids, use_fla)
            ce = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
            tot += (ce * w).sum().item()
            cnt += w.sum().item()
            tot_f += (ce * wf).sum().item()
            cnt_f += wf.sum().item()
    return {"loss": tot / max(cnt, 1.0), "fact_loss": tot_f / max(cnt_f, 1.0), "fact_tokens": int(cnt_f)}


# ---------------------------------------------------------------- main


def parity_check(model: HybridModel, device: torch.device, use_fla: bool, seq: int) -> dict:
    """The training forward against the library's inference forward on the same ids (float32 weights)."""
    rows = heldout_rows(12345, 2, seq)
    n = min(len(r[0]) for r in rows)
    ids = torch.tensor([r[0][:n] for r in rows], device=device)
    with torch.no_grad():
        a = train_logits(model, ids, use_fla)
    b = model.forward(ids)
    rel = ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()
    return {"tokens": int(ids.numel()), "rel_rms": rel, "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}


def save_weights(model: HybridModel, path: Path, max_shard_bytes: int) -> None:
    """Save `model` (float32) to the folder `path` so that a kill at any moment leaves one whole copy, the new or
    the previous one, at `path` or at `path`.old: the new copy is written beside it and renamed into place."""
    partial, old = path.with_name(f"{path.name}.partial"), path.with_name(f"{path.name}.old")
    shutil.rmtree(partial, ignore_errors=True)
    save_model(model, partial, max_shard_bytes=max_shard_bytes)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this wall time")
    ap.add_argument("--time-schedule", action="store_true",
                    help="with --minutes: the cosine runs over the wall time left after the first step (on a fresh "
                         "machine that step compiles and autotunes fla's kernels) instead of over --steps")
    ap.add_argument("--checkpoint-every", type=float, default=None, metavar="MIN",
                    help="save the weights and the log every MIN minutes of training (a killed run keeps them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--start-step", type=int, default=0,
                    help="continue the schedule of an earlier run from this step (with --init; warm-up restarts, 20 steps)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--init", default=None, help="a directory written by save_model to start from")
    ap.add_argument("--config", default=str(CONFIG),
                    help="model config (a Kimi-Linear config.json, or a folder holding one); default: the shipped "
                         "tiny.json. Shipping another shape means replacing tiny.json with it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script on a CPU")
    ap.add_argument("--shard-mb", type=float, default=15.0)
    ap.add_argument("--autotune-configs", type=int, default=2, help="fla configs kept per kernel (0: all)")
    ap.add_argument("--recall-curriculum", type=parse_curriculum, default=None, metavar="A:B:S",
                    help="recall distance from A to B tokens over steps 0-S (geometric), then half at B+, half in [A, B)")
    ap.add_argument("--drill-fraction", type=float, default=0.0, help="share of rows that are dense recall drills")
    ap.add_argument("--fact-weight", type=float, default=1.0, help="loss weight of the fact tokens in answers")
    ap.add_argument("--near-miss", type=float, default=0.0,
                    help="share of renamed-project names that start like a stdlib name (tiny_data.RenamedCorpus)")
    ap.add_argument("--near-miss-defs", type=float, default=0.0,
                    help="share of renamed-project files whose definitions get such names (tiny_data.RenamedCorpus)")
    ap.add_argument("--near-miss-entries", type=float, default=0.0,
                    help="share of renamed-project listed directories whose entries get new names (tiny_data.RenamedCorpus)")
    ap.add_argument("--line-recall", type=float, default=0.0,
                    help="share of recall sources that are line reads (tiny_data.make_row; not trained yet)")
    ap.add_argument("--general-fraction", type=float, default=0.0,
                    help="share of rows from tiny_general.make_general_row: grammar phrasings, package trees, "
                         "multi-step tasks, corrected tool errors, off-task refusals (issue 31; not trained yet)")
    ap.add_argument("--tree-share", type=float, default=0.5,
                    help="share of --general-fraction rows over an installed package tree (else the stdlib)")
    ap.add_argument("--general-recall", type=float, default=0.0,
                    help="share of --general-fraction rows with 1-3 recall questions (tiny_general.make_general_row)")
    ap.add_argument("--copy-drill", type=float, default=0.0,
                    help="share of --general-fraction rows that are copy drills: a project named with long unseen "
                         "words (tiny_general.copy_corpus)")
    ap.add_argument("--general-focus", type=float, default=0.0,
                    help="share of --general-fraction rows that are focus rows: garbled-path errors corrected, list_dir "
                         "intent drills, class/def greps, more phrasings (tiny_general.focus_episode)")
    ap.add_argument("--general-listing", type=float, default=0.0,
                    help="share of --general-fraction rows that are listing rows: list_dir drills whose every question "
                         "says 'the listing of D', tool tasks after context words that start like the path "
                         "(tiny_general.listing_episode); at most 1 - --general-focus")
    ap.add_argument("--general-recall-late", type=float, default=0.0,
                    help="share of --general-recall rows whose facts come after 1-3 other episodes, not first in "
                         "the row (tiny_general.make_general_row's recall_late)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq, args.workers, args.warmup = 3, 2, 512, 0, 1
    # the row flags first: a bad one must not cost the model's construction and parity check (a device call's start)
    if not 0.0 <= args.drill_fraction <= 1.0 - tiny_data.PLAIN_FRACTION:
        raise SystemExit(f"--drill-fraction must be in [0, {1.0 - tiny_data.PLAIN_FRACTION}], got {args.drill_fraction}")
    for flag, value in (("--near-miss", args.near_miss), ("--near-miss-defs", args.near_miss_defs),
                        ("--near-miss-entries", args.near_miss_entries), ("--line-recall", args.line_recall),
                        ("--general-fraction", args.general_fraction), ("--tree-share", args.tree_share),
                        ("--general-recall", args.general_recall), ("--copy-drill", args.copy_drill),
                        ("--general-focus", args.general_focus), ("--general-listing", args.general_listing),
                        ("--general-recall-late", args.general_recall_late)):
        if not 0.0 <= value <= 1.0:
            raise SystemExit(f"{flag} must be in [0, 1], got {value}")
    if args.general_focus + args.general_listing > 1.0:
        raise SystemExit(f"--general-focus + --general-listing must be at most 1, got {args.general_focus} + "
                         f"{args.general_listing}")
    device = torch.device(args.device)
    use_fla = device.type == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    cfg = ModelConfig.from_file(Path(args.config))
    model = HybridModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params * 2 > MAX_SHIPPED_BYTES:  # shipped as bf16
        raise SystemExit(f"{args.config}: {n_params / 1e6:.2f} M parameters is {n_params * 2 / 1e6:.1f} MB as bf16, "
                         f"over the {MAX_SHIPPED_BYTES / 1e6:.0f} MB the package may ship (issue 31)")
    init_weights(model, args.seed)
    if args.init:
        from kda_sessions.model.loader import read_checkpoint

        state = read_checkpoint(Path(args.init))
        model.load_state_dict({k: v.float() for k, v in state.items()})
    model = model.to(device)
    log: dict = {"config": Path(args.config).name, "params": n_params, "args": vars(args), "steps": []}
    trimmed = trim_fla_autotune(args.autotune_configs) if use_fla else 0
    print(json.dumps({"params": n_params, "device": str(device), "fla": use_fla, "autotune_trimmed": trimmed}), flush=True)
    log["parity_start"] = parity_check(model, device, use_fla, 512 if args.quick else 2048)
    print(json.dumps({"parity_start": log["parity_start"]}), flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda",
    )
    pad_id = tiny_data.PAD_ID
    # a continued run draws other rows than the run it continues (seed + start step)
    recall = RecallData(args.recall_curriculum, args.drill_fraction)
    data = batches(args.seed * 1000 + args.start_step, "train", args.batch, args.seq, args.workers, pad_id,
                   recall=recall, first_step=args.start_step + 1, fact_weight=args.fact_weight,
                   near_miss=args.near_miss, near_miss_defs=args.near_miss_defs,
                   near_miss_entries=args.near_miss_entries, line_recall=args.line_recall,
                   general=args.general_fraction, tree_share=args.tree_share, general_recall=args.general_recall,
                   copy_drill=args.copy_drill, general_focus=args.general_focus, general_listing=args.general_listing,
                   general_recall_late=args.general_recall_late)
    t0 = time.perf_counter()
    tokens = 0
    step = 0
    waited = 0.0  # seconds spent waiting for the data workers
    shard_bytes = int(args.shard_mb * 2**20)
    last_checkpoint = t0
    # SIGTERM (`timeout`, a machine handed back) ends the training loop after the current step; the weights, the
    # held-out loss and the parity check follow as after the last step
    terminated: list[int] = []
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    if in_main_thread:
        previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    model.train()
    first = args.start_step + 1
    if args.time_schedule and args.minutes is None:
        raise SystemExit("--time-schedule needs --minutes")
    t_first: float | None = None  # end of the first step: the time schedule starts there
    for step in range(first, args.steps + 1):
        warm = (step - args.start_step) / 20 if args.start_step else step / args.warmup
        progress = step / args.steps
        if args.time_schedule and t_first is not None:
            progress = (time.perf_counter() - t_first) / max(1.0, args.minutes * 60 - (t_first - t0))
        lr = args.lr * min(1.0, warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in opt.param_groups:
            group["lr"] = lr
        t_wait = time.perf_counter()
        ids, w, kinds = next(data)
        waited += time.perf_counter() - t_wait
        ids, w = ids.to(device, non_blocking=True), w.to(device, non_blocking=True)
        kinds = kinds.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = train_logits(model, ids, use_fla)
        loss, mine, fact = masked_losses(logits, ids, w, kinds)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == first:
            check_gradients(model)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += ids.numel()
        if t_first is None:
            t_first = time.perf_counter()
        if step % 25 == 0 or step == first or step == args.steps:
            el = time.perf_counter() - t0
            entry = {"step": step, "loss": round(loss.item(), 4), "assistant_loss": round(mine.item(), 4),
                     "fact_loss": round(fact.item(), 4), "recall_distance": list(recall.distance(step)),
                     "grad_norm": round(gn.item(), 3), "lr": lr, "tok_per_s": round(tokens / el), "elapsed_s": round(el, 1),
                     "data_wait_s": round(waited, 1)}
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
        now = time.perf_counter()
        if args.checkpoint_every is not None and now - last_checkpoint > args.checkpoint_every * 60:
            save_weights(model, out / "weights", shard_bytes)
            log["steps_done"], log["train_seconds"] = step, now - t0
            (out / "train_log.json").write_text(json.dumps(log, indent=1))
            print(json.dumps({"checkpoint": step, "save_s": round(time.perf_counter() - now, 2)}), flush=True)
            last_checkpoint = time.perf_counter()
        if terminated:
            log["stopped_by"] = "SIGTERM"
            print(json.dumps({"stopped_by": "SIGTERM", "step": step}), flush=True)
            break
        if args.minutes is not None and time.perf_counter() - t0 > args.minutes * 60:
            break
    if in_main_thread:
        signal.signal(signal.SIGTERM, previous_handler)
    log["steps_done"] = step
    log["train_seconds"] = time.perf_counter() - t0
    model.eval()
    save_weights(model, out / "weights", shard_bytes)  # fp32 copy, first
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    # held-out loss of the training forward (float32 weights), for tools/eval_tiny.py --loss to reproduce
    rows = heldout_rows(args.seed, 4 if args.quick else 16, args.seq)
    log["heldout"] = {"seed": args.seed, "rows": len(rows), "seq": args.seq,
                      **heldout_loss(model, rows, device, use_fla)}
    # and of general rows in held-out phrasings, trees and files (tiny_general): how far the phrasing generalises
    general_rows = [tiny_general.make_general_row(random.Random(args.seed * 10**9 + 7 * 10**8 + i), "heldout",
                                                  args.seq) for i in range(2 if args.quick else 8)]
    log["heldout_general"] = {"rows": len(general_rows), **heldout_loss(model, general_rows, device, use_fla)}
    print(json.dumps({"heldout_general": log["heldout_general"]}), flush=True)
    # the rows themselves: they depend on the machine's stdlib, so eval_tiny --loss needs them, not a seed
    (out / "heldout_rows.json").write_text(json.dumps(
        {"ids": [r[0] for r in rows], "mask": [r[1] for r in rows], "loss": log["heldout"]["loss"]}
    ))
    print(json.dumps({"heldout": log["heldout"]}), flush=True)
    log["parity_end"] = parity_check(model, device, use_fla, 512 if args.quick else 2048)
    print(json.dumps({"parity_end": log["parity_end"]}), flush=True)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
