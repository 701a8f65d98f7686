"""The main job: ``python -m pipeline demo``, the live agent loop against the scripted server."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest

from pipeline import Pipeline, SessionContext, load_transcript, to_api
from pipeline._cli.demo_agent import LiveDemo, demo_replies
from pipeline._cli.demo_session import OUTPUT_MARKER, generate_session
from pipeline.transcript.replay import CallResult
from pipeline.wire.pairing import check_pairing
from stages import default_stages
from tests.cli_support import clean_env, parse_json_lines, run_cli
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.sdk_support import sdk_client


def test_live_demo_runs_the_loop_and_writes_a_resumable_transcript(tmp_path: Path) -> None:
    transcript = tmp_path / "live.jsonl"
    dumps = tmp_path / "dumps"
    proc = run_cli(
        "demo", "--json", "--store", tmp_path, "--out", transcript, "--dump-requests", dumps
    )
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    assert len(calls) == len(demo_replies(generate_session())) == 5
    assert [c["message_id"].rsplit("_", 1)[0] for c in calls] == [
        f"msg_scripted_{n:04d}" for n in range(1, 6)
    ]
    # the ten parallel ~40K logs: the per-message budget persists the five largest
    assert len(calls[1]["persisted"]) == 5
    # the ~80K Bash output: persisted by the per-tool gate as it was produced, first sent in call 3
    (bash,) = calls[3]["persisted"]
    assert bash["chars"] == 79_993 and bash["path"].endswith(".txt")
    assert calls[4]["reapplied"] == 5  # the stage re-applies its own five every call
    assert summary["persisted"] == 6 and summary["persist_failed"] == 0
    # the live session's own tracker is measured on every call after the first response
    assert summary["estimated_part"]["default"]["calls"] == 4
    # every request the server received was valid and is what was dumped
    for c in calls:
        request = json.loads((dumps / f"{c['call']:04d}.json").read_text())
        assert check_pairing(request) == []
        assert c["request_chars"] > 0
    # the transcript the loop wrote is a valid Claude Code-format session
    loaded = load_transcript(transcript)
    assert check_pairing(to_api(loaded.messages)) == []
    assert loaded.replacement_records and {r.tool_use_id for r in loaded.replacement_records} == {
        p["tool_use_id"] for p in calls[1]["persisted"]
    }


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def test_live_demo_trace_tree_over_otlp(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        env = clean_env(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=rx.traces_endpoint)
        proc = run_cli("demo", "--json", "--store", tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        spans = rx.spans
    calls, summary = parse_json_lines(proc.stdout)
    turns = [s for s in spans if s.name == "agent.turn"]
    assert len(turns) == len(calls)
    conversation = summary["session_id"]
    (agent,) = [s for s in spans if s.name == "invoke_agent sluicegate"]
    assert (
        agent.parent_span_id == "" and agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    )
    tool_calls = 0
    for number, turn in enumerate(turns):
        assert turn.parent_span_id == agent.span_id  # the run's trace, a turn per model call
        assert turn.attributes["sluicegate.call"] == number
        assert not any(k.startswith("gen_ai.usage.") for k in turn.attributes)  # the SDK's
        children = _children(spans, turn)
        names = [s.name for s in children]
        assert names.count("pipeline.run") == 1
        (run,) = [s for s in children if s.name == "pipeline.run"]
        assert [s.name for s in _children(spans, run)] == [
            f"stage.{n}"
            for n in (
                "tool_result_budget",
                "history_snip",
                "microcompact",
                "context_collapse",
                "autocompact",
            )
        ]
        # the SDK's own client span is a sibling of the pipeline span, never inside it
        sdk = [s for s in children if s.scope.startswith("com.anthropic")]
        assert len(sdk) == 1 and sdk[0].attributes.get("gen_ai.provider.name") == "anthropic"
        assert sdk[0].attributes.get("gen_ai.conversation.id") == conversation
        assert "gen_ai.operation.name" not in run.attributes
        tools = [s for s in children if s.name.startswith("execute_tool ")]
        for t in tools:
            assert t.name == f"execute_tool {t.attributes['gen_ai.tool.name']}"
            assert t.attributes["gen_ai.tool.call.id"].startswith("toolu_")
            assert t.attributes["sluicegate.decision"] in {"keep", "persist", "skip_unbounded_tool"}
        tool_calls += len(tools)
    assert tool_calls == 15  # 10 + 2 + 1 + 2 tool calls in the session
    gate = [s for s in spans if s.attributes.get("sluicegate.decision") == "persist"]
    assert any(s.name == "execute_tool Bash" for s in gate)
    # the five job logs the budget persisted in call 1 link to their executions in call 0
    executed = {s.span_id: s for s in spans if s.name.startswith("execute_tool ")}
    persisted = [s for s in spans if s.name == "tool_result_budget.persist"]
    assert len(persisted) == 5
    for d in persisted:
        (link,) = d.links
        assert (
            executed[link].attributes["gen_ai.tool.call.id"] == d.attributes["gen_ai.tool.call.id"]
        )
        assert d.attributes["sluicegate.executed_in_call"] == 0
        assert d.attributes["sluicegate.call"] == 1
    for s in spans:
        if s.scope == "sluicegate":
            assert s.attributes.get("gen_ai.conversation.id") == conversation, s.name
        for value in s.attributes.values():
            assert OUTPUT_MARKER not in json.dumps(value, default=str), s.name


@pytest.mark.asyncio
async def test_the_live_demo_closes_its_client_in_the_loop_that_used_it(tmp_path: Path) -> None:
    """A client left to the garbage collector closes its connections in whichever event loop
    runs when it is collected, and fails there if they belong to a closed one."""
    session = generate_session()
    ctx = SessionContext(session.session_id, tmp_path)
    made: list[anthropic.AsyncAnthropic] = []

    def client(base_url: str) -> anthropic.AsyncAnthropic:
        made.append(sdk_client(base_url))
        return made[-1]

    seen: list[CallResult] = []
    calls = await LiveDemo(session, Pipeline(default_stages()), ctx, seen.append).run(client)
    assert calls == len(seen) == 5
    assert len(made) == 1 and made[0].is_closed()
