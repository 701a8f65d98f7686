"""An agent with your own tools; every request goes through the pipeline.

Large tool outputs are persisted by the per-tool gate as they are produced; the model gets a
preview, the path, and a read-back tool. The transcript is written as the loop goes, so the
session can be resumed with ``Agent.resume(path, ...)``.
"""

import asyncio
import math
import os
from pathlib import Path

import anthropic

from pipeline import Pipeline, SessionContext, TranscriptWriter
from pipeline.agent import Agent
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


async def main() -> None:
    root = Path(".sluicegate")
    ctx = SessionContext(
        "agent-example",
        root,
        transcript=TranscriptWriter(root / "agent-example.jsonl", "agent-example"),
    )
    agent = Agent(
        anthropic.AsyncAnthropic(),
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        pipeline=Pipeline(default_stages()),
        ctx=ctx,
        tools=[fetch_logs, get_config],
    )
    result = await agent.run("Why is the checkout service slow? Check its logs and its timeout.")
    print(f"{result.stop_reason} after {result.turns} calls: {result.text}")
    for p in Path(ctx.store.directory).iterdir() if hasattr(ctx.store, "directory") else []:
        print("persisted:", p.name, p.stat().st_size, "bytes")


asyncio.run(main())
