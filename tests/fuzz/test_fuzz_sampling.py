"""hypothesis on admission and isolation (issue 24): any sampling settings and any tool schema, co-batched with
victims. A setting or schema is either refused at admission with a ValueError naming the field, or its request
completes; either way the victims complete with the tokens they produce alone and pools equal to a fresh prefill
of their tokens. Short by default; ``-m slow`` runs many more examples."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from engine.isolation_helpers import assert_equals_fresh_prefill, collect, one_step, prompt, wait_queued
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_sessions as ks

SHORT = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LONG = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-45, 5e-324, 1e-300, 1e-30, 1e-6, 1e-5, 0.5, 1.0, 2.0, -0.0, -1e-9]),
)
sampling = st.fixed_dictionaries({}, optional={
    "temperature": floats, "top_p": floats, "top_k": st.integers(-2, 400),
    "seed": st.one_of(st.none(), st.integers(-(2**65), 2**65)),
    "max_tokens": st.integers(-1, 40),
    "stop": st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=3)),
})

type_names = st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null", "banana"])
leaf = st.fixed_dictionaries({}, optional={
    "type": st.one_of(type_names, st.lists(type_names, max_size=3)),
    "enum": st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3),
})
schemas = st.recursive(
    leaf,
    lambda inner: st.fixed_dictionaries({}, optional={
        "type": st.one_of(type_names, st.lists(type_names, max_size=2)),
        "properties": st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=2), inner, max_size=3),
        "required": st.lists(st.text(alphabet="abcd", min_size=1, max_size=2), max_size=2),
        "additionalProperties": st.one_of(st.booleans(), inner),
        "items": inner,
    }),
    max_leaves=6,
)

@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[BlockingPortal, ks.Engine, list[list[int]]]]:
    """One engine for every example, on an event loop of its own; and what the victims generate alone."""
    with start_blocking_portal() as portal:
        eng = portal.call(lambda: ks.Engine.open(store="memory:", page_size=16))
        try:
            yield portal, eng, portal.call(_victims_alone, eng)
        finally:
            portal.call(eng.close)


async def _victims_alone(eng: ks.Engine) -> list[list[int]]:
    out = []
    for i in range(2):
        s = await eng.create_session()
        await s.append(prompt(i))
        out.append((await s.generate(max_tokens=6, ignore_eos=True)).token_ids)
        await eng.delete_session(s.id)
    return out


async def _co_batched(eng: ks.Engine, want: list[list[int]], culprit_call: str, culprit_args: dict[str, Any]) -> None:
    victims = []
    for i in range(2):
        v = await eng.create_session()
        await v.append(prompt(i))
        victims.append(v)
    out: dict[str, Any] = {}
    go = collect(out)

    tools = None
    if culprit_call == "tool":
        tools = [{"type": "function", "function": {"name": "f", "parameters": culprit_args}}]
    try:
        c = await eng.create_session(system="s", tools=tools)
    except ValueError as e:  # refused at admission, naming the schema's field
        assert "tools[0].function.parameters" in str(e)
        return
    await c.append(prompt(5, 10))
    async with anyio.create_task_group() as tg:
        with one_step(eng):
            for i, v in enumerate(victims):
                tg.start_soon(go, f"v{i}", lambda v=v: v.generate(max_tokens=6, ignore_eos=True))
            if culprit_call == "tool":
                tg.start_soon(go, "c", lambda: c.send("x", max_tokens=30, tool_choice="required", temperature=1.0, seed=1))
            else:
                tg.start_soon(go, "c", lambda: c.generate(**culprit_args))
            with anyio.move_on_after(2):
                await wait_queued(eng, 3)
    culprit = out["c"]
    if isinstance(culprit, ValueError):
        assert any(f in str(culprit) for f in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop")), culprit
    else:
        assert isinstance(culprit, ks.Reply), culprit  # admitted: it completes
        await assert_equals_fresh_prefill(eng, c)
    for i, v in enumerate(victims):
        assert isinstance(out[f"v{i}"], ks.Reply), out
        assert out[f"v{i}"].token_ids == want[i]
        await assert_equals_fresh_prefill(eng, v)
    for s in [*victims, c]:
        await eng.delete_session(s.id)


Env = tuple[BlockingPortal, ks.Engine, list[list[int]]]


def _check(env: Env, call: str, args: dict[str, Any]) -> None:
    portal, eng, want = env
    portal.call(_co_batched, eng, want, call, args)


@SHORT
@given(args=sampling)
def test_any_sampling_settings_leave_victims_whole(engine, args):
    _check(engine, "generate", args)


@SHORT
@given(schema=schemas)
def test_any_tool_schema_leaves_victims_whole(engine, schema):
    _check(engine, "tool", schema)


@pytest.mark.slow
@LONG
@given(args=sampling)
def test_any_sampling_settings_leave_victims_whole_long(engine, args):
    _check(engine, "generate", args)


@pytest.mark.slow
@LONG
@given(schema=schemas)
def test_any_tool_schema_leaves_victims_whole_long(engine, schema):
    _check(engine, "tool", schema)

