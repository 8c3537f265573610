"""The step thread's own torch thread count on a CPU (EngineConfig.cpu_threads)."""

from __future__ import annotations

import threading

import pytest
import torch

import kda_sessions as ks
from kda_sessions.model import HybridModel


@pytest.mark.parametrize("decode_threads", [1, None], ids=["decode-on-1", "decode-as-prefill"])
async def test_step_thread_sets_its_own_count(monkeypatch, decode_threads):
    """A configured count applies to the step thread, where the model runs, and the caller's thread keeps its own;
    decode steps run on ``cpu_decode_threads`` (None: the step thread's count)."""
    seen: list[tuple[str, bool, int]] = []
    step = HybridModel.step

    def spy(self, batch, *args):
        seen.append((threading.current_thread().name, batch.is_decode, torch.get_num_threads()))
        return step(self, batch, *args)

    monkeypatch.setattr(HybridModel, "step", spy)
    before = torch.get_num_threads()
    try:
        async with await ks.Engine.open(store="memory:", cpu_threads=2, cpu_decode_threads=decode_threads) as eng:
            s = await eng.create_session()
            await s.append([1, 2, 3])
            await s.generate(max_tokens=3, ignore_eos=True)
        assert {d for _, d, _ in seen} == {False, True}
        want = [("kda-engine", d, 2 if not d or decode_threads is None else 1) for _, d, _ in seen]
        assert seen == want
        assert torch.get_num_threads() == before
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [before], "a thread started after the engine closed inherits the engine's count"
    finally:
        # torch keeps the last count any thread set and gives it to every thread started later: left at 2, each
        # later test's step thread ran two spinning OpenMP threads on this 2-core machine (5-7x slower, against
        # the conftest's OMP_NUM_THREADS=1). Setting the caller's count back restores what new threads get.
        torch.set_num_threads(before)


@pytest.mark.slow
async def test_compiled_decode_compiles_once_at_two_threads():
    """With ``cpu_compile``, the warm-up runs on the decode steps' thread count: dynamo guards torch's count, so a
    warm-up on the step thread's 2 would compile a second graph at the first real decode step."""
    import torch._dynamo

    before = torch.get_num_threads()
    torch._dynamo.utils.counters.clear()
    try:
        async with await ks.Engine.open(model="tiny", store="memory:", cpu_threads=2, cpu_compile=True) as eng:
            s = await eng.create_session()
            await s.append([1, 2, 3, 4])
            await s.generate(max_tokens=3, ignore_eos=True)
            assert eng.core.runner.compiled
    finally:
        torch.set_num_threads(before)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
