# ruff: noqa: B023  (the launch closures are timed inside the iteration that made them)
"""MLA prefill's Triton kernel at the Kimi-Linear shape (H 32, r 512, dn 128, dr 64, dv 128, P 64, bf16), on the
device:

    python3 bench/mla_prefill.py
    python3 bench/mla_prefill.py --short      # short chunks: decompressed against absorbed (``short_chunks``),
                                              # after each of ``--contexts`` cached (default 32768,131072),
                                              # ``--chunks`` tokens (default 1,4,16,32,64,128,256,512)
    python3 bench/mla_prefill.py --padded     # the prefill graphs' absorbed call, replayed (``padded_chunks``),
                                              # each of ``--variants`` (default 32,64-n,64-m)

First the shipped launch against the tiled twin (``naive_mla_prefill_paged``, float32 math) by relative RMS error,
then every (BM, BN, num_warps, num_stages) of the sweep, its key tiles by pointer loads and through TMA
descriptors (``prefill.TMA``), timed on one 8,192-token chunk after 24,576 and after
122,880 cached tokens (the last chunks of 32K and 128K prefills; mean of 3 calls after one warm-up), with the
achieved TFLOP/s of attention plus decompression. Prints one line per case, the shipped launch marked."""

from __future__ import annotations

import time
from functools import partial

import torch

from kda_sessions.kernels.mla import prefill
from kda_sessions.kernels.mla.naive import naive_mla_prefill_paged

H, R, DN, DR, DV, P = 32, 512, 128, 64, 128, 64
SCALE = (DN + DR) ** -0.5
SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2)]


def case(T: int, start: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = -(-(start + T) // P)
    kv = torch.randn(n + 3, P, R + DR, generator=g, device="cuda").bfloat16()
    pages = torch.randperm(n + 3, generator=g, device="cuda")[:n].int()
    q = torch.randn(T, H, DN + DR, generator=g, device="cuda").bfloat16()
    w = (torch.randn(H * (DN + DV), R, generator=g, device="cuda") / R**0.5).bfloat16()
    return q, kv, pages, w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def short_chunks(contexts: list[int], chunks: list[int], reps: int = 10) -> None:
    """Short chunks (an agent's tool output appended to a long conversation): the decompressed flash kernel
    (each block's keys shared by ``key_splits`` programs, ``unsplit``: one a query tile and head, and its key tiles
    through TMA descriptors, ``prefill.TMA``) against
    ``mla_prefill_absorbed``, us per call (CUDA events, mean of ``reps`` after one warm-up), and their relative
    RMS differences."""
    from kda_sessions.kernels.mla.absorbed import mla_prefill_absorbed

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for s in contexts:
        for T in chunks:
            q, kv, pages, w = case(T, s)
            out = {}
            whole = partial(prefill.mla_prefill_triton, splits=1)  # each block's keys in one program a tile

            def tma(*a):  # the library's call with its key tiles through TMA descriptors
                prefill.TMA, was = True, prefill.TMA
                try:
                    return prefill.mla_prefill_triton(*a)
                finally:
                    prefill.TMA = was

            for name, fn in (("decompressed", prefill.mla_prefill_triton), ("absorbed", mla_prefill_absorbed),
                             ("unsplit", whole), ("tma", tma)):
                o = fn(q, kv, pages, s, w, DV, SCALE)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn(q, kv, pages, s, w, DV, SCALE)
                end.record()
                end.synchronize()
                back_to_back = start.elapsed_time(end) / reps * 1e3
                host, device = [], []
                for _ in range(reps):  # one call at a time: its host call, and its device time alone
                    torch.cuda.synchronize()
                    start.record()
                    t = time.perf_counter()
                    fn(q, kv, pages, s, w, DV, SCALE)
                    host.append((time.perf_counter() - t) * 1e6)
                    end.record()
                    end.synchronize()
                    device.append(start.elapsed_time(end) * 1e3)
                out[name] = (back_to_back, o, sorted(host)[reps // 2], sorted(device)[reps // 2])
            d, a, u, m = out["decompressed"], out["absorbed"], out["unsplit"], out["tma"]
            print(f"context {s} chunk {T}: back to back decompressed {d[0]:.1f} us (splits "
                  f"{prefill.key_splits(T, H, 16384, sms)}; unsplit {u[0]:.1f}; TMA {m[0]:.1f}, rel diff "
                  f"{rel(m[1], d[1]):.2e}), absorbed {a[0]:.1f} us; one "
                  f"call's host / device: decompressed {d[2]:.0f} / {d[3]:.0f} us, absorbed {a[2]:.0f} / {a[3]:.0f} us; "
                  f"rel diff {rel(a[1], d[1]):.2e}, unsplit {rel(u[1], d[1]):.2e}", flush=True)


VARIANTS = {  # name: (head block, paged_decode_gluon.QUERIES_ON_M, .PIPELINED)
    "32": (32, False, False),
    "64-n": (64, False, False),  # queries on N: 32 heads a warpgroup
    "64-m": (64, True, False),  # queries on M, serial (the library's)
    "64-mp": (64, True, True),  # queries on M, the next tile's scores before this tile's P V
}


def padded_chunks(contexts: list[int], chunks: list[int], variants: tuple[str, ...] = ("32", "64-n", "64-m"),
                  reps: int = 20) -> None:
    """The absorbed call of ``PrefillGraphs`` (``mla_prefill_absorbed_padded``, one sequence) captured in a CUDA
    graph and replayed, as a short prefill step runs it, for each variant of the split kernel (``VARIANTS``: query
    rows a program, and for 64 the Gluon kernel's form): us per replay (CUDA events, mean of ``reps`` after one
    warm-up) and the achieved TFLOP/s of the cached rows' scores and values (2 T H L (2 r + dr)); the outputs of the
    variants against the first (relative RMS)."""
    from kda_sessions.kernels.mla import absorbed_splits, mla_prefill_absorbed_padded
    from kda_sessions.kernels.mla import paged_decode_gluon as pg

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for s in contexts:
        for T in chunks:
            q, kv, pages, w = case(T, s)
            new = torch.randn(1, T, R + DR, device="cuda").bfloat16()
            table, starts = pages[None, :], torch.tensor([s], dtype=torch.int32, device="cuda")
            first = None
            for name in variants:
                bh, pg.QUERIES_ON_M, pg.PIPELINED = VARIANTS[name]
                splits = absorbed_splits(T, H, pages.numel() * P, sm, bh)

                def call() -> torch.Tensor:
                    return mla_prefill_absorbed_padded(q[None], new, kv, table, starts, w, DV, SCALE, splits,
                                                       head_block=bh)

                for _ in range(2):
                    call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = call()
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    graph.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) / reps * 1e3
                flops = 2 * T * H * s * (2 * R + DR)
                first = out.clone() if first is None else first
                print(f"context {s} chunk {T} variant {name}: {us:.1f} us a replay ({splits} splits), "
                      f"{flops / us / 1e6:.0f} TFLOP/s, rel diff {rel(out, first):.1e}", flush=True)


def main() -> None:
    import sys

    if "--padded" in sys.argv:  # python3 bench/mla_prefill.py --padded [--variants 32,64-n,64-m,64-mp]
        variants = sys.argv[sys.argv.index("--variants") + 1].split(",") if "--variants" in sys.argv else None
        padded_chunks([32768, 131072, 1048576], [1, 16, 32, 64, 128], *([tuple(variants)] if variants else []))
        return
    if "--short" in sys.argv:  # python3 bench/mla_prefill.py --short [--contexts 32768,131072,1048576]
        contexts = ([int(c) for c in sys.argv[sys.argv.index("--contexts") + 1].split(",")]
                    if "--contexts" in sys.argv else [32768, 131072])
        chunks = ([int(c) for c in sys.argv[sys.argv.index("--chunks") + 1].split(",")]
                  if "--chunks" in sys.argv else [1, 4, 16, 32, 64, 128, 256, 512])
        short_chunks(contexts, chunks)
        return
    tma_shipped = prefill.TMA
    for T, s in [(8192, 0), (2048, 20000), (300, 40000), (8192, 24576)]:
        q, kv, pages, w = case(T, s)
        r = naive_mla_prefill_paged(q, kv, pages, s, w, DV, SCALE, tile=2048)
        for tma in (False, True):
            prefill.TMA = tma
            o = prefill.mla_prefill_triton(q, kv, pages, s, w, DV, SCALE)
            print(f"check T {T} start {s} {'TMA' if tma else 'pointers'}: rel_rms {rel(o, r):.2e}", flush=True)
    shipped = prefill._tiles(torch.empty(1, device="cuda"))
    tiles = prefill._tiles
    try:
        for cfg, tma in [(c, t) for c in SWEEP for t in (False, True)]:
            prefill._tiles = lambda q, cfg=cfg: cfg
            prefill.TMA = tma
            row = []
            for s in (24576, 122880):
                q, kv, pages, w = case(8192, s)

                def f() -> torch.Tensor:
                    return prefill.mla_prefill_triton(q, kv, pages, s, w, DV, SCALE)

                f()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(3):
                    f()
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t) / 3
                flops = 8192 * (s + 8192 / 2) * 2 * H * (DN + DR + DV) + (s + 8192) * 2 * R * H * (DN + DV)
                row.append(f"after {s}: {dt * 1e3:.1f} ms {flops / dt / 1e12:.0f} TFLOP/s")
            print("(BM, BN, warps, stages)", cfg, "TMA" if tma else "pointers", "; ".join(row),
                  "(shipped)" if cfg == shipped and tma == tma_shipped else "", flush=True)
    finally:
        prefill._tiles, prefill.TMA = tiles, tma_shipped


if __name__ == "__main__":
    main()
