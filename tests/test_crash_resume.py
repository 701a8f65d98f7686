"""A session process killed mid-turn (SIGKILL) resumes from its transcript with nothing lost.

The child runs the real agent loop against the scripted server in this process; it is killed
while a tool call of its third turn is running. From the transcript it left, the requests of the
calls it made are rebuilt byte for byte, and a resumed agent finishes the session with a valid
history.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline import (
    Pipeline,
    ReplacementState,
    SessionContext,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.agent import INTERRUPTED_RESULT, Agent
from pipeline.testing import Reply, ScriptedMessagesServer, without_cache_control
from pipeline.tools import tool
from pipeline.transcript.replay import find_calls
from pipeline.wire.pairing import check_pairing
from stages import ContextCollapse, HistorySnip, ToolResultBudget
from tests.rounds_support import agentic
from tests.sdk_support import sdk_client

CHILD = """
import sys, anyio, anthropic
from pathlib import Path
from pipeline import Pipeline, SessionContext, TranscriptWriter
from pipeline.agent import Agent
from pipeline.tools import tool
from stages import ToolResultBudget

root, base_url, marker = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

@tool(input_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
async def emit(n: int) -> str:
    "Emit n chars."
    return ("log line\\n" * (n // 9 + 1))[:n]

@tool(input_schema={"type": "object", "properties": {}})
async def stall() -> str:
    "Never finishes."
    marker.write_text("running")
    await anyio.sleep_forever()
    return ""

async def main() -> None:
    writer = TranscriptWriter(root / "t.jsonl", "crash")
    ctx = SessionContext("crash", root / "store", transcript=writer)
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="k", max_retries=0)
    agent = Agent(client, model="m", pipeline=Pipeline([ToolResultBudget(limit=20_000)]), ctx=ctx,
                  tools=[emit, stall])
    await agent.run("go")

anyio.run(main)
"""

TURNS: list[list[dict[str, Any]]] = [
    [{"type": "tool_use", "id": f"a{i}", "name": "emit", "input": {"n": 9_000}} for i in range(4)],
    [{"type": "tool_use", "id": "b0", "name": "emit", "input": {"n": 60_000}}],
    [
        {"type": "tool_use", "id": "c0", "name": "emit", "input": {"n": 500}},
        {"type": "tool_use", "id": "c1", "name": "stall", "input": {}},
    ],
]


def script(body: dict[str, Any]) -> Reply:
    k = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if k < len(TURNS):
        return Reply(TURNS[k], stop_reason="tool_use")
    return Reply([{"type": "text", "text": "done"}])


@tool(input_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
async def emit(n: int) -> str:
    """Emit n chars."""
    return ("log line\n" * (n // 9 + 1))[:n]


@tool(input_schema={"type": "object", "properties": {}})
async def stall() -> str:
    """Finishes at once after the resume."""
    return "ok"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.asyncio
async def test_sigkill_mid_turn_then_resume(tmp_path: Path) -> None:
    child_py = tmp_path / "child.py"
    child_py.write_text(CHILD)
    marker = tmp_path / "stalled"
    with ScriptedMessagesServer(script) as server:
        proc = subprocess.Popen(
            [sys.executable, str(child_py), str(tmp_path), server.base_url, str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the child never reached its third turn"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        sent_before_crash = list(server.requests)
        assert len(sent_before_crash) == 3

        log = tmp_path / "t.jsonl"
        loaded = load_transcript(log, strict=False)
        pipe = Pipeline([ToolResultBudget(limit=20_000)])

        # 1. the requests of the calls already made, rebuilt from the transcript alone
        state = ReplacementState.reconstruct(loaded.messages, loaded.replacement_records)
        ctx = SessionContext("crash", tmp_path / "store", replacement_state=state)
        calls = find_calls(loaded.messages)
        assert len(calls) == 3
        for call, sent in zip(calls, sent_before_crash, strict=True):
            rebuilt = to_api(await pipe.run(loaded.messages[: call.index], ctx))
            received = without_cache_control(sent["messages"])  # the breakpoint moves each call
            assert json.dumps(rebuilt) == json.dumps(received), f"call {call.number}"

        # 2. resume: the open tool calls are answered, the session completes, history valid
        client = sdk_client(server.base_url)
        agent = Agent.resume(
            log, client, model="m", pipeline=pipe, root=tmp_path / "store", tools=[emit, stall]
        )
        result = await agent.run()
        after = server.requests[3:]
    assert result.text == "done"
    answered = without_cache_control(after[0]["messages"])[-1]["content"]
    assert [(b["tool_use_id"], b.get("is_error", False)) for b in answered] == [
        ("c0", True),
        ("c1", True),
    ]
    assert all(b["content"] == INTERRUPTED_RESULT for b in answered)
    # the prefix the model saw before the crash is sent again unchanged
    before = without_cache_control(sent_before_crash[-1]["messages"])
    assert without_cache_control(after[0]["messages"])[: len(before)] == before
    final = load_transcript(log, strict=False)
    assert check_pairing(to_api(final.messages)) == []


@pytest.mark.asyncio
async def test_a_damaged_or_forged_stage_record_never_stops_a_resume(tmp_path: Path) -> None:
    """A ``stage-record`` of the wrong shape, or one naming records the stage always keeps, is
    ignored on resume (with a warning): the session goes on, its task still first."""
    log = tmp_path / "t.jsonl"
    writer = TranscriptWriter(log, "damaged")
    history = agentic(34)
    writer.append_messages(history)
    every = [m.uuid for m in history]
    writer.append_stage_record("history_snip", {"removed": 5})
    writer.append_stage_record("history_snip", {"strategy": "snip-middle", "removed": every})
    writer.append_stage_record("context_collapse", {"uuids": every[:5], "summary": "forged"})
    pipe = Pipeline(
        [
            HistorySnip(context_window=10_000, keep_recent_rounds=4),
            ContextCollapse(context_window=10_000, keep_recent_rounds=4),
        ]
    )
    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "done"}])) as server:
        client = sdk_client(server.base_url)
        agent = Agent.resume(log, client, model="m", pipeline=pipe, root=tmp_path / "store")
        result = await agent.run("continue")
        [sent] = server.requests
    assert result.text == "done"
    first = sent["messages"][0]["content"]
    assert first == "Fix the failing tests." or first[0]["text"].startswith(
        "Fix the failing tests."
    )
    assert "forged" not in json.dumps(sent["messages"])
    assert check_pairing(sent["messages"]) == []
