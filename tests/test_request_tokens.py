"""The token tracker counts what every call carries besides its messages: the system prompt and
the tool schemas (``TokenTracker.set_request``), in the agent loop and at the wire."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline import Message, Pipeline, SessionContext, TokenTracker, Usage
from pipeline.agent import Agent
from pipeline.agent.results import TurnLog
from pipeline.dropin.adapter import WireSession
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.tools import Tool
from tests.sdk_support import sdk_client

SYSTEM = "You are a careful assistant. " * 40
TOOLS: list[dict[str, Any]] = [
    {
        "name": f"tool_{k}",
        "description": "Does one thing well, and explains it at length. " * 6,
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for k in range(6)
]


def _history() -> list[Message]:
    return [Message.user("hello there, please look at the repository")]


M = "claude-sonnet-4-5"
MORE_TOOLS: list[dict[str, Any]] = [
    {"name": f"extra{i}", "description": "does a thing " * 30, "input_schema": {"type": "object"}}
    for i in range(20)
]


def _reply(text: str, tokens: int, mid: str) -> Message:
    return Message.assistant(
        [{"type": "text", "text": text}],
        message_id=mid,
        usage=Usage(input_tokens=tokens, output_tokens=5),
        model=M,
    )


def test_a_first_call_counts_system_and_tools_whole() -> None:
    bare, told = TokenTracker(), TokenTracker()
    tokens = told.set_request(system=SYSTEM, tools=TOOLS)
    assert tokens > 500  # ~5K characters of prompt and schemas
    detail = told.estimate_detail(_history())
    assert detail.request_overhead == tokens
    assert detail.total == bare.estimate(_history()) + tokens
    assert detail.estimated_part == bare.estimate_detail(_history()).estimated_part + tokens


def test_text_blocks_as_system_price_like_the_string() -> None:
    a, b = TokenTracker(), TokenTracker()
    blocks = [{"type": "text", "text": SYSTEM[:500]}, {"type": "text", "text": SYSTEM[500:]}]
    assert abs(a.set_request(system=SYSTEM) - b.set_request(system=blocks)) <= 5
    assert TokenTracker().set_request() == 0


def test_after_a_response_only_a_change_of_system_or_tools_is_added() -> None:
    tracker = TokenTracker()
    tracker.set_request(system=SYSTEM, tools=TOOLS)
    first = _history()
    tracker.observe(first, Usage(input_tokens=3_000), model="claude-sonnet-4-5")
    history = [
        *first,
        _reply("sure", 3_000, "msg_1"),
        Message.user("next"),
    ]
    same = tracker.estimate_detail(history)
    assert same.request_overhead == 0  # the anchor's usage already counted them
    before = tracker.request_tokens
    assert before is not None
    grown = tracker.set_request(system=SYSTEM, tools=[*TOOLS, *TOOLS])
    detail = tracker.estimate_detail(history)
    assert detail.request_overhead == grown - before > 0
    assert detail.total == same.total + grown - before


def test_a_call_whose_tools_changed_is_not_learned_from() -> None:
    tracker = TokenTracker()
    tracker.set_request(system=SYSTEM, tools=TOOLS)
    first = _history()
    tracker.observe(first, Usage(input_tokens=3_000), model="claude-sonnet-4-5")
    history = [
        *first,
        _reply("ok", 3_000, "msg_1"),
        Message.user("x " * 3_000),
    ]
    tracker.set_request(system=SYSTEM, tools=TOOLS[:2])
    obs = tracker.observe(history, Usage(input_tokens=5_500), model="claude-sonnet-4-5")
    assert not obs.learned and obs.reason == "system prompt or tools changed"
    history2 = [
        *history,
        _reply("ok", 5_500, "msg_2"),
        Message.user("y " * 3_000),
    ]
    obs = tracker.observe(history2, Usage(input_tokens=8_000), model="claude-sonnet-4-5")
    assert obs.learned  # unchanged since: learned again


def test_an_equal_copy_keeps_the_price_and_a_change_reprices() -> None:
    tracker = TokenTracker()
    tokens = tracker.set_request(system=SYSTEM, tools=TOOLS)
    copy = [dict(t) for t in TOOLS]
    assert tracker.set_request(system=SYSTEM, tools=copy) == tokens
    assert tracker.set_request(system=SYSTEM + "One more rule.", tools=copy) > tokens


def _script(body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "done"}])


@pytest.mark.asyncio
async def test_the_agent_counts_its_system_prompt_and_tools(tmp_path: Path) -> None:
    """The scripted server's usage counts the whole request; the first estimate, made before
    any usage is known, is close to it only when system and tools are counted."""

    async def noop(path: str) -> str:
        return path

    tools = [
        Tool(
            name=t["name"],
            description=t["description"],
            input_schema=t["input_schema"],
            handler=noop,
        )
        for t in TOOLS
    ]
    logs: dict[str, TurnLog] = {}
    with ScriptedMessagesServer(_script) as server:
        for name, system, given in (("bare", None, []), ("told", SYSTEM, tools)):
            client = sdk_client(server.base_url)
            ctx = SessionContext(f"s-{name}", tmp_path / name)
            agent = Agent(
                client,
                model="claude-sonnet-4-5",
                pipeline=Pipeline([]),
                ctx=ctx,
                tools=given,
                system=system,
                readback=False,
                on_turn=lambda log, name=name: logs.__setitem__(name, log),  # type: ignore[misc]
            )
            await agent.run("look at the repository and report")
            if name == "told":
                assert ctx.token_tracker.request_tokens == TokenTracker().set_request(
                    system=SYSTEM, tools=agent.tool_definitions
                )
    told, bare = logs["told"], logs["bare"]
    actual = told.usage.input_side
    assert actual > bare.usage.input_side + 1_000  # the server did count system and tools
    assert abs(told.estimated_tokens - actual) / actual < 0.35
    assert told.estimated_tokens - bare.estimated_tokens > 800
    assert told.observation is not None
    assert told.observation.estimate == told.estimated_tokens  # the same estimate, reported


@pytest.mark.asyncio
async def test_the_wire_session_counts_the_requests_system_and_tools(tmp_path: Path) -> None:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello"}],
    }
    plain = WireSession("a" * 8, tmp_path / "a", Pipeline([]))
    await plain.prepare_request(body)
    told = WireSession("b" * 8, tmp_path / "b", Pipeline([]))
    await told.prepare_request({**body, "system": SYSTEM, "tools": TOOLS})
    tokens = told.ctx.token_tracker.request_tokens
    assert tokens is not None and tokens > 500
    assert plain.ctx.token_tracker.request_tokens == 0
    diff = told.ctx.report.estimated_tokens - plain.ctx.report.estimated_tokens
    assert diff == tokens


def test_tools_added_before_a_compaction_are_counted_after_it() -> None:
    """The no-anchor overhead was measured with the old tools: the new ones come on top."""
    tracker = TokenTracker()
    tracker.set_request(system=SYSTEM, tools=[])
    first = [Message.user("hello " * 50)]
    tracker.observe(first, Usage(input_tokens=900), model=M)
    before = tracker.request_tokens
    grown = tracker.set_request(system=SYSTEM, tools=MORE_TOOLS)
    assert before is not None and grown - before > 1_000
    history = [*first, _reply("hi", 900, "m1"), Message.user("more " * 50)]
    tracker.observe(history, Usage(input_tokens=900 + 80 + grown - before), model=M)
    after = [
        Message("system", "Conversation compacted", subtype="compact_boundary"),
        Message.user("summary " * 40, is_compact_summary=True),
        Message.user("go on"),
    ]
    detail = tracker.estimate_detail(after)
    assert detail.request_overhead == grown - before


def test_a_resumed_tracker_still_sees_a_change_of_tools() -> None:
    history = [Message.user("hello " * 50), _reply("hi", 400, "m1"), Message.user("more " * 50)]
    results = []
    for resume in (False, True):
        tracker = TokenTracker()
        tracker.set_request(system="sys", tools=[])
        tracker.observe(history[:1], Usage(input_tokens=400), model=M)
        if resume:
            tracker = TokenTracker.from_state_dict(json.loads(json.dumps(tracker.state_dict())))
        tokens = tracker.set_request(system="sys", tools=MORE_TOOLS)
        detail = tracker.estimate_detail(history)
        obs = tracker.observe(history, Usage(input_tokens=470 + tokens), model=M)
        results.append((detail.request_overhead, obs.learned, obs.reason))
    assert results[0] == results[1]
    assert results[0][0] > 1_000 and results[0][1] is False


def test_a_state_saved_before_the_request_existed_still_loads() -> None:
    state = TokenTracker().state_dict()
    del state["request"]
    assert TokenTracker.from_state_dict(state).request.seen is None
    state["request"] = {"seen": -1, "at_overhead": None}
    with pytest.raises(ValueError):
        TokenTracker.from_state_dict(state)


def test_an_unchanged_prompt_keeps_its_price_as_the_session_learns() -> None:
    tracker = TokenTracker()
    system = "You are a coding agent. Follow the rules. " * 300
    start = tracker.set_request(system=system + "date: 2026-01-01", tools=[])
    history = [Message.user("hello " * 50)]
    total = 4_000
    tracker.observe(history, Usage(input_tokens=total), model=M)
    for i in range(30):  # this session's prose costs 1.6x what the priors say
        history = [*history, _reply("ok", total, f"m{i}"), Message.user("word " * 400)]
        total += int(tracker.estimate_detail(history).estimated_part * 1.6)
        tracker.observe(history, Usage(input_tokens=total), model=M)
    assert tracker.ratios()["prose"]["multiplier"] > 1.05  # it did learn
    assert abs(tracker.set_request(system=system + "date: 2026-01-02", tools=[]) - start) <= 2


@pytest.mark.parametrize("tools", [5, True, "tool", {"name": "x"}, None])
def test_a_request_with_hostile_tools_counts_only_its_system(tools: Any) -> None:
    assert TokenTracker().set_request(
        system="sys prompt", tools=tools
    ) == TokenTracker().set_request(system="sys prompt")


def test_equal_new_objects_keep_the_price_and_the_tracker_follows_them() -> None:
    """Each proxied request parses its own system and tools: equal new objects are not priced
    again, and an edit after them is."""
    tracker = TokenTracker()
    tokens = tracker.set_request(system=SYSTEM, tools=TOOLS)
    copy = json.loads(json.dumps(TOOLS))
    assert tracker.set_request(system=str(SYSTEM), tools=copy) == tokens
    edited = json.loads(json.dumps(copy))  # a change comes as new objects, as a request does
    edited[0]["description"] += " And one more sentence about it."
    assert tracker.set_request(system=SYSTEM, tools=edited) > tokens
