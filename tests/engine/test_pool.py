"""The pools' slot and page operations, the host pool of checkpoint states, rollback and batch sampling, on
hand-made pools (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from kda_sessions.engine.checkpoints import capture, release
from kda_sessions.engine.pool import HostStates, PageAllocator, Pools, SlotAllocator, pages_needed
from kda_sessions.engine.rollback import roll_back
from kda_sessions.engine.sampler import sample, sample_batch
from kda_sessions.engine.sequence import Checkpoint, Sequence
from kda_sessions.errors import OutOfPages, OutOfSlots
from kda_sessions.model import StatePools
from kda_sessions.types import SamplingParams

P = 4  # page size


def pools(num_slots: int = 3, num_pages: int = 8) -> Pools:
    g = torch.Generator().manual_seed(0)
    tensors = StatePools(
        kda=[torch.randn(num_slots, 2, 3, 3, generator=g) for _ in range(2)],  # [S, H, K, V] per KDA layer
        conv=[torch.randn(num_slots, 2, 5, generator=g) for _ in range(2)],  # [S, W - 1, Dc]
        kv=[torch.randn(num_pages, P, 6, generator=g) for _ in range(3)],  # [pages, P, C] per MLA layer
        page_size=P,
    )
    return Pools(tensors, num_slots, num_pages)


def test_pages_are_refcounted_and_reservations_hold_pages_back() -> None:
    p = pools(num_pages=4)
    a = p.pages.alloc(2)
    p.pages.reserve(1)
    assert p.pages.num_free == 1
    with pytest.raises(OutOfPages):
        p.pages.alloc(2)
    b = p.pages.alloc(2, reserved=1)  # one out of the reservation, one free
    assert p.pages.num_free == 0 and p.pages.reserved == 0
    p.pages.incref(a)
    p.pages.decref(a)
    assert p.pages.num_free == 0  # still held once
    p.pages.decref(a + b)
    assert p.pages.num_free == 4


def test_slots_come_out_lowest_first_and_run_out_with_a_typed_error() -> None:
    slots = SlotAllocator(3)
    assert [slots.alloc() for _ in range(3)] == [0, 1, 2] and slots.num_free == 0
    with pytest.raises(OutOfSlots, match="all 3 state slots"):
        slots.alloc()
    slots.free(1)
    assert slots.alloc() == 1  # a freed slot is the next one handed out
    with pytest.raises(AssertionError):
        slots.free(5)  # not a slot
    slots.free(0)
    with pytest.raises(AssertionError):
        slots.free(0)  # freed twice


def test_a_refused_page_request_changes_nothing() -> None:
    pages = PageAllocator(4)
    held = pages.alloc(3)
    with pytest.raises(OutOfPages, match="need 2 KV pages, 1 of 4 are free"):
        pages.alloc(2)
    with pytest.raises(OutOfPages):
        pages.reserve(2)
    assert pages.num_free == 1 and pages.reserved == 0 and [pages.refs[p] for p in held] == [1, 1, 1]
    pages.reserve(1)
    pages.unreserve(1)
    assert pages.num_free == 1
    with pytest.raises(AssertionError):
        pages.unreserve(1)  # more than was reserved
    with pytest.raises(AssertionError):
        pages.alloc(1, reserved=1)  # out of a reservation nobody made


def test_a_freed_page_forgets_its_digest_and_a_shared_one_keeps_it() -> None:
    pages = PageAllocator(2)
    a, b = pages.alloc(2)
    pages.digests.update({a: "da", b: "db"})
    pages.incref([a])
    pages.decref([a, b])
    assert pages.digests == {a: "da"} and pages.num_free == 1  # b back in the pool, a still held once
    with pytest.raises(AssertionError):
        pages.decref([b])  # not held
    pages.decref([a])
    assert pages.digests == {} and pages.num_free == 2 and pages.refs == [0, 0]


def test_host_states_take_ids_that_are_never_reused() -> None:
    host = HostStates()
    x = host.put(torch.zeros(2, 2), torch.ones(1))
    y = host.put(torch.ones(2, 2), torch.zeros(1))
    host.free(x)
    z = host.put(torch.zeros(2, 2), torch.ones(1))
    assert len({x, y, z}) == 3 and len(host) == 2  # a stale id never names a newer state
    assert torch.equal(host.get(y)[0], torch.ones(2, 2))
    with pytest.raises(KeyError):
        host.get(x)


def test_a_state_on_its_way_to_the_host_is_waited_for_and_a_failed_copy_raises() -> None:
    import threading
    from concurrent.futures import Future

    from kda_sessions.engine.pool import PendingState

    host = HostStates()
    done: Future[tuple[torch.Tensor, torch.Tensor]] = Future()
    sid = host.put(PendingState(done))
    threading.Timer(0.05, lambda: done.set_result((torch.ones(2, 2), torch.zeros(1)))).start()
    assert torch.equal(host.get(sid)[0], torch.ones(2, 2))  # waits for the copy
    assert host.get(sid)[0] is host.get(sid)[0]
    failed: Future[tuple[torch.Tensor, torch.Tensor]] = Future()
    failed.set_exception(RuntimeError("copy failed"))
    bad = host.put(PendingState(failed))
    with pytest.raises(RuntimeError, match="copy failed"):
        host.get(bad)
    host.free(bad)
    assert len(host) == 1


def test_read_slot_async_on_a_cpu_is_read_slot() -> None:
    p = pools()
    got = p.read_slot_async(1)
    assert isinstance(got, tuple)
    for a, b in zip(got, p.read_slot(1)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_a_slot_captured_without_waiting_is_its_state_at_the_capture() -> None:
    """On CUDA the capture snapshots the slot in stream order and copies it to the host on a side stream: what a
    later kernel writes into the slot is not in it, and a state captured from a fresh tensor is that tensor's
    (the engine's saves and resumes of such states: tests/sessions/test_resume_gpu.py)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from kda_sessions.model import StatePools

    g = torch.Generator(device="cuda").manual_seed(0)
    L, S = 3, 4
    kda, conv = torch.randn(L, S, 2, 64, 64, device="cuda", generator=g), torch.randn(L, S, 3, 96, device="cuda", generator=g)
    tensors = StatePools(kda=[kda[i] for i in range(L)], conv=[conv[i] for i in range(L)], kv=[], page_size=P,
                         kda_layers=kda, conv_layers=conv)
    p = Pools(tensors, S, 1)
    ref = [t.cpu() for t in p.read_slot(2)]
    sids, want = [], []
    for _ in range(20):  # captures queued back to back, each followed by a write to the slot
        sids.append(p.host.put(p.read_slot_async(2)))
        want.append([t.clone() for t in ref])
        kda.add_(1.0)
        conv.mul_(-1)
        ref[0].add_(1.0)  # the same float32 roundings as on the device
        ref[1].mul_(-1)
    fresh = torch.randn(L, 2, 64, 64, device="cuda", generator=g)
    fresh_sid = p.host.put(p.to_host_async(fresh, conv[:, 0] * 2))
    fresh_want = fresh.cpu()
    for sid, (want_kda, want_conv) in zip(sids, want):
        got_kda, got_conv = p.host.get(sid)
        assert torch.equal(got_kda, want_kda) and torch.equal(got_conv, want_conv)
    assert torch.equal(p.host.get(fresh_sid)[0], fresh_want)
    p.close()


@pytest.mark.parametrize(("tokens", "want"), [(0, 0), (1, 1), (P, 1), (P + 1, 2), (3 * P, 3)],
                         ids=["none", "one", "full", "one-past", "three-full"])
def test_pages_needed(tokens: int, want: int) -> None:
    assert pages_needed(tokens, P) == want


def test_kv_rows_round_trip_across_pages() -> None:
    p = pools()
    src, dst = p.pages.alloc(3), p.pages.alloc(3)
    rows = p.read_kv(src, 2 * P + 3)  # one [n, C] per MLA layer
    assert [r.shape for r in rows] == [torch.Size([2 * P + 3, 6])] * 3
    p.write_kv(dst, rows)
    assert all(torch.equal(a, b) for a, b in zip(p.read_kv(dst, 2 * P + 3), rows))
    page_rows = p.read_rows(src[1], 2)  # [L_mla, rows, C]
    p.write_rows(dst[2], page_rows)
    assert torch.equal(p.read_rows(dst[2], 2), page_rows)


def test_share_gives_back_its_references_when_the_partial_page_cannot_be_had() -> None:
    p = pools(num_pages=3)
    src = p.pages.alloc(3)
    with pytest.raises(OutOfPages):
        p.share(src, 2 * P + 1)
    assert [p.pages.refs[x] for x in src] == [1, 1, 1]
    assert p.share(src, 2 * P) == src[:2]  # page-aligned: nothing to copy, nothing to allocate


def test_slot_operations_and_the_host_pool_round_trip() -> None:
    p = pools()
    sid = p.capture(0)
    kda, conv = p.host.get(sid)
    assert torch.equal(kda, torch.stack([t[0] for t in p.tensors.kda]))
    assert torch.equal(conv, torch.stack([t[0] for t in p.tensors.conv]))
    p.copy_slot(0, 1)
    assert all(torch.equal(t[0], t[1]) for t in p.tensors.kda + p.tensors.conv)
    p.zero_slot(0)
    assert all(not t[0].any() for t in p.tensors.kda + p.tensors.conv)
    p.restore(sid, 0)
    assert all(torch.equal(t[0], t[1]) for t in p.tensors.kda + p.tensors.conv)
    p.host.free(sid)
    assert len(p.host) == 0


def test_share_shares_full_pages_and_copies_the_partial_one() -> None:
    p = pools()
    src = p.pages.alloc(3)
    got = p.share(src, 2 * P + 1)  # two full pages and one row
    assert got[:2] == src[:2] and got[2] not in src
    assert [p.pages.refs[x] for x in src] == [2, 2, 1]
    for kv in p.tensors.kv:
        assert torch.equal(kv[got[2], :1], kv[src[2], :1])


def test_rollback_restores_the_newest_exact_checkpoint_and_copies_a_shared_partial_page() -> None:
    p = pools()
    s = Sequence(id="s", tokens=list(range(12)), num_cached=6, slot=0, pages=p.pages.alloc(2))
    cp = Checkpoint(name="c", position=6, state_pos=0)
    capture(s, cp, 5, p.read_slot(0), p)  # state at 5 tokens: one full page, one row of the next
    want = [t[0].clone() for t in p.tensors.kda]
    shared = s.pages[1]
    p.pages.incref([shared])  # as a fork would hold it
    s.num_cached = 10
    s.pages += p.pages.alloc(1)
    p.tensors.kda[0][0].add_(1.0)  # the state moved on (or half of it did, in a failed step)
    roll_back(s, p)
    assert s.num_cached == 5 and len(s.pages) == 2 and s.pages[1] != shared
    assert all(torch.equal(t[0], w) for t, w in zip(p.tensors.kda, want))
    release(cp, p)
    assert cp.state_id is None and not cp.pages and len(p.host) == 0


def test_a_checkpoint_captured_again_under_its_name_gives_back_the_old_state_and_pages() -> None:
    p = pools()
    s = Sequence(id="s", tokens=list(range(12)), num_cached=9, slot=0, pages=p.pages.alloc(3))
    first = Checkpoint(name="c", position=6, state_pos=0)
    capture(s, first, 5, p.read_slot(0), p)  # 5 tokens: pages 0 and 1
    assert len(p.host) == 1 and [p.pages.refs[x] for x in s.pages] == [2, 2, 1]
    again = Checkpoint(name="c", position=10, state_pos=0)
    capture(s, again, 9, p.read_slot(0), p)  # 9 tokens: all three pages
    assert s.checkpoints == {"c": again} and len(p.host) == 1
    assert first.state_id is None and first.pages == [] and again.pages == s.pages
    assert [p.pages.refs[x] for x in s.pages] == [2, 2, 2]
    release(again, p, keep_state=True)  # pages back, the state kept (a checkpoint moved out to the store)
    assert again.resident and [p.pages.refs[x] for x in s.pages] == [1, 1, 1]
    release(again, p)
    assert len(p.host) == 0


def test_rollback_without_a_checkpoint_starts_over() -> None:
    p = pools()
    s = Sequence(id="s", tokens=list(range(9)), num_cached=8, slot=2, pages=p.pages.alloc(2))
    roll_back(s, p)
    assert s.num_cached == 0 and s.pages == [] and p.pages.num_free == 8
    assert all(not t[2].any() for t in p.tensors.kda + p.tensors.conv)


def test_sample_batch_matches_row_by_row_sampling_and_isolates_a_bad_row() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    logits[2] = float("nan")  # no distribution: that row fails, the others do not
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0),
              SamplingParams(top_k=5, logprobs=True)]
    gens = [None, torch.Generator().manual_seed(3), None, None]
    got = sample_batch(logits, params, gens)
    assert isinstance(got[2], Exception)
    assert got[0] == sample(logits[0], params[0], None)  # greedy: the same token and logprob
    assert got[3] == sample(logits[3], params[3], None)
    assert got[1] == sample(logits[1], params[1], torch.Generator().manual_seed(3))  # same seed, same draw
    # no row asks for logprobs: the same tokens, no logprob computed
    plain = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(top_k=5)]
    rows = logits[[0, 1, 3]]
    bare = sample_batch(rows, plain, [None, torch.Generator().manual_seed(3), None])
    assert [t for t, _ in bare] == [got[0][0], got[1][0], got[3][0]]  # type: ignore[index]
    assert all(math.isnan(lp) for _, lp in bare)  # type: ignore[misc]
