"""The prefix index's host time a turn at long contexts: a conversation of N tokens grows by 300 tokens a turn, and
each turn files a checkpoint (``PrefixIndex.add``, as a chat turn's message end) and looks its tokens up
(``matches``, as a turn's prefix reuse does), over the tokens as a plain list and as the sessions' ``TokenList``
(which keeps its page chain). Median ms of 5 turns; on the event loop, which holds the GIL meanwhile.

    python bench/prefix_chain.py --contexts 131072,1048576
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kda_sessions.sessions.prefix_index import PrefixHit, PrefixIndex, TokenList


def turn_ms(n: int, kind: type, turns: int = 5, page_size: int = 64) -> float:
    rng = random.Random(n)
    tokens = kind(rng.randrange(163840) for _ in range(n))
    index = PrefixIndex(page_size)
    index.add(tokens, PrefixHit("s", "c", len(tokens)))
    times = []
    for turn in range(turns):
        tokens.extend(rng.randrange(163840) for _ in range(300))
        t = time.perf_counter()
        index.add(tokens, PrefixHit("s", f"c{turn}", len(tokens)))
        next(index.matches(tokens), None)
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="131072,1048576")
    args = ap.parse_args()
    res = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
           "ms_per_turn": {n: {"list": turn_ms(int(n), list), "TokenList": turn_ms(int(n), TokenList)}
                           for n in args.contexts.split(",")}}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
