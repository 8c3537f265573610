"""A context's KDA state must not depend on where its prefill was split into calls: a conversation found by
tests/sessions/test_session_fuzz.py (seed 611 with interrupted operations) whose last KDA layer's state, prefilled
in two calls split after token 80 or 90, is 4e-2 (relative) from the one-call prefill, while every other
layer agrees to 2e-6 and a split after 60 or 64 agrees too. A checkpoint captured inside such a call then carries
the error to every session seated on it (prefix reuse, forks). Known and not yet found: xfail until fixed."""

from __future__ import annotations

import pytest

import kda_sessions as ks

TOKENS = [259, 115, 121, 115, 116, 101, 109, 260, 89, 111, 117, 32, 114, 101, 118, 105, 101, 119, 32, 100, 105, 102, 102, 115, 32, 97, 110, 100, 32, 97, 110, 115, 119, 101, 114, 32, 98, 114, 105, 101, 102, 108, 121, 46, 256, 257, 117, 115, 101, 114, 260, 116, 97, 115, 107, 32, 49, 256, 258, 97, 115, 115, 105, 115, 116, 97, 110, 116, 260, 256, 174, 58, 200, 214, 69, 158, 57, 235, 220, 239, 83, 41, 121, 230, 26, 104, 92, 116, 24, 44, 243, 108, 224, 244, 136, 25, 231, 114, 40, 75, 49, 195, 2, 36, 98, 152, 220, 202]
"""A ``tiny-random`` chat conversation (byte tokenizer ids) of 108 tokens."""


async def _state(split: int) -> list:
    async with await ks.Engine.open(store="memory:", page_size=16, checkpoint_interval_pages=0) as eng:
        s = await eng.create_session()
        await s.append(TOKENS[:split])
        await s.append(TOKENS[split:])
        st = eng.sessions[s.id]
        with eng.mutex:
            kda, _ = eng.core.pools.read_slot(st.slot)
        return list(kda)


@pytest.mark.xfail(reason="the last KDA layer's prefill state depends on the split (open, see the module docstring)",
                   strict=False)
@pytest.mark.parametrize("split", [80, 90], ids=lambda s: f"split{s}")
async def test_the_prefill_state_does_not_depend_on_the_split(split):
    whole, parts = await _state(1), await _state(split)
    for layer, (a, b) in enumerate(zip(whole, parts)):
        assert float((a - b).norm() / a.norm()) < 1e-4, f"KDA layer {layer}"
