"""Traces an operator can answer questions from: decision spans named after the decision and
self-contained, a result executed in one turn and persisted in the next linked across the two,
one trace per replayed call linked to the session's, GenAI agent and tool spans without the
SDK's usage repeated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from pipeline import Message, Pipeline, SessionContext, ToolPolicies, Usage
from pipeline.agent import Agent
from pipeline.testing import Reply, ScriptedMessagesServer, SpanRecorder
from pipeline.tools import Tool
from pipeline.tracing import ATTR, SPAN_REPLAY, SPAN_REPLAY_CALL
from pipeline.transcript.replay import replay_messages
from stages import ToolResultBudget, default_stages
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.sdk_support import sdk_client

LOG = 40_000  # six of them: 240K, over the 200K per-message budget, each under the 50K cap


def _parallel_history() -> list[Message]:
    return [
        user_text("read the six logs"),
        assistant(
            "msg_1",
            *(tool_use(f"t{i}", "get_log") for i in range(6)),
            usage=Usage(input_tokens=100, output_tokens=10),
        ),
        results(*(tool_result(f"t{i}", f"{i} " * (LOG // 2)) for i in range(6))),
    ]


@pytest.mark.asyncio
async def test_decision_spans_answer_why_under_which_limit_and_what_instead(
    tmp_path: Path,
) -> None:
    spans = SpanRecorder()
    ctx = SessionContext(
        "s1", tmp_path, tracer=spans.tracer, tool_policies=ToolPolicies.claude_code()
    )
    await Pipeline([ToolResultBudget()]).run(_parallel_history(), ctx)
    decisions = spans.decisions("tool_result_budget")
    names = sorted({s.name for s in decisions})
    assert names == ["tool_result_budget.keep", "tool_result_budget.persist"]
    for s in decisions:
        a = s.attributes or {}
        assert a[ATTR.TOOL_NAME] == "get_log" and str(a[ATTR.TOOL_CALL_ID]).startswith("t")
        assert a[ATTR.CHARS] == LOG
        assert a[ATTR.LIMIT] == a[ATTR.LIMIT_PER_MESSAGE] == 200_000
        assert a[ATTR.LIMIT_PER_TOOL] == 50_000
        assert all(type(a[k]) is int for k in (ATTR.LIMIT, ATTR.LIMIT_PER_TOOL))  # not 2e5
        assert a[ATTR.GROUP_CHARS] == 6 * LOG and a[ATTR.GROUP_CANDIDATES] == 6
        assert a[ATTR.FRESH_CHARS] == 6 * LOG and a[ATTR.FROZEN_CHARS] == 0
        assert a[ATTR.REASON] == "per_message"  # the limit that decided, kept or persisted
        assert a[ATTR.CHARS_OVER] == 6 * LOG - 200_000  # how far over its message was
        if s.name.endswith(".persist"):
            assert Path(str(a[ATTR.PATH])).is_file()
            shown = int(a[ATTR.REPLACEMENT_CHARS])
            assert 0 < shown < 3_000  # the preview and the path
            assert a[ATTR.CHARS_FREED] == LOG - shown
        else:
            assert ATTR.PATH not in a and ATTR.CHARS_FREED not in a
    persisted = [s for s in decisions if s.name.endswith(".persist")]
    assert len(persisted) == 1  # 240K - 40K = 200K: within the 200K budget
    # no content in any span
    for s in spans.spans:
        for value in (s.attributes or {}).values():
            assert "0 0 0" not in str(value)


async def _run_agent(
    script: Callable[[dict[str, Any]], Reply], ctx: SessionContext, tool: Tool, prompt: str
) -> None:
    """An agent with ``tool`` and the default stages, run on ``prompt`` against ``script``."""
    with ScriptedMessagesServer(script) as server:
        agent = Agent(
            sdk_client(server.base_url),
            model="claude-sonnet-4-5",
            pipeline=Pipeline(default_stages()),
            ctx=ctx,
            tools=[tool],
            readback=False,
        )
        await agent.run(prompt)


def _six_logs(body: dict[str, Any]) -> Reply:
    if any(m["role"] == "assistant" for m in body["messages"]):
        return Reply([{"type": "text", "text": "done"}])
    return Reply(
        [
            {"type": "tool_use", "id": f"toolu_{i}", "name": "get_log", "input": {"n": i}}
            for i in range(6)
        ]
    )


@pytest.mark.asyncio
async def test_an_agent_run_is_a_genai_agent_span_and_links_execution_to_decision(
    tmp_path: Path,
) -> None:
    async def get_log(n: int) -> str:
        return f"{n} " * (LOG // 2)

    log_tool = Tool(
        name="get_log",
        description="a CI job's log",
        input_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
        handler=lambda args: get_log(int(args["n"])),
    )
    spans = SpanRecorder()
    ctx = SessionContext(
        "s-agent", tmp_path, tracer=spans.tracer, tool_policies=ToolPolicies.claude_code()
    )
    await _run_agent(_six_logs, ctx, log_tool, "read the six logs")
    [run] = [s for s in spans.spans if s.name == "invoke_agent sluicegate"]
    assert (run.attributes or {})[ATTR.OPERATION_NAME] == "invoke_agent"
    assert (run.attributes or {})[ATTR.AGENT_NAME] == "sluicegate"
    turns = spans.named("agent.turn")
    assert [(t.attributes or {})[ATTR.CALL] for t in turns] == [0, 1]
    for t in turns:
        assert t.parent is not None and t.parent.span_id == run.context.span_id
        assert not any(k.startswith("gen_ai.usage.") for k in (t.attributes or {}))
        assert int((t.attributes or {})[ATTR.INPUT_SIDE_TOKENS]) > 0
    tools = [s for s in spans.spans if s.name == "execute_tool get_log"]
    assert len(tools) == 6 and all((s.attributes or {})[ATTR.CALL] == 0 for s in tools)
    by_id = {(s.attributes or {})[ATTR.TOOL_CALL_ID]: s for s in tools}
    persisted = [s for s in spans.decisions("tool_result_budget") if s.name.endswith(".persist")]
    assert len(persisted) == 1
    for d in persisted:
        a = d.attributes or {}
        assert a[ATTR.CALL] == 1 and a[ATTR.EXECUTED_IN_CALL] == 0  # ran in turn 0, persisted in 1
        executed = by_id[a[ATTR.TOOL_CALL_ID]]
        assert [link.context.span_id for link in d.links] == [executed.context.span_id]
        assert d.context.trace_id == executed.context.trace_id  # one run, one trace
    # every span of the second turn's pass carries its number
    second = [s for s in spans.spans if (s.attributes or {}).get(ATTR.CALL) == 1]
    assert {s.name for s in second} >= {"pipeline.run", "stage.tool_result_budget", "agent.turn"}


@pytest.mark.asyncio
async def test_a_replay_is_one_trace_per_call_linked_to_the_session(tmp_path: Path) -> None:
    history: list[Message] = []
    for k in range(12):
        history += [
            user_text(f"step {k}"),
            assistant(
                f"msg_{k}",
                *(tool_use(f"t{k}_{i}", "get_log") for i in range(3)),
                usage=Usage(input_tokens=1_000 * (k + 1), output_tokens=10),
            ),
            results(*(tool_result(f"t{k}_{i}", f"{k}{i} " * 15_000) for i in range(3))),
        ]
    history.append(assistant("msg_end", {"type": "text", "text": "done"}, usage=Usage(1, 1)))
    spans = SpanRecorder()
    ctx = SessionContext(
        "s-replay", tmp_path, tracer=spans.tracer, tool_policies=ToolPolicies.claude_code()
    )
    with spans.tracer.start_as_current_span(SPAN_REPLAY) as session:
        count = 0
        async for _ in replay_messages(history, Pipeline(default_stages()), ctx):
            count += 1
        session_context = session.get_span_context()
    calls = spans.named(SPAN_REPLAY_CALL)
    assert len(calls) == count == 13
    assert len({c.context.trace_id for c in calls}) == 13  # a trace per call
    assert session_context.trace_id not in {c.context.trace_id for c in calls}
    for number, c in enumerate(calls):
        assert c.parent is None  # a root
        assert [link.context.span_id for link in c.links] == [session_context.span_id]
        assert (c.attributes or {})[ATTR.CALL] == number
        members = [s for s in spans.spans if s.context.trace_id == c.context.trace_id]
        assert all((s.attributes or {}).get(ATTR.CALL) == number for s in members)
        assert len(members) <= 60  # small enough for a trace UI
    assert trace.get_current_span().get_span_context().is_valid is False


@pytest.mark.asyncio
async def test_hostile_ids_and_names_are_bounded_on_spans(tmp_path: Path) -> None:
    long_id, long_name = "t" + "x" * 100_000, "n" * 100_000
    history = [
        user_text("go"),
        assistant("m" * 100_000, tool_use(long_id, long_name), usage=Usage(10, 1)),
        results(tool_result(long_id, "y" * 60_000)),
        assistant("msg_2", {"type": "text", "text": "ok"}, usage=Usage(20, 1)),
    ]
    spans = SpanRecorder()
    ctx = SessionContext("s-long", tmp_path, tracer=spans.tracer)
    async for _ in replay_messages(history, Pipeline(default_stages()), ctx):
        pass
    longest = max(len(str(v)) for s in spans.spans for v in (s.attributes or {}).values())
    assert longest <= 4_096  # ids and names cut at 256; a store path is the longest left
    assert max(len(s.name) for s in spans.spans) < 300


SECRET = "MY-SECRET-PROMPT"


async def _quoting_stage(messages: list[Message], ctx: SessionContext) -> list[Message]:
    # a third-party stage whose error quotes the content it choked on
    last = messages[-1].content
    raise ValueError(f"could not parse: {last}")


@pytest.mark.asyncio
async def test_an_error_that_quotes_content_reaches_no_span_of_a_replay(tmp_path: Path) -> None:
    from pipeline.core import FunctionStage, StageError

    history = [
        user_text(SECRET),
        assistant("msg_1", {"type": "text", "text": "ok"}, usage=Usage(10, 1)),
    ]
    spans = SpanRecorder()
    ctx = SessionContext("s-err", tmp_path, tracer=spans.tracer)
    pipe = Pipeline([FunctionStage("quoting", _quoting_stage)])
    with pytest.raises(StageError, match=SECRET):  # the caller gets the whole story
        async for _ in replay_messages(history, pipe, ctx):
            pass
    [call] = spans.named(SPAN_REPLAY_CALL)
    assert call.status.status_code == trace.StatusCode.ERROR
    assert call.status.description == "StageError"
    assert spans.holding(SECRET) == []  # the spans only the error's type


@pytest.mark.asyncio
async def test_a_tool_error_that_quotes_content_reaches_no_span(tmp_path: Path) -> None:
    # a tool that fails with the input in its message: the model is told (an error result),
    # no span is
    async def leaky(args: dict[str, Any]) -> str:
        raise RuntimeError(f"failed on {args['q']}")

    tool = Tool(
        name="leaky",
        description="fails",
        input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
        handler=leaky,
    )

    def script(body: dict[str, Any]) -> Reply:
        if any(m["role"] == "assistant" for m in body["messages"]):
            return Reply([{"type": "text", "text": "done"}])
        return Reply(
            [{"type": "tool_use", "id": "toolu_1", "name": "leaky", "input": {"q": SECRET}}]
        )

    spans = SpanRecorder()
    await _run_agent(script, SessionContext("s-tool", tmp_path, tracer=spans.tracer), tool, "go")
    assert spans.named("execute_tool leaky")
    assert spans.holding(SECRET) == []
