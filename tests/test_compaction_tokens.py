"""A server compaction block is where the API's view starts: the token tracker prices what
follows it, its usage anchor is the last sampling iteration, and the block goes back to the
API as it came (the real SDK through ``wrap``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Message, Pipeline, Usage
from pipeline.messages import context_start
from pipeline.testing import Reply, ScriptedMessagesServer
from pipeline.tokens import TokenTracker
from pipeline.wrap import wrap
from stages import ToolResultBudget
from tests.sdk_support import sdk_client

SUMMARY = "The user asked for a build; it failed on a missing header, fixed in foo.h."
COMPACTION = {"type": "compaction", "content": SUMMARY}
ITERATIONS = {
    "input_tokens": 120,
    "output_tokens": 60,
    "cache_read_input_tokens": 0,
    "cache_creation_input_tokens": 0,
    "iterations": [
        {"type": "compaction", "input_tokens": 26_000, "output_tokens": 900,
         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        {"type": "message", "input_tokens": 400, "output_tokens": 60,
         "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
    ],
}  # fmt: skip


def test_the_usage_of_a_compacting_response_is_its_last_sampling_iteration() -> None:
    usage = Usage.from_mapping(ITERATIONS)
    assert (usage.input_tokens, usage.output_tokens) == (400, 60)
    only_compaction = {**ITERATIONS, "iterations": ITERATIONS["iterations"][:1]}
    assert Usage.from_mapping(only_compaction).input_tokens == 120  # never the compaction's


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
    assert attributes["gen_ai.usage.input_tokens"] == 120  # the top-level usage, as reported
