"""The thread count of CPU steps chosen by timing decode steps (``cpu_decode_threads="auto"``, engine/cpu_threads.py),
and the calling thread kept free of an OpenMP team while the engine opens."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import kda_sessions as ks
from kda_sessions.engine import cpu_threads
from kda_sessions.engine.cpu_threads import StepThreads
from kda_sessions.model import HybridModel


def drive(tuner: StepThreads, ms: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    """Run ``steps`` decode steps whose time is ``ms[count]``; the count of each step."""
    used = []
    for _ in range(steps):
        n = tuner.pick(rows)
        used.append(n)
        tuner.record(rows, ms[n] / 1000)
    return used


def test_the_faster_count_is_kept():
    t = StepThreads((1, 2))
    used = drive(t, {1: 3.0, 2: 2.2}, 40)
    # 1 untimed + 6 timed steps on 1, then the try: 1 untimed + 3 timed on 2, which wins
    assert used[:7] == [1] * 7 and used[7:11] == [2] * 4
    assert set(used[11:]) == {2}
    lane = t.lanes[1]
    assert lane.current == 2 and lane.figure == {1: 0.003, 2: 0.0022}


def test_a_much_slower_try_is_given_up_after_one_timed_step_and_tried_less_often():
    t = StepThreads((1, 2))
    used = drive(t, {1: 3.0, 2: 60.0}, 2000)
    assert used[7:9] == [2, 1], "20x slower: given up after its first (untimed) step"
    twice = drive(slower := StepThreads((1, 2)), {1: 3.0, 2: 6.0}, 20)
    assert twice[7:10] == [2, 2, 1], "2x slower: one untimed and one timed step, then back"
    assert slower.lanes[1].current == 1
    tries = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(tries) >= 3 and all(g2 > g1 for g1, g2 in itertools.pairwise(gaps)), gaps
    assert t.lanes[1].current == 1


def test_a_slowdown_of_the_chosen_count_brings_a_try_at_once():
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 2.0}, 200)  # settles on 2 and backs off its tries of 1
    assert t.lanes[1].current == 2 and t.lanes[1].probe_after > cpu_threads.FIRST_PROBE_AFTER
    used = drive(t, {1: 3.0, 2: 40.0}, 20)  # the machine got busy: 2 threads crawl
    assert 1 in used[: cpu_threads.SETTLE_STEPS + 2]
    assert t.lanes[1].current == 1 and set(used[-5:]) == {1}


def test_batch_sizes_choose_apart():
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 2.0}, 30, rows=1)
    drive(t, {1: 3.0, 2: 9.0}, 30, rows=4)
    assert (t.lanes[1].current, t.lanes[4].current) == (2, 1)


async def test_auto_decodes_on_both_counts_and_prefills_on_the_step_threads(monkeypatch):
    """With a step thread of 2, "auto" times decode steps on 1 and on 2 (and keeps one), and prefill steps apart;
    the first prefill is on 1."""
    seen: list[tuple[bool, int]] = []
    step = HybridModel.step

    def spy(self, batch, *args):
        seen.append((batch.is_decode, torch.get_num_threads()))
        return step(self, batch, *args)

    monkeypatch.setattr(HybridModel, "step", spy)
    before = torch.get_num_threads()
    try:
        async with await ks.Engine.open(store="memory:", cpu_threads=2) as eng:
            assert eng.config.cpu_decode_threads == "auto"
            s = await eng.create_session()
            await s.append([1, 2, 3])
            await s.generate(max_tokens=16, ignore_eos=True)
            tuner = eng.core.runner.step_threads
            assert tuner is not None and tuner.counts == (1, 2)
            assert set(tuner.lanes[1].figure) == {1, 2}
            assert ("prefill", 2) in tuner.lanes, "the 3-token prefill timed in its own lane"
    finally:
        torch.set_num_threads(before)
    assert seen[0] == (False, 1), "the first prefill, before any decode step: 1"
    assert {n for d, n in seen if d} == {1, 2}


def prefill(tuner: StepThreads, ms_per_token: dict[int, float], steps: int, tokens: int = 2048) -> list[int]:
    """Run ``steps`` prefill steps of ``tokens`` tokens at ``ms_per_token[count]``; the count of each step."""
    used = []
    for _ in range(steps):
        n = tuner.prefill(tokens)
        used.append(n)
        tuner.record_prefill(tokens, ms_per_token[n] * tokens / 1000)
    return used


def test_prefill_chooses_by_its_own_steps():
    """Decode on 2 no faster than on 1 (a tie: stays on 1), prefill 1.6x faster on 2: prefill moves to 2 after 3
    timed steps on 1 and 2 on 2, every step timed; decode keeps its own choice."""
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 3.1}, 40)
    assert t.lanes[1].current == 1
    used = prefill(t, {1: 0.4, 2: 0.25}, 12)
    assert used[:5] == [1, 1, 1, 2, 2] and set(used[5:]) == {2}
    lane = t.lanes[("prefill", cpu_threads.PREFILL_MAX_CLASS)]
    assert lane.current == 2 and lane.figure == {1: 0.0004, 2: 0.00025}
    assert t.lanes[1].current == 1 and t.pick(1) in (1, 2)


def test_prefill_sizes_choose_apart_and_large_chunks_share_a_lane():
    t = StepThreads((1, 2))
    prefill(t, {1: 0.4, 2: 0.25}, 12, tokens=4000)
    prefill(t, {1: 0.02, 2: 0.05}, 12, tokens=20)
    assert t.prefill(2048) == 2 and t.prefill(9000) == 2, "2,048 tokens and more: one lane"
    assert t.prefill(20) == 1 and t.prefill(1000) == 1, "another size class: its own lane, from 1"


def test_a_prefill_try_far_slower_is_given_up_at_once_and_a_busy_machine_moves_it_back():
    t = StepThreads((1, 2))
    used = prefill(t, {1: 0.4, 2: 2.0}, 40)
    assert used[3:5] == [2, 1], "5x slower: given up after its first step"
    assert used.count(2) == 1, "and not tried again soon"
    t = StepThreads((1, 2))
    prefill(t, {1: 0.4, 2: 0.25}, 12)
    used = prefill(t, {1: 0.4, 2: 1.5}, 12)  # the machine got busy: 2 threads crawl
    assert set(used[-5:]) == {1}


def test_no_prefill_try_while_decode_finds_the_other_count_far_slower():
    """Beside a busy process the decode steps' tries of 2 threads lose by far: prefill does not pay for one too."""
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 60.0}, 40)
    assert t.lanes[1].figure[2] > cpu_threads.ABORT_RATIO * t.lanes[1].figure[1]
    assert set(prefill(t, {1: 0.4, 2: 0.25}, 40)) == {1}
    drive(t, {1: 3.0, 2: 3.1}, 4000)  # quiet again: decode's next try of 2 is a near tie
    assert t.lanes[1].figure[2] < cpu_threads.ABORT_RATIO * t.lanes[1].figure[1]
    assert prefill(t, {1: 0.4, 2: 0.25}, 40)[-1] == 2


async def test_auto_on_a_one_thread_step_thread_is_one():
    async with await ks.Engine.open(store="memory:", cpu_threads=1) as eng:
        s = await eng.create_session()
        await s.append([1, 2, 3])
        await s.generate(max_tokens=2, ignore_eos=True)
        runner = eng.core.runner
        assert runner.step_threads is None and runner.cpu_decode_threads == 1


@pytest.mark.parametrize("setting", ["auto", 1])
async def test_opening_runs_torch_on_one_thread_of_the_caller(monkeypatch, setting):
    """With "auto", loading the model and allocating the pools start no OpenMP team on the caller's threads (which
    would leave the step thread's team more threads than cores), and the caller's count is set back; with a fixed
    count they run on the caller's."""
    seen: dict[str, tuple[str, int]] = {}
    allocate = HybridModel.allocate_pools
    from kda_sessions import api

    load = api.load_model

    def spy_allocate(self, *args, **kwargs):
        seen["pools"] = (threading.current_thread().name, torch.get_num_threads())
        return allocate(self, *args, **kwargs)

    def spy_load(*args, **kwargs):
        seen["load"] = (threading.current_thread().name, torch.get_num_threads())
        return load(*args, **kwargs)

    monkeypatch.setattr(HybridModel, "allocate_pools", spy_allocate)
    monkeypatch.setattr(api, "load_model", spy_load)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async with await ks.Engine.open(store="memory:", cpu_threads=1, cpu_decode_threads=setting):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    n = 1 if setting == "auto" else 2
    assert seen["load"][1] == n and seen["pools"] == (threading.current_thread().name, n)


@pytest.mark.parametrize("bad", [0, "fast", 1.5])
def test_a_bad_value_names_the_field(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="cpu_decode_threads"):
        ks.EngineConfig(cpu_decode_threads=bad)


async def test_tiny_decodes_the_same_tokens_on_one_and_two_threads():
    """What "auto" may switch between: the BLAS's kernels differ with the count (logits move by ~1e-6), and
    ``tiny``'s greedy tokens stay the same."""
    before = torch.get_num_threads()
    prompt = list(b"def main():\n    for i in range(10):\n        print(i)\n" * 8)
    tokens = {}
    try:
        for n in (1, 2):
            async with await ks.Engine.open(model="tiny", store="memory:", cpu_threads=2, cpu_decode_threads=n) as eng:
                s = await eng.create_session()
                await s.append(prompt)
                tokens[n] = (await s.generate(max_tokens=48, ignore_eos=True)).token_ids
    finally:
        torch.set_num_threads(before)
    assert len(tokens[1]) == 48 and tokens[1] == tokens[2]


def test_a_try_is_judged_against_the_latest_steps():
    """The machine got quieter while 1 thread was chosen: the next try of 2 is compared with 1's latest steps, not
    with the slow figure 1 settled on."""
    t = StepThreads((1, 2))
    drive(t, {1: 9.0, 2: 60.0}, 60)  # busy: 1 is chosen, 2 lost its try
    assert t.lanes[1].current == 1
    drive(t, {1: 3.0, 2: 2.9}, 400)  # quiet: 2 is barely faster, under the 8% a switch needs
    assert t.lanes[1].current == 1 and t.lanes[1].figure[1] == 0.003


async def test_a_cpu_engine_warms_up_before_open_returns(monkeypatch):
    """The first steps build what later ones reuse (fused weights, batch buffers, the BLAS's set-up): a 4-token prefill
    and a decode step on the scratch slot run before ``Engine.open`` returns, so a first request (a resumed session)
    does not pay for them in its time to first token."""
    seen: list[tuple[list[int], list[int], int]] = []
    step = HybridModel.step

    def spy(self, batch, *args):
        seen.append((batch.num_new, batch.start, int(batch.slots[0])))
        return step(self, batch, *args)

    monkeypatch.setattr(HybridModel, "step", spy)
    async with await ks.Engine.open(store="memory:") as eng:
        scratch = eng.core.pools.tensors.scratch_slot
        assert scratch is not None and eng.core.runner.warmed.is_set()
        assert seen == [([4], [0], scratch), ([1], [4], scratch)]


def drive_spinning(tuner: StepThreads, ms: dict[int, float], spun_ms: float, steps: int) -> list[int]:
    """``drive`` on a machine where a 1-thread step takes ``spun_ms`` while 2-thread steps' idle threads still spin:
    for 12 ms of steps after the last 2-thread step (as on a 2-core EPYC VM)."""
    used, since_two = [], float("inf")
    for _ in range(steps):
        n = tuner.pick(1)
        used.append(n)
        took = ms[n] if n == 2 or since_two >= 12.0 else spun_ms
        since_two = 0.0 if n == 2 else since_two + took
        tuner.record(1, took / 1000)
    return used


def test_one_thread_steps_beside_spinning_threads_are_not_timed(monkeypatch):
    """2 threads got slower than 1 (3.5 against 2.8 ms) while chosen: the try of 1 waits out the 2-thread steps'
    spin-down (1-thread steps 4 ms meanwhile), so it sees 2.8 and wins; timed from its first step it would see 4,
    slower, and 2 would stay."""
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 2.0}, 60)
    assert t.lanes[1].current == 2
    used = drive_spinning(t, {1: 2.8, 2: 3.5}, 4.0, 150)
    assert t.lanes[1].current == 1 and t.lanes[1].figure[1] == 0.0028
    assert set(used[-20:]) == {1}
    spun = StepThreads((1, 2))
    drive(spun, {1: 3.0, 2: 2.0}, 60)
    spun.spin_left = 0.0
    monkeypatch.setattr(cpu_threads, "SPIN_DOWN_S", 0.0)  # the window off: the try is timed while threads spin
    drive_spinning(spun, {1: 2.8, 2: 3.5}, 4.0, 150)
    assert spun.lanes[1].current == 2


def test_fewer_threads_win_a_tie_and_more_must_be_clearly_faster():
    t = StepThreads((1, 2))
    drive(t, {1: 3.0, 2: 2.0}, 60)
    assert t.lanes[1].current == 2
    drive(t, {1: 2.0, 2: 2.0}, 400)  # the same speed: the next try of 1 keeps it
    assert t.lanes[1].current == 1
    drive(t, {1: 2.0, 2: 1.9}, 400)  # 5% faster on 2: not enough to take the other core
    assert t.lanes[1].current == 1


def test_a_try_won_by_luck_is_undone_once_its_count_has_settled():
    """The three timed steps of a try of 2 threads happen to be fast (2.5 ms against 1 thread's 3.0), its steps after
    that are not (3.5): once 2 has settled, the switch is undone and the next try comes later."""
    t = StepThreads((1, 2))
    lucky = iter([2.5] * 4)  # the try: one untimed step and three timed

    used = []
    for _ in range(80):
        n = t.pick(1)
        used.append(n)
        t.record(1, (next(lucky, 3.5) if n == 2 else 3.0) / 1000)
    lane = t.lanes[1]
    assert used[7:11] == [2] * 4, "the lucky try"
    switched = used[11:].index(1) + 11
    # after the switch: one untimed step and six settling ones on 2, then back
    assert used[11:switched] == [2] * (1 + cpu_threads.SETTLE_STEPS)
    assert lane.current == 1 and lane.figure[2] == 0.0035 and lane.probe_after > cpu_threads.FIRST_PROBE_AFTER
    assert set(used[switched:]) == {1}
