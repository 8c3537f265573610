r"""Average the weights of checkpoints of one architecture (a "model soup") into one bf16 safetensors file.

    python tools/average_weights.py --out .out/soup kda_sessions/builtin /work/.device/1/run/weights

Each input is a folder of safetensors files (sharded with an index or not: what ``train_tiny.py`` writes, or the
shipped ``kda_sessions/builtin``) or a single ``.safetensors`` file. The tensors are averaged in float32 (equal
weights unless ``--weights`` gives one per input) and written as ``tiny.safetensors`` in bf16 (``--dtype`` float32
keeps them exact), with ``config.json`` copied from ``--config`` (default: the built-in ``tiny.json``). Give
``--weights`` after the inputs (``... run15 run16 --weights 1 2 1``): before them it would take the inputs for
weights. ``--take REGEX=INDEX`` keeps the tensors whose names match REGEX from one input instead of averaging them
(for example one run's MLA layers: ``--take 'layers\.(3|7)\.self_attn\.=1'``).

Every shipped ``tiny`` is such a mean (the current one: the 1 : 1 mean of the weights shipped before it and the run
continued from them; the chain of runs and soups, with their commands, is in docs/tiny.md)."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from kda_sessions.model.loader import read_checkpoint

BUILTIN_CONFIG = Path(__file__).resolve().parents[1] / "kda_sessions" / "builtin" / "tiny.json"


class SoupError(ValueError):
    """The inputs cannot be averaged: different tensor names or shapes, or bad weights."""


def read(path: Path) -> dict[str, Tensor]:
    """The tensors of a checkpoint folder or of one .safetensors file."""
    return read_checkpoint(path)


def average(states: list[dict[str, Tensor]], weights: list[float] | None = None) -> dict[str, Tensor]:
    """sum_i w_i * state_i in float32 (w_i = 1 / n unless given; they must be positive and are normalised)."""
    if not states:
        raise SoupError("no checkpoints to average")
    w = [1.0] * len(states) if weights is None else list(weights)
    if len(w) != len(states) or any(x <= 0 for x in w):
        raise SoupError(f"need one positive weight per checkpoint ({len(states)}), got {w}")
    total = sum(w)
    names = set(states[0])
    for i, s in enumerate(states[1:], 1):
        if set(s) != names:
            odd = sorted(names ^ set(s))[:5]
            raise SoupError(f"checkpoint {i} has other tensor names than checkpoint 0 (e.g. {odd})")
        bad = [n for n in names if s[n].shape != states[0][n].shape]
        if bad:
            raise SoupError(f"checkpoint {i} has other shapes than checkpoint 0 for {sorted(bad)[:5]}")
    return {n: torch.stack([x / total * s[n].float() for x, s in zip(w, states, strict=True)]).sum(0)
            for n in sorted(names)}


def take(soup: dict[str, Tensor], states: list[dict[str, Tensor]], rules: list[str]) -> int:
    """Apply ``REGEX=INDEX`` rules in place: every tensor whose name matches REGEX (``re.search``) is input INDEX's
    own (0-based), not the mean. Returns how many tensors were taken. Raises SoupError for a malformed rule, an
    index out of range or a pattern that matches nothing (a typo would otherwise ship a plain soup)."""
    n = 0
    for rule in rules:
        pattern, sep, index = rule.rpartition("=")
        if not sep or not pattern or not index.isdigit():
            raise SoupError(f"--take wants REGEX=INDEX (e.g. 'self_attn\\.=1'), got {rule!r}")
        i = int(index)
        if i >= len(states):
            raise SoupError(f"--take {rule!r}: input {i} does not exist (there are {len(states)})")
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise SoupError(f"--take {rule!r}: bad pattern: {e}") from None
        hits = [name for name in soup if rx.search(name)]
        if not hits:
            raise SoupError(f"--take {rule!r} matches no tensor name")
        for name in hits:
            soup[name] = states[i][name].float()
        n += len(hits)
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="checkpoint folders or .safetensors files")
    ap.add_argument("--out", type=Path, required=True, help="folder for tiny.safetensors and config.json")
    ap.add_argument("--weights", type=float, nargs="+", default=None, help="one positive weight per input")
    ap.add_argument("--config", type=Path, default=BUILTIN_CONFIG, help="config.json to copy beside the weights")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--take", action="append", default=[], metavar="REGEX=INDEX",
                    help="tensors whose name matches REGEX come from input INDEX (0-based) unaveraged; repeatable")
    args = ap.parse_args(argv)
    states = [read(p) for p in args.inputs]
    soup = average(states, args.weights)
    taken = take(soup, states, args.take)
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.to(dtype).contiguous() for n, t in soup.items()}, str(args.out / "tiny.safetensors"))
    shutil.copyfile(args.config, args.out / "config.json")
    print(f"{len(soup)} tensors ({taken} taken unaveraged), {sum(t.numel() for t in soup.values())} parameters -> "
          f"{args.out}")


if __name__ == "__main__":
    main()
