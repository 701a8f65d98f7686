"""Your own SDK loop, one changed line: every request goes through the default pipeline.

Runs offline against a scripted stand-in for the API; with ANTHROPIC_API_KEY set, asks the API.
What was decided is logged through the library's logger (``logging`` at INFO shows it).
"""

import asyncio
import logging
import os

import anthropic

from pipeline.testing import messages_api
from stages import wrap


async def main(api: dict[str, str]) -> None:
    client = wrap(anthropic.AsyncAnthropic(**api))  # the one line; key, URL from ANTHROPIC_*
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


logging.basicConfig(format="%(message)s")
logging.getLogger("sluicegate").setLevel(logging.INFO)  # its decisions and requests
with messages_api() as api:
    asyncio.run(main(api))
