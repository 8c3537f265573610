"""Admission (sessions/admission.py) with a fake core and residency (no model): a bad request is refused before
the session or the pools change; an admitted one reserves its worst case when the engine is idle, its prompt and
first token when it is busy; a work with nothing to run finishes at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kda_sessions.constrain.json_reply import JsonReplyConstraint
from kda_sessions.constrain.tool_choice import ToolChoiceConstraint
from kda_sessions.engine.pool import pages_needed
from kda_sessions.engine.scheduler import Work
from kda_sessions.sessions.admission import Admission
from kda_sessions.sessions.state import Checkpoint, SessionState
from kda_sessions.tokenizer.byte import ByteTokenizer
from kda_sessions.types import SamplingParams

P = 4  # page size
NUM_PAGES = 32  # capacity: 128 tokens
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@dataclass
class FakeCore:
    busy: bool = False
    config: Any = field(default_factory=lambda: SimpleNamespace(num_pages=NUM_PAGES, page_size=P))
    submitted: list[tuple[Work, int]] = field(default_factory=list)
    device: str = "cpu"

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, P)

    def submit(self, work: Work, reserve: int) -> None:
        self.submitted.append((work, reserve))


@dataclass
class FakeResidency:
    calls: list[tuple[str, int]] = field(default_factory=list)

    async def make_resident(self, s: SessionState) -> None:
        self.calls.append(("resident", 0))
        s.slot = 0

    async def ensure_pages(self, s: SessionState, total_tokens: int) -> None:
        self.calls.append(("pages", total_tokens))


class FakePrefixCache:
    """No other session holds a prefix, no interval checkpoints: admission's own decisions stay in view."""

    def __init__(self, res: FakeResidency) -> None:
        self.res = res

    async def reuse(self, s: SessionState, end: int) -> int:
        self.res.calls.append(("reuse", end))
        return 0

    def interval_checkpoints(self, s: SessionState, end: int, others: int) -> list[Checkpoint]:
        return []


def admission(busy: bool = False) -> tuple[Admission, FakeCore, FakeResidency]:
    core, res = FakeCore(busy=busy), FakeResidency()
    return Admission(core, res, ByteTokenizer(), FakePrefixCache(res)), core, res  # type: ignore[arg-type]


def session(num_tokens: int = 10, num_cached: int = 4, pages: int = 1, tools: Any = None) -> SessionState:
    return SessionState(id="s", tokens=list(range(40, 40 + num_tokens)), num_cached=num_cached,
                        pages=list(range(pages)), tools=tools)


@pytest.mark.parametrize(
    ("kwargs", "params", "match"),
    [
        ({}, SamplingParams(max_tokens=119), "exceeds this engine's KV capacity of 128 tokens"),
        ({"tool_choice": "required"}, SamplingParams(), "needs tools declared"),
        ({"tool_choice": "nope"}, SamplingParams(), "not among the declared tools"),
        ({"response_format": {"type": "xml"}}, SamplingParams(), "response_format.type"),
        ({"response_format": {"type": "json_object"}, "tool_choice": "get_time", "tools": TOOLS}, SamplingParams(),
         "cannot be combined"),
    ],
    ids=["capacity", "required-without-tools", "unknown-tool", "bad-format", "format-and-forced-tool"],
)
async def test_a_bad_request_is_refused_before_anything_changes(kwargs, params, match) -> None:
    adm, core, res = admission()
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    s = session(tools=tools)
    with pytest.raises(ValueError, match=match):
        await adm.start(s, params, **kwargs)
    assert res.calls == [] and core.submitted == [] and s.slot is None


async def test_nothing_to_continue_from_is_refused() -> None:
    adm, core, res = admission()
    with pytest.raises(ValueError, match="no tokens to continue from"):
        await adm.start(session(num_tokens=4, num_cached=4), SamplingParams())
    assert res.calls == [] and core.submitted == []


@pytest.mark.parametrize(("busy", "admit"), [(False, 10 + 8), (True, 10 + 1)], ids=["idle-worst-case", "busy-least"])
async def test_pages_for_the_worst_case_when_idle_and_the_first_token_when_busy(busy: bool, admit: int) -> None:
    adm, core, res = admission(busy)
    s = session(num_tokens=10, num_cached=4, pages=1)
    pending = Checkpoint(name="msg-1", position=8, state_pos=0)  # its state is still to be captured
    done = Checkpoint(name="msg-0", position=3, state_pos=2)
    s.checkpoints = {"msg-0": done, "msg-1": pending}
    extra = Checkpoint(name="mine", position=10, state_pos=0)
    work = await adm.start(s, SamplingParams(max_tokens=8), checkpoints=[extra])
    assert res.calls == [("resident", 0), ("reuse", 10), ("pages", admit)]
    assert core.submitted == [(work, pages_needed(admit, P) - 1)]
    assert work.prompt == s.tokens[4:10] and work.prompt_len == 6 and not work.prefill_only
    assert work.checkpoints == [pending, extra]
    assert work.constraint is None and work.generator is None


async def test_prefill_only_leaves_the_last_token_to_whoever_continues() -> None:
    adm, core, _ = admission()
    s = session(num_tokens=10, num_cached=4, pages=0)
    work = await adm.start(s, SamplingParams(max_tokens=30, seed=5), prefill_only=True)  # max_tokens unused
    assert work.prompt == s.tokens[4:9] and core.submitted == [(work, pages_needed(10, P))]
    assert work.generator is not None and work.generator.initial_seed() == 5


async def test_a_work_with_no_prompt_finishes_at_once() -> None:
    adm, core, _ = admission()
    finished: list[bool] = []
    s = session(num_tokens=5, num_cached=4)
    work = await adm.start(s, SamplingParams(), prefill_only=True, on_finish=lambda: finished.append(True))
    assert work.finished.is_set() and work.finish_reason == "stop" and finished == [True]
    assert core.submitted == []


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [({"response_format": {"type": "json_object"}}, JsonReplyConstraint), ({"tool_choice": "get_time"}, ToolChoiceConstraint),
     ({"tool_choice": "none"}, ToolChoiceConstraint), ({"tool_choice": "auto"}, type(None))],
    ids=["json", "forced-tool", "no-tool", "auto"],
)
async def test_constraints_follow_tool_choice_and_response_format(kwargs, kind) -> None:
    adm, _, _ = admission()
    work = await adm.start(session(tools=TOOLS), SamplingParams(), **kwargs)
    assert type(work.constraint) is kind
