"""A traced proxy session with no API key: the proxy command in front of a local scripted
Messages API, two requests through it with the SDK -- a turn of seven parallel tool results
(six CI logs of 40K characters and a 39K Bash output) and a streamed follow-up.

Run it with the OTLP variables of the recipe (they pass to the proxy process):

    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 OTEL_SERVICE_NAME=sluicegate-proxy \\
        python examples/jaeger/proxy_session.py

The proxy's own log lines (one per request) are printed as they come; its store is a
temporary directory, removed at the end.
"""

import re
import signal
import subprocess
import sys
import tempfile
from typing import Any

import anthropic

from pipeline.testing import Reply, ScriptedMessagesServer


def reply(body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "The checkout job timed out."}])


def tool_turn() -> list[dict[str, Any]]:
    """One response asking for seven tools at once, and their results."""
    calls = [(f"toolu_log_{k}", "mcp__ci__get_job_log", f"job {k}\n" + "log line\n" * 4_500)
             for k in range(6)]  # fmt: skip
    calls.append(("toolu_make", "Bash", "build output\n" * 3_000))
    return [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": i, "name": name, "input": {}} for i, name, _ in calls
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": out} for i, _, out in calls
        ]},
    ]  # fmt: skip


with ScriptedMessagesServer(reply) as upstream, tempfile.TemporaryDirectory() as store:
    command = [sys.executable, "-m", "pipeline", "proxy", "--port", "0", "--store", store]
    proxy = subprocess.Popen(
        [*command, "--upstream", upstream.base_url], stderr=subprocess.PIPE, text=True
    )
    assert proxy.stderr is not None
    line = proxy.stderr.readline()
    print(line, end="", file=sys.stderr)
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    if found is None:
        proxy.kill()
        raise SystemExit("the proxy did not start")
    client = anthropic.Anthropic(base_url=found.group(0), api_key="sk-ant-example", max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Why did CI fail?"}, *tool_turn()]
    client.messages.create(model="claude-sonnet-4-5", max_tokens=256, messages=history)  # type: ignore[arg-type]
    history += [
        {"role": "assistant", "content": [{"type": "text", "text": "Reading the logs."}]},
        {"role": "user", "content": "Which step?"},
    ]
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=256, messages=history) as s:  # type: ignore[arg-type]
        s.get_final_message()
    client.close()
    proxy.send_signal(signal.SIGINT)  # a graceful stop: spans and metrics flushed
    _, rest = proxy.communicate(timeout=60)
    print(rest, end="", file=sys.stderr)
    sys.exit(proxy.returncode)
