"""An agent with your own tools; every request goes through the pipeline.

Large tool outputs are persisted by the per-tool gate as they are produced; the model gets a
preview, the path, and a read-back tool. The transcript is written as the loop goes, so the
session can be resumed with ``Agent.resume(path, ...)``.

Runs offline against a scripted model (it asks for the logs, then answers); with
ANTHROPIC_API_KEY set, asks the API.
"""

import asyncio
import math
import os
from pathlib import Path
from typing import Any

import anthropic

from pipeline import Pipeline, SessionContext, TranscriptWriter
from pipeline.agent import Agent
from pipeline.testing import Reply, messages_api
from pipeline.tools import tool
from stages import default_stages


@tool(
    input_schema={
        "type": "object",
        "properties": {"service": {"type": "string"}},
        "required": ["service"],
    }
)
async def fetch_logs(service: str) -> str:
    """Fetch the recent logs of a service."""
    return "".join(f"{service} line {i}: request served in {i % 97} ms\n" for i in range(4_000))


@tool(
    input_schema={
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    },
    max_result_size_chars=math.inf,  # small and bounded by itself: never persist
)
async def get_config(name: str) -> str:
    """Read one configuration value."""
    return {"timeout_ms": "250"}.get(name, "unset")


async def main(api: dict[str, str]) -> None:
    root = Path(".sluicegate")
    ctx = SessionContext(
        "agent-example",
        root,
        transcript=TranscriptWriter(root / "agent-example.jsonl", "agent-example"),
    )
    agent = Agent(
        anthropic.AsyncAnthropic(**api),
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        pipeline=Pipeline(default_stages()),
        ctx=ctx,
        tools=[fetch_logs, get_config],
    )
    result = await agent.run("Why is the checkout service slow? Check its logs and its timeout.")
    print(f"{result.stop_reason} after {result.turns} calls: {result.text}")
    for p in Path(ctx.store.directory).iterdir() if hasattr(ctx.store, "directory") else []:
        print("persisted:", p.name, p.stat().st_size, "bytes")


def scripted_model(body: dict[str, Any]) -> Reply:
    """Offline: ask for the logs first, then answer (what a model would do here)."""
    if not any(m["role"] == "user" and isinstance(m["content"], list) for m in body["messages"]):
        call = {"type": "tool_use", "id": "toolu_logs", "name": "fetch_logs"}
        return Reply([{**call, "input": {"service": "checkout"}}], stop_reason="tool_use")
    return Reply([{"type": "text", "text": "Requests take up to 96 ms; the timeout is 250 ms."}])


with messages_api(scripted_model) as api:
    asyncio.run(main(api))
