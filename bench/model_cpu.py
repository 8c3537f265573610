"""Prefill and decode tokens/s of the model on this CPU, through the engine's path: ``HybridModel.step`` on
pooled state (KDA state slots + latent KV pages), the way ``tests/model/helpers.py`` and the engine runner call it.

    python bench/model_cpu.py [--quick] [--wider] [--out FILE]

prefill: one fresh sequence of T tokens in one step (T = 512, 2048; the engine's per-step prefill budget is
2048), median of ``--reps`` runs. decode: B sequences (B = 1, 8) each holding ``--context`` tokens, then
``--reps`` blocks of ``--steps`` decode steps of one token per sequence; tokens/s = B x steps / wall time of the
median block (greedy argmax included). Each measurement first waits for the shared machine to be quiet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from common import Timer

import kda_sessions as ks
from kda_sessions.model import ForwardBatch, HybridModel


class PooledRunner:
    """N sequences, one state slot each and enough KV pages for ``max_tokens``; ``feed`` appends tokens."""

    def __init__(self, model: HybridModel, num_seqs: int, max_tokens: int, page_size: int = 64) -> None:
        self.model = model
        per_seq = -(-max_tokens // page_size)
        self.pools = model.allocate_pools(num_seqs, num_seqs * per_seq, page_size)
        self.table = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
        self.lengths = [0] * num_seqs

    def feed(self, seqs: list[int], tokens: list[list[int]]) -> torch.Tensor:
        batch = ForwardBatch(
            input_ids=torch.tensor([t for ts in tokens for t in ts]),
            num_new=[len(ts) for ts in tokens],
            start=[self.lengths[s] for s in seqs],
            slots=torch.tensor(seqs),
            page_table=self.table[seqs],
        )
        logits, _ = self.model.step(batch, self.pools)
        for s, ts in zip(seqs, tokens):
            self.lengths[s] += len(ts)
        return logits


def bench_prefill(model: HybridModel, T: int, reps: int) -> dict[str, Any]:
    toks = common.random_tokens(T, seed=T)
    times = []
    quiet = common.wait_quiet()
    for _ in range(reps):
        r = PooledRunner(model, 1, T)
        with Timer() as t:
            r.feed([0], [toks])
        times.append(t.s)
    med = statistics.median(times)
    return {"T": T, "reps": reps, "median_s": med, "tok_per_s": T / med, "all_s": times, "quiet": quiet}


def bench_decode(model: HybridModel, B: int, context: int, steps: int, reps: int) -> dict[str, Any]:
    r = PooledRunner(model, B, context + reps * steps + 1)
    seqs = list(range(B))
    logits = r.feed(seqs, [common.random_tokens(context, seed=100 + b) for b in seqs])  # prefill, not timed
    nxt = logits.argmax(-1).tolist()
    r.feed(seqs, [[t] for t in nxt])  # one warm-up decode step
    quiet = common.wait_quiet()
    blocks = []  # the machine is shared: time ``reps`` blocks of steps and keep the median block
    for _ in range(reps):
        with Timer() as t:
            for _ in range(steps):
                nxt = r.feed(seqs, [[t] for t in nxt]).argmax(-1).tolist()
        blocks.append((t.s, t.cores))
    wall, cores = sorted(blocks)[len(blocks) // 2]
    return {"batch": B, "context": context, "steps": steps, "reps": reps, "median_block_s": wall,
            "tok_per_s": B * steps / wall, "ms_per_step": 1000 * wall / steps, "cores": cores,
            "all_block_s": [b[0] for b in blocks], "quiet": quiet}


def bench_model(model: HybridModel, args: argparse.Namespace) -> dict[str, Any]:
    PooledRunner(model, 1, 64).feed([0], [common.random_tokens(64, seed=0)])  # warm-up (first-call costs)
    return {
        "params_M": common.model_params(model) / 1e6,
        "prefill": [bench_prefill(model, T, args.reps) for T in args.prefill],
        "decode": [bench_decode(model, B, args.context, args.steps, args.reps) for B in args.batch],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: T 512 only, fewer steps")
    p.add_argument("--wider", action="store_true", help="also the wider config of bench/common.py")
    p.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048])
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--context", type=int, default=512, help="tokens each sequence holds before decoding")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if args.quick:
        common.MAX_WAIT_S = 5.0
        args.prefill, args.steps, args.reps, args.context = [512], 16, 1, 256
    result: dict[str, Any] = {"machine": common.machine(), "command": " ".join(["python", *sys.argv]), "models": {}}
    result["models"]["tiny-random"] = bench_model(ks.load_model("tiny-random"), args)
    if args.wider:
        with tempfile.TemporaryDirectory(prefix="ksbench_wider_") as d:
            result["models"]["wider"] = bench_model(ks.load_model(common.build_wider(Path(d))), args)
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
