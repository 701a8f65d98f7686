"""Swap a strategy: replace the ``microcompact`` slot with your own object.

This strategy clears the content of all but the newest ``keep`` tool results once the context
estimate passes ``trigger_tokens``. Clearing changes what the model already saw, so it declares
``may_break_cache = True`` (the pipeline's spans record that). It never edits the list it is
given, so it says ``readonly_input = True``: the pipeline then hands it the list itself rather
than a copy.

Runs offline against a scripted stand-in for the API; with ANTHROPIC_API_KEY set, asks the API.
"""

import asyncio
import os

import anthropic

from pipeline import Message, Pipeline, SessionContext, to_api
from pipeline.testing import messages_api
from stages import default_stages

CLEARED = "[Old tool result content cleared]"


class ClearOldToolResults:
    name = "microcompact"
    may_break_cache = True
    readonly_input = True  # builds a new list; never edits the one it is given

    def __init__(self, keep: int = 2, trigger_tokens: int = 10_000) -> None:
        self.keep, self.trigger_tokens = keep, trigger_tokens

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        if ctx.token_tracker.estimate(messages) < self.trigger_tokens:
            return messages
        ids = [
            b["tool_use_id"]
            for m in messages
            if m.type == "user" and isinstance(m.content, list)
            for b in m.content
            if b.get("type") == "tool_result"
        ]
        old = set(ids[: max(0, len(ids) - self.keep)])
        out = []
        for m in messages:
            if (
                m.type == "user"
                and isinstance(m.content, list)
                and any(b.get("tool_use_id") in old for b in m.content)
            ):
                m = m.with_content(
                    [
                        {**b, "content": CLEARED} if b.get("tool_use_id") in old else b
                        for b in m.content
                    ]
                )
            out.append(m)
        return out


async def main(api: dict[str, str]) -> None:
    pipe = Pipeline(default_stages()).replace("microcompact", ClearOldToolResults(keep=2))
    print(pipe)
    history: list[Message] = [Message.user("Look at these logs.")]
    for i in range(5):
        tid = f"toolu_{i}"
        history += [
            Message.assistant(
                [
                    {
                        "type": "tool_use",
                        "id": tid,
                        "name": "Bash",
                        "input": {"command": f"cat log{i}"},
                    }
                ],
                message_id=f"msg_{i}",
            ),
            Message.user(
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": tid,
                        "content": f"log {i}: " + "ok\n" * 6_000,
                    }
                ]
            ),
        ]
    projected = await pipe.run(history, SessionContext("swap-strategy", ".sluicegate"))
    cleared = sum(
        1
        for m in projected
        if m.type == "user"
        and isinstance(m.content, list)
        and any(b.get("content") == CLEARED for b in m.content)
    )
    print(f"cleared {cleared} of 5 tool results")
    reply = await anthropic.AsyncAnthropic(**api).messages.create(
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        max_tokens=256,
        messages=to_api(projected),
    )
    print(reply.content[0].text if reply.content and reply.content[0].type == "text" else reply)


with messages_api() as api:
    asyncio.run(main(api))
