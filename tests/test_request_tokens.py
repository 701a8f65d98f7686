"""The token tracker counts what every call carries besides its messages: the system prompt and
the tool schemas (``TokenTracker.set_request``), in the agent loop and at the wire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest

from pipeline import Message, Pipeline, SessionContext, TokenTracker, Usage
from pipeline.adapter import WireSession
from pipeline.agent import Agent
from pipeline.agent.results import TurnLog
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.tools import Tool

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
        Message.assistant(
            [{"type": "text", "text": "sure"}],
            message_id="msg_1",
            usage=Usage(input_tokens=3_000, output_tokens=5),
            model="claude-sonnet-4-5",
        ),
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
        Message.assistant(
            [{"type": "text", "text": "ok"}],
            message_id="msg_1",
            usage=Usage(input_tokens=3_000, output_tokens=2),
            model="claude-sonnet-4-5",
        ),
        Message.user("x " * 3_000),
    ]
    tracker.set_request(system=SYSTEM, tools=TOOLS[:2])
    obs = tracker.observe(history, Usage(input_tokens=5_500), model="claude-sonnet-4-5")
    assert not obs.learned and obs.reason == "system prompt or tools changed"
    history2 = [
        *history,
        Message.assistant(
            [{"type": "text", "text": "ok"}],
            message_id="msg_2",
            usage=Usage(input_tokens=5_500, output_tokens=2),
            model="claude-sonnet-4-5",
        ),
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
            client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="k", max_retries=0)
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
