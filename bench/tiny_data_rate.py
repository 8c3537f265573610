"""How fast tools/train_tiny.py's data workers make training rows, alone (no model, no GPU).

    python bench/tiny_data_rate.py --workers 1,14 --seconds 20 [--near-miss 0.3 --near-miss-defs 0.5]

Training needs batch * steps-per-second rows a second (run 10a: 8 rows x 7.3 steps/s = 59 rows/s of 8K tokens);
when the workers make fewer, the training loop logs the difference as ``data_wait_s``. Prints one JSON line per
worker count: rows/s, tokens/s, and the CPUs this process may use (affinity and the cgroup's quota), which is
where a machine can have fewer than ``os.cpu_count()``.

``--recall-kinds N`` counts instead the recall questions of N rows by the kind of fact they ask for (a whole
source line, a definition's line, a first definition, a first entry, a user note), made in this process with the
same options (rows of seed ``--seed`` * 10**9 + i, the recall distance of ``--first-step``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import tiny_data
from tools.train_tiny import RecallData, batches, parse_curriculum

PAD_ID = tiny_data.PAD_ID  # as tools/train_tiny.py pads its rows


def cpu_quota() -> str:
    """The cgroup v2 CPU quota ("max 100000" when unlimited), or "unknown"."""
    try:
        return Path("/sys/fs/cgroup/cpu.max").read_text().strip()
    except OSError:
        return "unknown"


def rate(workers: int, seconds: float, args: argparse.Namespace) -> dict:
    recall = RecallData(parse_curriculum(args.recall_curriculum), args.drill_fraction)
    data = batches(args.seed, "train", args.batch, args.seq, workers, PAD_ID, recall=recall,
                   first_step=args.first_step, fact_weight=3.0, near_miss=args.near_miss,
                   near_miss_defs=args.near_miss_defs, near_miss_entries=args.near_miss_entries,
                   line_recall=args.line_recall)
    next(data)  # the pool's start and its first rows are not the steady rate
    rows = tokens = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids, _, _ = next(data)
        rows += ids.shape[0]
        tokens += int((ids != PAD_ID).sum())
    el = time.perf_counter() - t0
    data.close()
    return {"workers": workers, "rows_per_s": round(rows / el, 1), "tokens_per_s": round(tokens / el),
            "seconds": round(el, 1)}


RECALL_KINDS = (  # (kind, pattern of the question) as tiny_data words them; user notes ask "What is the ..."
    ("line", re.compile(r"Earlier you read [^\n]*(?:What was on line \d+ of it\?|What was on it\?)")),
    ("def_line", re.compile(r"Earlier you searched [^\n]*Which line was it on\?")),
    ("first_def", re.compile(r"Earlier you (?:read|looked at) [^\n]*first function or class")),
    ("first_entry", re.compile(r"Earlier you listed [^\n]*first entry")),
)


def recall_kinds(rows: int, args: argparse.Namespace) -> dict:
    """Recall questions of ``rows`` training rows, by kind."""
    lo, hi = RecallData(parse_curriculum(args.recall_curriculum), 0.0).distance(args.first_step)
    counts: collections.Counter[str] = collections.Counter()
    for i in range(rows):
        ids, _ = tiny_data.make_row(
            random.Random(args.seed * 10**9 + i), "train", args.seq, (lo, hi), args.drill_fraction, args.near_miss,
            args.near_miss_defs, args.near_miss_entries, args.line_recall,
        )
        text = bytes(t for t in ids if t < 256).decode("utf-8", "replace")
        for kind, pattern in RECALL_KINDS:
            counts[kind] += len(pattern.findall(text))
    return {"rows": rows, "recall_questions": dict(counts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1", help="comma-separated worker counts (0: rows made in this process)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=14000)
    ap.add_argument("--first-step", type=int, default=2000, help="the step whose recall distance the rows get")
    ap.add_argument("--recall-curriculum", default="64:2000:1")
    ap.add_argument("--drill-fraction", type=float, default=0.2)
    ap.add_argument("--near-miss", type=float, default=0.3)
    ap.add_argument("--near-miss-defs", type=float, default=0.0)
    ap.add_argument("--near-miss-entries", type=float, default=0.0)
    ap.add_argument("--line-recall", type=float, default=0.0)
    ap.add_argument("--recall-kinds", type=int, default=0, metavar="N", help="count the recall questions of N rows")
    args = ap.parse_args()
    cpus = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cgroup_cpu_max": cpu_quota()}
    options = {k: getattr(args, k) for k in ("near_miss", "near_miss_defs", "near_miss_entries", "line_recall")}
    print(json.dumps({"cpus": cpus, **options}), flush=True)
    if args.recall_kinds:
        print(json.dumps(recall_kinds(args.recall_kinds, args)), flush=True)
        return
    for w in (int(x) for x in args.workers.split(",")):
        print(json.dumps(rate(w, args.seconds, args)), flush=True)


if __name__ == "__main__":
    main()
