"""The proxy, served in-process: point any Messages API client at it.

The same as ``python -m pipeline proxy``. Offline, the upstream is a scripted stand-in for the
API; with ANTHROPIC_API_KEY set, it is ``ANTHROPIC_BASE_URL`` (the real API when unset). The
proxy listens on PROXY_PORT (default 8787), one request is sent through it with the SDK, and
its log line says what was decided; then it stops.
"""

import logging
import os
import threading
import time

import anthropic
import uvicorn

from pipeline import Pipeline
from pipeline.dropin.proxy import DEFAULT_UPSTREAM, build_app
from pipeline.testing import messages_api
from stages import default_stages

logging.basicConfig(format="%(message)s")
logging.getLogger("sluicegate").setLevel(logging.INFO)  # one line per request

with messages_api() as api:
    upstream = api.get("base_url") or os.environ.get("ANTHROPIC_BASE_URL", DEFAULT_UPSTREAM)
    port = int(os.environ.get("PROXY_PORT", "8787"))
    app = build_app(pipeline=lambda: Pipeline(default_stages()), upstream=upstream)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    while not server.started:
        if not serving.is_alive():  # uvicorn gave up: its own message above says why
            raise SystemExit(
                f"the proxy could not listen on 127.0.0.1:{port} (in use? set PROXY_PORT)"
            )
        time.sleep(0.02)

    # any client: here the SDK, pointed at the proxy (as ANTHROPIC_BASE_URL would)
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=api.get("api_key"))
    big = "line of build log\n" * 15_000
    reply = client.messages.create(
        model=os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-6"),
        max_tokens=256,
        messages=[
            {"role": "user", "content": "Summarise the log."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_log", "name": "Bash", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_log", "content": big}],
            },
        ],
    )
    print(reply.content[0].text if reply.content else "")
    server.should_exit = True
