"""``autocompact=server-compact``: the API compacts on the server. The real SDK against the
scripted server: the edit and beta on every request (merged with the client's own), the
compaction block sent back as it came, a paused response called again, the server's
compaction told as a decision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from anthropic.types.beta import BetaContextManagementConfigParam
from anthropic.types.beta.beta_compact_20260112_edit_param import BetaCompact20260112EditParam
from pydantic import TypeAdapter

from pipeline import Pipeline, SessionContext
from pipeline.agent import Agent
from pipeline.testing import Reply, ScriptedMessagesServer, SpanRecorder, compaction_reply
from pipeline.tokens import TokenTracker
from pipeline.tracing import ATTR
from stages import ServerCompaction, default_stages
from stages.registry import build_pipeline
from stages.server_compaction import COMPACTION_BETA
from tests.sdk_support import sdk_client

SUMMARY = "Built the project; the failing test is test_io, caused by a missing fixture."


def test_the_edit_matches_the_sdks_types_and_derives_its_trigger() -> None:
    stage = ServerCompaction(context_window=200_000, instructions="keep file paths")
    edit = stage.edit()
    assert edit["trigger"] == {"type": "input_tokens", "value": 200_000 - 20_000 - 13_000}
    TypeAdapter(BetaCompact20260112EditParam).validate_python(edit, strict=True)
    assert set(edit) <= set(BetaCompact20260112EditParam.__annotations__)
    TypeAdapter(BetaContextManagementConfigParam).validate_python({"edits": [edit]})
    assert "pause_after_compaction" not in edit
    assert ServerCompaction(pause_after_compaction=True).edit()["pause_after_compaction"] is True


@pytest.mark.parametrize(
    "bad",
    [
        {"trigger_tokens": 0},
        {"context_window": 10_000},
        {"instructions": 3},
        {"trigger_tokens": "x"},
    ],
)
def test_bad_settings_are_refused_by_name(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as caught:
        ServerCompaction(**bad)
    assert next(iter(bad)) in str(caught.value)


def test_the_registry_builds_it_with_the_shared_window() -> None:
    pipe = build_pipeline({"autocompact": {"strategy": "server-compact"}}, context_window=100_000)
    (stage,) = [s for s in pipe.stages if s.name == "autocompact"]
    assert isinstance(stage, ServerCompaction)
    assert stage.trigger_tokens == 100_000 - 20_000 - 13_000


@pytest.mark.asyncio
async def test_the_agent_sends_the_edit_returns_the_block_and_calls_again_after_a_pause(
    tmp_path: Path,
) -> None:
    def script(body: dict[str, Any]) -> Reply:
        answered = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if answered == 0:  # the server compacts and pauses
            return compaction_reply(SUMMARY)  # paused: the summary alone
        return Reply([{"type": "text", "text": "done"}])

    recorder = SpanRecorder()
    stage = ServerCompaction(trigger_tokens=60_000, pause_after_compaction=True)
    with ScriptedMessagesServer(script) as server:
        ctx = SessionContext(
            "s1",
            tmp_path / "store",
            token_tracker=TokenTracker("reference"),
            tracer=recorder.tracer,
        )
        agent = Agent(
            sdk_client(server.base_url),
            model="claude-test",
            pipeline=Pipeline(default_stages()).replace("autocompact", stage),
            ctx=ctx,
        )
        result = await agent.run("Fix the tests.")
        sent, headers = server.requests, server.request_headers
    assert result.text == "done" and result.turns == 2  # the paused response was called again
    for body, head in zip(sent, headers, strict=True):
        assert body["context_management"]["edits"] == [stage.edit()]
        assert COMPACTION_BETA in head["anthropic-beta"].split(",")
    (block,) = sent[1]["messages"][1]["content"]
    block.pop("cache_control", None)  # the agent's breakpoint: the block takes one
    assert block == {"type": "compaction", "content": SUMMARY}
    decisions = [
        (s.attributes[ATTR.DECISION], s.attributes[ATTR.SERVER_COMPACTIONS])
        for s in recorder.spans
        if s.name.startswith("autocompact.")
    ]
    assert decisions == [("delegate", 0), ("compact", 1)]


@pytest.mark.asyncio
async def test_the_server_compaction_is_told_once_and_not_again_after_a_restart(
    tmp_path: Path,
) -> None:
    from pipeline import Message
    from pipeline.testing import run_stage

    stage = ServerCompaction()
    compacted = [
        Message.user("go"),
        Message.assistant([{"type": "compaction", "content": SUMMARY}]),
    ]
    later = [*compacted, Message.user("more"), Message.assistant([{"type": "text", "text": "x"}])]

    def told(ctx: SessionContext) -> str:
        return str(ctx.report.decisions["autocompact"].decision)

    ctx = SessionContext("s", tmp_path)
    await run_stage(stage, compacted, ctx)
    assert told(ctx) == "compact"
    await run_stage(stage, compacted, ctx)  # the same request again (a retry)
    assert told(ctx) == "delegate"
    restarted = SessionContext("s", tmp_path)  # a new process: no memory of the block
    await run_stage(stage, [*later, Message.user("and more")], restarted)
    assert told(restarted) == "delegate"  # an old block is not a new compaction


@pytest.mark.parametrize("stage", ["history_snip", "context_collapse"])
@pytest.mark.asyncio
async def test_a_local_stage_takes_nothing_before_a_server_compaction_block(
    tmp_path: Path, stage: str
) -> None:
    """What precedes the block the API no longer reads: removing or summarising it frees
    nothing; the block itself must stay. Over the trigger from what follows it, the stage
    works on that part alone."""
    from pipeline.messages import Message
    from stages import ContextCollapse, HistorySnip
    from tests.rounds_support import agentic, make_ctx, run
    from tests.test_context_collapse import FakeSummarizer

    rounds = agentic(90)
    at = 1 + 2 * 15  # after fifteen rounds
    block = Message.assistant([{"type": "compaction", "content": SUMMARY}], uuid="block")
    history = [*rounds[:at], block, Message.user("go on", uuid="after"), *rounds[at:]]
    ctx = make_ctx(tmp_path)
    assert ctx.token_tracker.estimate(history) >= 9_000  # what follows the block alone
    local = (
        HistorySnip(context_window=10_000, keep_recent_rounds=4)
        if stage == "history_snip"
        else ContextCollapse(FakeSummarizer(), context_window=10_000, keep_recent_rounds=4)
    )
    out = await run(local, history, ctx)
    kept = {m.uuid for m in out}
    assert kept >= {m.uuid for m in history[: at + 2]}  # all before it, the block, the prompt
    assert len(out) < len(history)  # and it did take some of what follows
