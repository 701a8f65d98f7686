"""Write a stage and insert it into the pipeline.

A stage is any object with a ``name`` and ``async __call__(messages, ctx)``; a plain async function
becomes one with the ``@stage`` decorator. This one masks API-key-looking strings in tool output.
It must be deterministic: it runs before every call, and the same input must give the same bytes
or the prompt cache breaks. It builds a new list and never edits the one it is given, so it says
``readonly_input=True``: the pipeline then hands it the list itself instead of a copy.

Runs offline against a scripted stand-in for the API; with ANTHROPIC_API_KEY set, asks the API.
"""

import asyncio
import os
import re

import anthropic

from pipeline import Message, Pipeline, SessionContext, stage, to_api
from pipeline.testing import messages_api
from stages import default_stages

SECRET = re.compile(r"sk-[A-Za-z0-9_-]{16,}")


@stage("redact_secrets", readonly_input=True)
async def redact_secrets(messages: list[Message], ctx: SessionContext) -> list[Message]:
    out, changed = [], False
    for m in messages:
        if m.type == "user" and isinstance(m.content, list):
            blocks = [
                {**b, "content": SECRET.sub("sk-***", b["content"])}
                if b.get("type") == "tool_result"
                and isinstance(b.get("content"), str)
                and SECRET.search(b["content"])
                else b
                for b in m.content
            ]
            if blocks != m.content:
                m, changed = m.with_content(blocks), True
        out.append(m)
    return out if changed else messages  # unchanged input: hand back the same list


async def main(api: dict[str, str]) -> None:
    pipe = Pipeline(default_stages()).insert_after("tool_result_budget", redact_secrets)
    print(pipe)
    history = [
        Message.user("What is in .env?"),
        Message.assistant(
            [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "Bash",
                    "input": {"command": "cat .env"},
                }
            ],
            message_id="msg_1",
        ),
        Message.user(
            [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "API_KEY=sk-live_0123456789abcdef0123",
                }
            ]
        ),
    ]
    projected = await pipe.run(history, SessionContext("custom-stage", ".sluicegate"))
    print("the model is sent:", to_api(projected)[-1]["content"][0]["content"])  # type: ignore[index]
    reply = await anthropic.AsyncAnthropic(**api).messages.create(
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        max_tokens=256,
        messages=to_api(projected),
    )
    print(reply.content[0].text if reply.content and reply.content[0].type == "text" else reply)


with messages_api() as api:
    asyncio.run(main(api))
