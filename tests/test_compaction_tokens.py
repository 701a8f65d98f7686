"""A server compaction block is where the API's view starts: the token tracker prices what
follows it, its usage anchor is the last sampling iteration, and the block goes back to the
API as it came (the real SDK through ``wrap``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, SessionContext, Usage
from pipeline.dropin.wrap import wrap
from pipeline.messages import context_start
from pipeline.testing import Reply, ScriptedMessagesServer, compaction_reply
from pipeline.tokens import TokenTracker
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use
from tests.sdk_support import sdk_client

SUMMARY = "The user asked for a build; it failed on a missing header, fixed in foo.h."
COMPACTION = {"type": "compaction", "content": SUMMARY}
ITERATIONS = dict(
    compaction_reply(
        SUMMARY,
        [{"type": "text", "text": "Carrying on."}],
        compacted_tokens=26_000,
        summary_tokens=900,
        context_tokens=400,
        output_tokens=60,
    ).usage
    or {}
)


def test_the_usage_of_a_compacting_response_is_its_last_sampling_iteration() -> None:
    usage = Usage.from_mapping(ITERATIONS)
    assert (usage.input_tokens, usage.output_tokens) == (400, 60)
    # paused after the compaction: the context is the summary, never the summarising request
    paused = compaction_reply(SUMMARY).usage
    assert paused is not None
    assert Usage.from_mapping(paused) == Usage(output_tokens=2_000)


def _history(compacted: bool) -> list[Message]:
    old = [
        m
        for k in range(40)
        for m in (
            Message.user(f"step {k}: " + "the build log says many things. " * 80),
            Message.assistant([{"type": "text", "text": f"noted {k}"}]),
        )
    ]
    ending = [{"type": "text", "text": "Carrying on."}]
    last = Message.assistant([COMPACTION, *ending] if compacted else ending)
    return [*old, last, Message.user("Now run the tests.")]


@pytest.mark.parametrize("method", ["calibrated", "reference"])
def test_the_estimate_starts_at_the_compaction_block(method: Any) -> None:
    history = _history(compacted=True)
    assert context_start(history) == len(history) - 2
    tracker = TokenTracker(method)
    whole = tracker.estimate(_history(compacted=False))
    live = tracker.estimate(history[-2:])
    estimate = tracker.estimate(history)
    assert whole > 20_000  # what the history holds before the block
    assert estimate == live  # only what the API reads
    assert estimate < 200


def test_a_compaction_block_goes_back_as_it_came(tmp_path: Path) -> None:
    def script(body: dict[str, Any]) -> Reply:
        if len(body["messages"]) == 1:
            return Reply([COMPACTION, {"type": "text", "text": "Carrying on."}], usage=ITERATIONS)
        return Reply([{"type": "text", "text": "done"}])

    async def loop(client: Any) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "build it"}]
        first = await client.beta.messages.create(
            model="claude-test", max_tokens=64, messages=messages, betas=["compact-2026-01-12"]
        )
        assert first.content[0].type == "compaction"
        content = [b.to_dict() for b in first.content]
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "go"}]
        await client.beta.messages.create(
            model="claude-test", max_tokens=64, messages=messages, betas=["compact-2026-01-12"]
        )

    with ScriptedMessagesServer(script) as server:
        client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([ToolResultBudget()]),
        )
        anyio.run(loop, client)
        second = server.requests[1]
    assert second["messages"][1]["content"][0] == COMPACTION


@pytest.mark.parametrize("streamed", [False, True])
def test_the_request_span_counts_the_servers_compaction(tmp_path: Path, streamed: bool) -> None:
    # the API leaves the compaction's tokens out of the top-level usage: the span adds them
    from pipeline.testing import SpanRecorder

    spans = SpanRecorder()

    def compacting(_body: dict[str, Any]) -> Reply:
        return Reply([COMPACTION, {"type": "text", "text": "ok"}], usage=ITERATIONS)

    async def call(client: Any) -> None:
        asked: dict[str, Any] = {
            "model": "claude-test",
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
            "betas": ["compact-2026-01-12"],
        }
        if streamed:
            async with client.beta.messages.stream(**asked) as stream:
                await stream.get_final_message()
        else:
            await client.beta.messages.create(**asked)

    with ScriptedMessagesServer(compacting) as server:
        client = wrap(
            sdk_client(server.base_url),
            root=tmp_path,
            pipeline=lambda: Pipeline([ToolResultBudget()]),
            tracer=spans.tracer,
        )
        anyio.run(call, client)
    [request] = spans.named("wire.request")
    attributes = dict(request.attributes or {})
    assert attributes["sluicegate.compaction.input_tokens"] == 26_000
    assert attributes["sluicegate.compaction.output_tokens"] == 900
    assert attributes["gen_ai.usage.input_tokens"] == 400  # the top-level usage, as reported


def _compacting_session(turns: int, at: int, *, recorded: bool = True) -> list[Message]:
    """A generated session whose server compacted at turn ``at``: that response opens with a
    compaction block, its usage the small context after it (``recorded=False``: no usage
    recorded from there on); each turn adds an ~8K-char result."""
    history: list[Message] = [Message.user("start")]
    size = 1_000
    for t in range(turns):
        size = 600 if t == at else size + 2_300
        blocks: list[dict[str, Any]] = [tool_use(f"t{t}", "Read")]
        usage = Usage(input_tokens=size)
        if t == at:
            blocks.insert(0, {"type": "compaction", "content": SUMMARY})
            usage = Usage.from_mapping(
                dict(compaction_reply(SUMMARY, [{}], context_tokens=size).usage or {})
            )
        history += [
            assistant(f"r{t}", *blocks, usage=usage if recorded or t < at else None),
            results(tool_result(f"t{t}", "x" * 8_000)),
        ]
    return history


@pytest.mark.asyncio
@pytest.mark.parametrize("recorded", [True, False])
async def test_a_replay_of_a_session_with_a_server_compaction(
    tmp_path: Path, recorded: bool
) -> None:
    from pipeline.transcript.replay import replay_messages
    from stages import ServerCompaction, default_stages

    pipe = Pipeline(default_stages()).replace("autocompact", ServerCompaction())
    ctx = SessionContext("compacted", tmp_path)  # the default, calibrated tracker
    estimates, blocks = [], []
    async for r in replay_messages(_compacting_session(20, 12, recorded=recorded), pipe, ctx):
        estimates.append(r.estimated_tokens)
        blocks.append(sum(json.dumps(m).count('"type": "compaction"') for m in r.request))
    assert blocks[13] == 1 and blocks[-1] == 1  # sent back on every later call, as it came
    # priced from the block on: the calls after it are far below those before it
    assert estimates[14] < estimates[11] / 3
    assert max(estimates[13:]) < 2_600 + 8 * 2_300 + 8 * 2_100


@pytest.mark.parametrize("method", ["calibrated", "reference"])
def test_after_a_paused_compaction_the_system_prompt_and_tools_are_counted(method: Any) -> None:
    paused = Usage.from_mapping(dict(compaction_reply(SUMMARY).usage or {}))
    history = [
        Message.user("go"),
        Message.assistant([COMPACTION], message_id="msg_1", usage=paused),
        Message.user("carry on"),
    ]
    tracker = TokenTracker(method)
    system = [{"type": "text", "text": "You are a careful engineer. " * 3_000}]
    tracker.set_request(system=system)
    without = TokenTracker(method).estimate(history)
    assert tracker.estimate(history) > without + 10_000  # the ~21K-token system prompt


def test_a_compacting_call_is_never_learned_from(tmp_path: Path) -> None:
    """Its usage is of the compacted context, not of the request: comparing the two would
    teach the estimator that the request cost a thirtieth of what it did."""
    anchor = Usage(input_tokens=12_000, output_tokens=50)
    history = [
        Message.user("the whole history " * 4_000),
        Message.assistant([{"type": "text", "text": "ok"}], message_id="msg_0", usage=anchor),
        Message.user("and then " * 2_000),
    ]
    usage = Usage.from_mapping(ITERATIONS)
    told = TokenTracker().observe(history, usage, model="m", compacted=True)
    assert not told.learned and "compacted" in told.reason
    assert TokenTracker().observe(history, usage, model="m").learned  # what it would have done

    # at the wire: the usage's own compaction iteration says so
    from pipeline.dropin.adapter import WireSession

    session = WireSession("w", tmp_path, Pipeline([ToolResultBudget()]))
    probe = [Message.user("a probe " * 500)]
    before = session.ctx.token_tracker.estimate(probe)
    anyio.run(session.prepare, [{"role": "user", "content": "the whole history " * 4_000}])
    session.observe("msg_1", ITERATIONS, "m")
    assert session.ctx.token_tracker.estimate(probe) == before
