"""tool_choice: constrained decoding yields one parseable call whose arguments validate against the schema."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import kda_sessions as ks
from kda_sessions.constrain.json_prefix import json_prefix
from kda_sessions.tokenizer import validate_arguments
from kda_sessions.tools import TOOL_SCHEMAS

SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "n": {"type": "integer"}, "mode": {"enum": ["r", "rw"]},
                   "tags": {"type": "array", "items": {"type": "string"}}, "x": {"type": "number"}},
    "required": ["path"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "text, status",
    [
        (b"", "incomplete"), (b'{"pa', "incomplete"), (b'{"path":"a"}', "complete"), (b'{"n":1}', "bad"),
        (b'{"path":"a","n":1.5', "bad"), (b'{"path": "a"}', "complete"),
        (b'{"path":  "a"}', "bad"), (b'{ "path":"a"}', "bad"), (b'{"path" :"a"}', "bad"), (b'{"path":"a" }', "bad"),
        (b'{"path": "a", "tags": ["x", "y"]}', "complete"), (b'{"path":"a", ', "incomplete"), (b'{"path":"a","mode":"w', "bad"),
        (b'{"path":"a","tags":["x",', "incomplete"), (b'{"path":"a","x":-1.5e+3}', "complete"),
        (b'{"path":"\\u00e9"}', "complete"), (b'{"path":"a","path', "bad"),
    ],
)
def test_json_prefix(text, status):
    assert json_prefix(text, SCHEMA)[0] == status


# One engine per model for the whole module, on the module's event loop (each test makes its own sessions): an
# engine per test only repeated the load.
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def random_engine() -> AsyncIterator[ks.Engine]:
    async with await ks.Engine.open(store="memory:") as eng:
        yield eng


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_engine() -> AsyncIterator[ks.Engine]:
    async with await ks.Engine.open(model="tiny", store="memory:") as eng:
        yield eng


@pytest.mark.parametrize(
    "choice, temperature",
    [("required", 0.0), ("grep", 1.0), ({"type": "function", "function": {"name": "read_file"}}, 0.0)],
    ids=["required-greedy", "named-sampled", "named-dict"],
)
@in_module_loop
async def test_forced_call_parses_and_validates(random_engine: ks.Engine, choice, temperature):
    s = await random_engine.create_session(system="agent", tools=TOOL_SCHEMAS)
    r = await s.send("look around", max_tokens=120, tool_choice=choice, temperature=temperature, seed=3)
    assert r.finish_reason == "tool_calls", r
    (call,) = r.tool_calls
    if choice != "required":
        want = choice if isinstance(choice, str) else choice["function"]["name"]
        assert call.function.name == want
    schema = next(t["function"]["parameters"] for t in TOOL_SCHEMAS if t["function"]["name"] == call.function.name)
    assert validate_arguments(call.function.arguments, schema) == []
    assert isinstance(json.loads(call.function.arguments), dict)
    # the turn is closed: the next message continues normally
    r2 = await s.send_tool_result(call.id, "result", max_tokens=4)
    assert r2.usage.prefill_tokens > 0


@in_module_loop
async def test_none_forbids_calls_and_bad_choices_are_refused(random_engine: ks.Engine):
    eng = random_engine
    s = await eng.create_session(tools=TOOL_SCHEMAS)
    r = await s.send("hi", max_tokens=30, tool_choice="none", ignore_eos=True)
    assert r.tool_calls == [] and eng.tokenizer.token_to_id("<|tool_calls_section_begin|>") not in r.token_ids
    before = s.num_tokens
    with pytest.raises(ValueError, match="not among the declared tools"):
        await s.send("hi", tool_choice="rm_rf")
    assert s.num_tokens == before
    bare = await eng.create_session()
    with pytest.raises(ValueError, match="needs tools"):
        await bare.send("hi", tool_choice="required")


@in_module_loop
@pytest.mark.parametrize("max_tokens", [40, 160])
async def test_forced_call_is_the_call_the_model_makes_freely(tiny_engine: ks.Engine, max_tokens):
    """`tiny` writes its arguments as json.dumps does ('": "'): a forced call must allow that spacing and must
    not steer the arguments to an early end while the budget still has room, so it equals the free call."""
    system, task = "You are a coding agent. Call tools to inspect files.", "What is the first entry of the project root?"
    calls = {}
    for choice in ("auto", "required", "list_dir"):
        s = await tiny_engine.create_session(system=system, tools=TOOL_SCHEMAS)
        kw = {} if choice == "auto" else {"tool_choice": choice}
        r = await s.send(task, max_tokens=max_tokens, **kw)
        calls[choice] = [(c.function.name, c.function.arguments) for c in r.tool_calls]
    assert calls["auto"] == [("list_dir", '{"path": "."}')]
    assert calls["required"] == calls["auto"] and calls["list_dir"] == calls["auto"]


@pytest.mark.gpu
async def test_seeded_sampled_forced_call_on_cuda_repeats():
    """On a GPU the logits stay on the device: a seeded draw (constrained or not) uses the request's generator
    there (admission makes it on the model's device), and the same seed gives the same call."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    async with await ks.Engine.open(store="memory:", device="cuda") as eng:
        got = []
        for _ in range(2):
            s = await eng.create_session(system="agent", tools=TOOL_SCHEMAS)
            r = await s.send("look around", max_tokens=120, tool_choice="grep", temperature=1.0, seed=3)
            assert r.finish_reason == "tool_calls", r
            free = await s.send_tool_result(r.tool_calls[0].id, "ok", max_tokens=8, temperature=0.9, seed=4,
                                            ignore_eos=True)
            got.append((r.tool_calls[0].function.arguments, free.token_ids))
        assert got[0] == got[1]
