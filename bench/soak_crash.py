"""Crash soak: hundreds of SIGKILLs of a process saving sessions (random moments and every disk fault point),
each followed by a resume check; prints kills, acks, resumes at the acked / in-flight save, corrupt loads.

    python bench/soak_crash.py --kills 300 [--store disk:/tmp/soak | redis://127.0.0.1:6379/0?lease_ttl=0.5]
    python bench/soak_crash.py --level store --kills 2000    # storage-level workers (no model, ~0.3 s a kill)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
from rel_helpers import DISK_POINTS, REDIS_POINTS, dangling_references, random_plan, run_campaign, temp_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--store", default="", help="store url (default: a fresh disk store in a temp dir)")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--level", choices=["engine", "store"], default="engine",
                    help="engine: crash_worker.py (model, bit-identical continuation); store: crash_store_worker.py")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or f"disk:{Path(tmp) / 'store'}"
        points = DISK_POINTS if store.startswith("disk:") else REDIS_POINTS
        per_point = max(1, args.kills // (2 * len(points)))
        plan = random_plan(args.kills - per_point * len(points), points, per_point, seed=args.seed)
        t0 = time.monotonic()
        store_level = args.level == "store"
        v = run_campaign(store, Path(tmp), plan, seed=args.seed, sessions=args.sessions, store_level=store_level,
                         **({"max_delay_s": 0.15, "fault_timeout_s": 1.0} if store_level else {}))
        dangling = asyncio.run(dangling_references(store))
        leftovers = temp_files(Path(store[5:])) if store.startswith("disk:") else []
        print(f"{len(plan)} {args.level}-level kills in {time.monotonic() - t0:.0f} s on {store.split(':')[0]}: {v.counts}")
        print(f"problems {len(v.problems)}, dangling manifests {len(dangling)}, temp files left {len(leftovers)}")
        for p in (v.problems + dangling)[:20]:
            print("  ", p)
        sys.exit(1 if v.problems or dangling or leftovers else 0)


if __name__ == "__main__":
    main()
