"""``generate`` with the library's sampler against another sampler module (an earlier commit's
``kda_sessions/engine/sampler.py``, written to a file), swapped into the runner between alternations in one
process: greedy, nucleus and top-k steps (``decode_engine_48b.SAMPLINGS``) at 1 x 128K and 8 x 32K on the first
``--layers`` layers of the 48B shape. Per variant: the median and the least of ``--reps`` alternations, ms a step
(``generate(33)`` less ``generate(1)``, over 32).

    git show 4157b17:kda_sessions/engine/sampler.py > /tmp/other_sampler.py
    PYTHONUNBUFFERED=1 python3 bench/sampler_ab.py --other /tmp/other_sampler.py     # on the device
    python bench/sampler_ab.py --other /tmp/other_sampler.py --device cpu              # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_engine_48b as de

from kda_sessions.engine import runner as runner_mod


def load_other(path: Path):  # type: ignore[no-untyped-def]
    """The other sampler module; its relative import of the types made absolute."""
    src = path.read_text().replace("from ..types import", "from kda_sessions.types import")
    spec = importlib.util.spec_from_loader("other_sampler", loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["other_sampler"] = mod  # dataclasses look their module up
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


async def run(args: argparse.Namespace) -> dict:
    other = load_other(args.other)
    samplers = {"library": runner_mod.sample_batch_async, "other": other.sample_batch_async}
    cuda = args.device == "cuda"
    model = de.build_model(de.config_48b(not cuda, args.layers), args.device)
    eng = await de.open_engine(model, 8, 131072 + 600, "sampler-ab")
    res: dict = {"other": str(args.other)}
    try:
        for b, L in ((1, 131072), (8, 32768)) if cuda else ((1, 200), (2, 100)):
            sessions = [await eng.create_session() for _ in range(b)]
            g = torch.Generator().manual_seed(1)
            for s in sessions:
                await s.append(torch.randint(0, 256, (L,), generator=g).tolist())
            await de.generate_all(sessions, 2)
            t: dict[str, list[float]] = {}
            for _ in range(args.reps if cuda else 1):
                for which, fn in samplers.items():
                    runner_mod.sample_batch_async = fn  # type: ignore[attr-defined]
                    for smp in ("greedy", "nucleus", "top-k"):
                        one = await de.generate_all(sessions, 1, smp)
                        many = await de.generate_all(sessions, 33, smp)
                        t.setdefault(f"{which}/{smp}", []).append((many - one) / 32 * 1e3)
            runner_mod.sample_batch_async = samplers["library"]  # type: ignore[attr-defined]
            res[f"{b}x{L}"] = {k: {"median_ms": round(statistics.median(v), 3), "least_ms": round(min(v), 3)}
                               for k, v in t.items()}
            print(b, L, json.dumps(res[f"{b}x{L}"]), flush=True)
            for s in sessions:
                await eng.delete_session(s.id)
    finally:
        await eng.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True, help="the other sampler module's file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
