"""A context's KDA state must not depend on where its prefill was split into calls, except through the routers'
near-ties: a tiny-random conversation (found by tests/sessions/test_session_fuzz.py, seed 611 with interrupted
operations) has a token whose 2nd and 3rd expert scores in one MoE layer are 7e-7 apart. The two prefills' hidden
states differ by rounding (~1e-6, the matmuls see other shapes), so on some machines (not all: it depends on the
CPU's matmul kernels) that token's expert flips with the split and every later layer's state moves (the last KDA
layer's by 4e-2). That is the router's discontinuity, not a lost or misplaced token, and every MoE runtime has it.
What must hold: the routers choose the same experts wherever the choice is not a near-tie, and every KDA layer
before the first flipped choice (all of them where none flipped) holds the same state to 1e-4."""

from __future__ import annotations

import pytest
import torch

import kda_sessions as ks
import kda_sessions.model.ffn as ffn_mod

_ROUTE = ffn_mod.moe_route

NEAR_TIE = 1e-5
"""Score gap between the k-th and (k+1)-th expert under which a choice may flip with rounding."""

TOKENS = [259, 115, 121, 115, 116, 101, 109, 260, 89, 111, 117, 32, 114, 101, 118, 105, 101, 119, 32, 100, 105, 102, 102, 115, 32, 97, 110, 100, 32, 97, 110, 115, 119, 101, 114, 32, 98, 114, 105, 101, 102, 108, 121, 46, 256, 257, 117, 115, 101, 114, 260, 116, 97, 115, 107, 32, 49, 256, 258, 97, 115, 115, 105, 115, 116, 97, 110, 116, 260, 256, 174, 58, 200, 214, 69, 158, 57, 235, 220, 239, 83, 41, 121, 230, 26, 104, 92, 116, 24, 44, 243, 108, 224, 244, 136, 25, 231, 114, 40, 75, 49, 195, 2, 36, 98, 152, 220, 202]
"""A ``tiny-random`` chat conversation (byte tokenizer ids) of 108 tokens."""


async def _prefill(split: int, monkeypatch: pytest.MonkeyPatch, noise: torch.Generator | None = None
                   ) -> tuple[list[torch.Tensor], list, list[int], list[int]]:
    """With ``noise``, the routers see their inputs plus noise of std 3e-5 drawn from it. Returns (KDA states by KDA layer, the session's router calls in order as (chosen, k-th minus (k+1)-th score), the
    model layer index of each MoE layer (the order a forward calls them in), and of each KDA layer)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    def recorded(x, gate, bias, k, *args, **kwargs):
        if noise is not None:
            x = x + 3e-5 * torch.randn(x.shape, generator=noise)
        chosen, weights = _ROUTE(x, gate, bias, k, *args, **kwargs)
        scores = torch.sigmoid(x.float() @ gate.float().T) + (0 if bias is None else bias.float())
        top = scores.topk(k + 1, dim=-1).values
        calls.append((chosen[:, :k].sort(-1).values, top[:, k - 1] - top[:, k]))
        return chosen, weights

    monkeypatch.setattr(ffn_mod, "moe_route", recorded)
    async with await ks.Engine.open(store="memory:", page_size=16, checkpoint_interval_pages=0) as eng:
        model = eng.core.model
        layers = model.model.layers
        kda_layers = [i for i in range(len(layers)) if model.config.is_kda(i)]
        moe_layers = [i for i, layer in enumerate(layers) if isinstance(getattr(layer, "block_sparse_moe", None),
                                                                         ffn_mod.MoE)]
        s = await eng.create_session()
        calls.clear()  # the engine's own warm-up
        await s.append(TOKENS[:split])
        await s.append(TOKENS[split:])
        st = eng.sessions[s.id]
        assert st.slot is not None
        with eng.mutex:
            kda, _ = eng.core.pools.read_slot(st.slot)
        return list(kda), calls, moe_layers, kda_layers


def _by_layer(calls: list, moe_layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Model layer index -> (chosen experts [T, k] sorted, near-tie gap [T]) over the session's tokens in order."""
    assert len(calls) % len(moe_layers) == 0
    out: dict[int, tuple[list, list]] = {}
    for n, (chosen, gap) in enumerate(calls):
        rows = out.setdefault(moe_layers[n % len(moe_layers)], ([], []))
        rows[0].append(chosen)
        rows[1].append(gap)
    return {i: (torch.cat(c), torch.cat(g)) for i, (c, g) in out.items()}


def _check(whole: tuple, parts: tuple) -> int:
    """Assert the invariant of the module docstring on two ``_prefill`` results; returns the first model layer whose
    routing differs (past the last KDA layer where none does)."""
    (x_states, x_calls, moe_layers, kda_layers), (y_states, y_calls, _, _) = whole, parts
    a, b = _by_layer(x_calls, moe_layers), _by_layer(y_calls, moe_layers)
    # the prefill calls route every token after the first (the first runs through the decode step in both)
    assert sorted(a) == sorted(b) == moe_layers
    assert all(a[i][0].shape[0] == b[i][0].shape[0] == len(TOKENS) - 1 for i in a)
    flipped = max(kda_layers) + 1
    for i in sorted(a):
        diff = (a[i][0] != b[i][0]).any(-1)
        if diff.any():  # past it the layers' inputs differ by more than rounding: their choices may differ too
            gaps = torch.minimum(a[i][1], b[i][1])[diff]
            assert float(gaps.max()) < NEAR_TIE, f"layer {i}: a choice with a clear winner flipped (gap {gaps.max()})"
            flipped = i
            break
    assert len(kda_layers) == len(x_states) == len(y_states)
    for j, (x, y) in enumerate(zip(x_states, y_states)):
        if kda_layers[j] <= flipped:  # a layer's KDA runs before its MoE
            assert float((x - y).norm() / x.norm()) < 1e-4, f"KDA layer {j} (model layer {kda_layers[j]})"
    return flipped


@pytest.mark.parametrize("split", [60, 64, 80, 90, 100], ids=lambda s: f"split{s}")
async def test_the_prefill_state_does_not_depend_on_the_split(split, monkeypatch):
    _check(await _prefill(1, monkeypatch), await _prefill(split, monkeypatch))


async def test_a_near_tie_flipped_by_noise_moves_only_the_layers_after_it(monkeypatch):
    """The cause, shown on any machine: noise of 3e-5 on the routers' inputs (a larger cousin of the rounding a
    split makes) flips a near-tie before the last KDA layer (model layer 5 with seed 0 on some CPUs, 7 on others:
    the first seed that flips one before it), and only the KDA layers after it move."""
    whole = await _prefill(1, monkeypatch)
    last = len(whole[0]) - 1
    assert whole[3][last] == 6
    for seed in range(8):
        parts = await _prefill(80, monkeypatch, noise=torch.Generator().manual_seed(seed))
        if _check(whole, parts) < whole[3][last]:
            break
    else:
        pytest.fail("no seed of 8 flipped a near-tie before the last KDA layer")
    assert float((whole[0][last] - parts[0][last]).norm() / whole[0][last].norm()) > 1e-3
