"""Quickstart: compose the pipeline, run it before a call, send what it returns.

Runs offline against a scripted stand-in for the API; with ANTHROPIC_API_KEY set, asks the API.
"""

import asyncio
import os

import anthropic

from pipeline import Message, Pipeline, SessionContext, to_api
from pipeline.testing import messages_api
from stages import default_stages


async def main(api: dict[str, str]) -> None:
    client = anthropic.AsyncAnthropic(**api)  # key and base URL from ANTHROPIC_* env vars
    pipe = Pipeline(default_stages())
    ctx = SessionContext(session_id="quickstart", root=".sluicegate")
    history = [
        Message.user("Why did the build fail?"),
        Message.assistant(
            [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "make"}}],
            message_id="msg_1",
        ),
        Message.user(
            [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "cc -O2 ...\n" * 20_000}]
        ),
    ]
    projected = await pipe.run(history, ctx)  # the 220K-char log is persisted, a preview is sent
    for p in ctx.report.persisted:  # what was decided
        print(f"persisted {p.tool_use_id} ({p.tool_name}, {p.chars:,} chars, {p.reason} limit)")
        print(f"  the model gets a preview and the path {p.path}")
    print(f"request: {sum(len(str(m['content'])) for m in to_api(projected)):,} chars")
    reply = await client.messages.create(
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        max_tokens=512,
        messages=to_api(projected),
    )
    print(reply.content[0].text if reply.content and reply.content[0].type == "text" else reply)


with messages_api() as api:
    asyncio.run(main(api))
