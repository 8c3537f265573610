"""The step thread's own torch thread count on a CPU (EngineConfig.cpu_threads)."""

from __future__ import annotations

import threading

import torch

import kda_sessions as ks
from kda_sessions.model import HybridModel


async def test_step_thread_sets_its_own_count(monkeypatch):
    """A configured count applies to the step thread, where the model runs, and the caller's thread keeps its own."""
    seen: list[tuple[str, int]] = []
    step = HybridModel.step

    def spy(self, *args):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return step(self, *args)

    monkeypatch.setattr(HybridModel, "step", spy)
    before = torch.get_num_threads()
    try:
        async with await ks.Engine.open(store="memory:", cpu_threads=2) as eng:
            s = await eng.create_session()
            await s.append([1, 2, 3])
            await s.generate(max_tokens=2, ignore_eos=True)
        assert seen and all(t == ("kda-engine", 2) for t in seen)
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
