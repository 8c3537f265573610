"""On a GPU, a model step queues its kernels without waiting for the device (``-m gpu``): a prefill step that
read something back (a ``.tolist()``, an ``.item()``, a blocking copy) would wait there for every kernel queued
before it, so the host's launches and the device's work would add up instead of overlapping. The engine builds
its batches with the KV rows from the host (``ForwardBatch.kv_rows``), as here."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from kda_sessions.model import ForwardBatch, load_model

P = 16


def sync_sites(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """The Python lines (innermost frame in this repository) of every synchronizing CUDA call ``fn`` makes."""
    sites: list[str] = []
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if "called a synchronizing" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "kda_sessions" in f.filename
                      or "/kernels/" in f.filename]
            sites.append(f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}" if frames else str(message))
        else:
            show(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return sites


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[5], [40, 3], [300], [17, 130]], ids=lambda n: f"new{n}")
def test_a_prefill_step_never_waits_for_the_device(lengths: list[int]):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = load_model("tiny-random", device="cuda", dtype=torch.bfloat16)
    pools = model.allocate_pools(4, 256, P)  # 96 pages a sequence: four steps of 300
    g = torch.Generator().manual_seed(0)
    start = [0] * len(lengths)

    def batch(checkpoints: bool) -> ForwardBatch:
        pages = [list(range(96 * s, 96 * s + 96)) for s in range(len(lengths))]
        rows = ForwardBatch.rows_for(pages, start, lengths, P)
        return ForwardBatch(
            input_ids=torch.randint(0, 272, (sum(lengths),), generator=g).cuda(), num_new=list(lengths),
            start=list(start), slots=torch.arange(len(lengths)).cuda(),
            page_table=torch.tensor(pages, dtype=torch.int32).cuda(),
            checkpoint_positions=[[n // 2 + 1, n] for n in lengths] if checkpoints else None,
            kv_rows=torch.tensor(rows).cuda(),
        )

    for checkpoints in (False, True):
        b = batch(checkpoints)
        model.step(b, pools)  # first: compiles what it needs
        for i, n in enumerate(lengths):
            start[i] += n
        b = batch(checkpoints)
        sites = sync_sites(lambda b=b: model.step(b, pools))
        for i, n in enumerate(lengths):
            start[i] += n
        assert sites == [], f"checkpoints={checkpoints}: the step waited for the device at\n" + "\n".join(sites)
