"""Device time of ``engine.undo.StepUndo.save`` (a decode-ahead step's copy of the rows with ``stop`` strings) at
the 48B shape's KDA state (H 32, K = V 128, float32; conv tails bf16), on both layouts of the pools (every layer in
one tensor, as the engine allocates them: two strided copies a row; a tensor per layer: two copies a layer), against
one contiguous copy of the same bytes and per-layer ``index_select`` copies; CUDA events over ``--reps``
back-to-back saves; and a checkpoint's capture of one slot's state to the host (the end of every chat turn, and
its input's end): ``capture_us`` with ``.cpu()``, waited for (as the engine did before 7e7322b),
``capture_pinned_us`` into page-locked buffers, and ``Pools.read_slot_async`` (the engine's since): the time its
caller waits and the time until the state is on the host, through the worker's page-locked buffers
(``Pools.pinned_staging``, the library's) and through pageable memory (``_pageable``).

    python3 bench/undo_copy.py --layers 20 --rows 1,8,32 --out $OUT/undo.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kda_sessions.engine.pool import PendingState, Pools
from kda_sessions.engine.undo import StepUndo
from kda_sessions.model import StatePools


def timed(fn, reps: int) -> float:
    """Median-free mean us of ``fn`` over reps back-to-back calls (after two warm-ups)."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps


def host_timed(fn, reps: int) -> float:
    """Median us of ``fn`` (which waits for the device) over reps calls, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def capture(undo: StepUndo, slot: int) -> None:
    """A slot's state to the host, as ``Pools.read_slot`` copies it for a checkpoint (the end of every request)."""
    if undo.stacked is not None:
        undo.stacked[0][:, slot].cpu(), undo.stacked[1][:, slot].cpu()
    else:
        half = len(undo.layers) // 2  # the KDA states, then the conv tails
        torch.stack([t[slot] for t in undo.layers[:half]]).cpu(), torch.stack([t[slot] for t in undo.layers[half:]]).cpu()


def capture_pinned(stacked: list[torch.Tensor], slot: int, pinned: list[torch.Tensor]) -> None:
    """``capture`` from the stacked layout into page-locked host buffers made beforehand."""
    for src, dst in zip(stacked, pinned):
        dst.copy_(src[:, slot], non_blocking=True)
    torch.cuda.synchronize()


def async_capture(pools: Pools, slot: int, reps: int = 5) -> dict[str, float]:
    """``Pools.read_slot_async`` (the engine's checkpoint capture): how long its caller waits (the step thread: the
    device snapshot queued, the host copy handed to the worker) and how long until the state is on the host."""
    out = {}
    for staging in (False, True):
        pools.pinned_staging = staging
        got = async_capture_once(pools, slot, reps)
        out.update({f"{k}{'' if staging else '_pageable'}": v for k, v in got.items()})
    return out


def async_capture_once(pools: Pools, slot: int, reps: int) -> dict[str, float]:
    call, total = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        pending = pools.read_slot_async(slot)
        call.append((time.perf_counter() - t) * 1e6)
        sid = pools.host.put(pending) if isinstance(pending, PendingState) else pools.host.put(*pending)
        pools.host.get(sid)
        total.append((time.perf_counter() - t) * 1e6)
        pools.host.free(sid)
    return {"capture_async_call_us": statistics.median(call[1:]), "capture_async_done_us": statistics.median(total[1:])}


def case(undo: StepUndo, n: int, reps: int) -> dict[str, float]:
    """Saves of n rows by ``StepUndo``, by per-layer ``index_select``, and one contiguous copy of as many bytes."""
    dev = undo.layers[0].device
    slots = list(range(3, 3 + n))
    stacked = undo.stacked or []
    pinned = [torch.empty((t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=True) for t in stacked]
    assert undo.reserve(n)
    idx = torch.tensor(slots, device=dev)
    flat = torch.empty(n * undo.bytes_per_row // 4, device=dev)
    flat2 = torch.empty_like(flat)
    bufs = [torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=dev) for t in undo.layers]

    def per_layer() -> None:
        for t, b in zip(undo.layers, bufs):
            torch.index_select(t, 0, idx, out=b)

    got = {
        "capture_us": host_timed(lambda: capture(undo, slots[0]), 5),
        "capture_pinned_us": host_timed(lambda: capture_pinned(stacked, slots[0], pinned), 5) if stacked else 0.0,
        "save_us": timed(lambda: undo.save(slots), reps),
        "restore_us": timed(lambda: undo.restore(0, slots[0]), reps),
        "index_select_us": timed(per_layer, reps),
        "one_copy_us": timed(lambda: flat2.copy_(flat), reps),
        "copy_floor_us_at_4_8": 2 * n * undo.bytes_per_row / 4.8e12 * 1e6,
    }
    return {k: round(v, 1) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=20, help="KDA layers (the 48B shape: 20)")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    H, K, Dc, S = 32, 128, 3 * 32 * 128, 40
    dev = torch.device("cuda")
    kda = torch.zeros(args.layers, S, H, K, K, device=dev)
    conv = torch.zeros(args.layers, S, 3, Dc, device=dev, dtype=torch.bfloat16)
    layouts = {
        "stacked": StatePools(kda=list(kda.unbind(0)), conv=list(conv.unbind(0)), kv=[], page_size=64,
                              kda_layers=kda, conv_layers=conv),
        "per_layer": StatePools(kda=list(kda.unbind(0)), conv=list(conv.unbind(0)), kv=[], page_size=64),
    }
    out: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "cases": {}}
    for name, pools in layouts.items():
        undo = StepUndo(pools)
        out["mb_per_row"] = undo.bytes_per_row / 1e6
        for n in (int(x) for x in args.rows.split(",")):
            out["cases"][f"{name}/{n}"] = case(undo, n, args.reps)
            if n == 1:
                out["cases"][f"{name}/{n}"].update(async_capture(Pools(pools, S - 1, 1), 3))
            print(name, n, out["cases"][f"{name}/{n}"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
