"""Your own SDK loop, one changed line: every request goes through the default pipeline."""

import asyncio
import os

import anthropic

from stages import wrap


async def main() -> None:
    client = wrap(anthropic.AsyncAnthropic())  # the one line; key and base URL from ANTHROPIC_*
    model = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6")
    messages: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": "Why did the build fail?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "make"}}
            ],
        },
        {
            "role": "user",
            # your tool's whole output, as your loop keeps it: the request carries a preview
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "cc -O2 ...\n" * 20_000,
                }
            ],
        },
    ]
    reply = await client.messages.create(model=model, max_tokens=512, messages=messages)
    print(reply.content[0].text if reply.content else "")


asyncio.run(main())
