"""Admission checks: every sampling setting and tool schema the engine accepts can be decoded; the rest is a
ValueError naming the field, raised before the session changes (issue 24, points 1 and 2)."""

from __future__ import annotations

import math

import pytest
import torch

import kda_sessions as ks
from kda_sessions.constrain.json_prefix import check_schema, json_prefix
from kda_sessions.constrain.tool_choice import check_tools
from kda_sessions.engine.sampler import SamplingParams, sample


def tool(parameters: object) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1e-45), dict(temperature=1e-300, top_p=0.5), dict(temperature=1.0, top_p=1e-300),
     dict(temperature=1e-30, top_k=3), dict(temperature=2.0, top_p=1e-9, top_k=1)],
    ids=["tiny-temperature", "tiny-temperature-top-p", "tiny-top-p", "tiny-temperature-top-k", "top-k-1"],
)
def test_extreme_accepted_settings_sample_the_argmax(params):
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 40
    tok, lp = sample(logits, SamplingParams(**params), torch.Generator().manual_seed(1))
    assert tok == int(torch.argmax(logits)) and math.isfinite(lp)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("top_p", math.nan),
     ("top_p", 0.0), ("top_k", -1), ("max_tokens", 0), ("seed", 2**64), ("stop", [3])],
)
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "parameters, field",
    [({"type": []}, "parameters.type"), ({"type": "banana"}, "parameters.type"),
     ({"additionalProperties": False, "required": ["a"]}, "parameters.required"),
     ({"type": "object", "properties": {"a": {"type": "banana"}}}, "properties.a.type"),
     ({"type": "object", "properties": {"a": 5}}, "properties.a"), ({"enum": []}, "parameters.enum"),
     ({"type": "array", "items": {"type": []}}, "items.type"), ("object", "parameters"),
     ({"type": "object", "properties": {"a": {"type": "object", "properties": {}, "additionalProperties": False,
                                              "required": ["x"]}}}, "properties.a.required")],
    ids=["empty-type", "unknown-type", "required-forbidden", "nested-unknown", "property-not-schema", "empty-enum",
         "items-empty-type", "not-an-object", "nested-required-forbidden"],
)
def test_schemas_that_admit_no_value_are_refused(parameters, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_tools([tool(parameters)])
    # the decoder's automaton itself never raises on them
    if isinstance(parameters, dict):
        assert json_prefix(b"", parameters)[0] in ("bad", "incomplete")


def test_a_required_name_outside_properties_is_decodable():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
    check_schema(schema)
    assert json_prefix(b'{"b":1}', schema)[0] == "complete"


async def test_engine_refuses_at_admission_and_tiny_temperature_decodes_greedily():
    async with await ks.Engine.open(store="memory:") as eng:
        with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters\.type"):
            await eng.create_session(system="x", tools=[tool({"type": "banana"})])
        assert not eng.sessions
        s = await eng.create_session(system="You answer.")
        before = s.num_tokens
        with pytest.raises(ValueError, match="response_format"):
            await s.send("hi", max_tokens=4, response_format={"type": "json_schema", "json_schema": {"schema": {"type": []}}})
        assert s.num_tokens == before and not s.messages[1:]
        greedy = await s.fork()
        r_tiny = await s.send("hi", max_tokens=6, temperature=1e-45, top_p=1e-300, ignore_eos=True)
        r_greedy = await greedy.send("hi", max_tokens=6, temperature=0.0, ignore_eos=True)
        assert r_tiny.token_ids == r_greedy.token_ids


def test_a_tool_whose_arguments_cannot_be_an_object_is_refused():
    with pytest.raises(ValueError, match=r"parameters\.type must allow 'object'"):
        check_tools([tool({"type": "integer"})])
    with pytest.raises(ValueError, match="top level"):
        from kda_sessions.constrain.json_prefix import check_top_level

        check_top_level({"type": ["string", "number"]}, "response_format.json_schema.schema")


def test_a_free_key_may_not_repeat_and_required_names_are_reached():
    schema = {"type": "object", "additionalProperties": True}
    status, allowed = json_prefix(b'{"a":1,"a', schema)
    assert status == "incomplete" and ord('"') not in allowed  # "a" again would leave no valid byte


@pytest.mark.parametrize("parameters", [{"required": ["a"]}, {}, {"type": ["object", "integer"]},
                                        {"properties": {"x": {"type": "integer"}}, "required": ["x", "y"]}],
                         ids=["required-only", "empty", "object-or-integer", "required-beyond-properties"])
async def test_forced_calls_finish_for_schemas_that_once_stalled(parameters):
    async with await ks.Engine.open(store="memory:") as eng:
        s = await eng.create_session(system="s", tools=[tool(parameters)])
        r = await s.send("x", max_tokens=40, tool_choice="required", temperature=1.0, seed=3)
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
        from kda_sessions.tokenizer import validate_arguments

        assert validate_arguments(r.tool_calls[0].function.arguments, parameters) == []
