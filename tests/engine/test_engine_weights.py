"""The engine's CPU decode checks the model's parameters when a request arrives, not on every token: weights changed
in place between two requests are what the second one decodes with."""

import torch

import kda_sessions as ks

PROMPT = [(i * 37) % 250 for i in range(40)]


def scale(model, factor: float) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(factor)  # in KDA's and MLA's derived output weights
            layer.mlp.up_proj.weight.mul_(factor)  # in the FFN's derived gate | up weight


async def run(eng: ks.Engine) -> list[float]:
    s = await eng.create_session()
    await s.append(PROMPT)
    out = await s.generate(max_tokens=6, ignore_eos=True, logprobs=True)
    assert out.logprobs is not None
    return out.logprobs


async def test_weights_changed_between_requests_are_decoded_with() -> None:
    async with await ks.Engine.open(model="tiny", store="memory:", device="cpu") as eng:
        before = await run(eng)
        steps = eng.core.runner.steps
        scale(eng.model, 0.5)
        after = await run(eng)
        assert eng.core.runner.steps - steps >= 6  # decode steps ran, not only the prefill
    async with await ks.Engine.open(model="tiny", store="memory:", device="cpu") as fresh:
        scale(fresh.model, 0.5)
        want = await run(fresh)
    assert after == want
    assert after != before
