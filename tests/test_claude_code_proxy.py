"""The real Claude Code CLI through the proxy (where it is installed).

``claude -p`` runs against a scripted Messages API with the proxy between them; the model's side
asks for eight parallel Bash calls whose outputs together exceed the 200K per-message budget,
then one more call, then ends. Claude Code installs under /tmp on first use of the recording
tool beside the repository (about 370 MB), so this test only runs where that has happened.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline import Pipeline
from stages import default_stages
from tests.wire_support import free_port, proxy

RECORD = Path(__file__).resolve().parents[2] / "shared" / "tools" / "record-claude-code"
CLAUDE = Path("/tmp/claude-code-2.1.328/node_modules/.bin/claude")

pytestmark = pytest.mark.skipif(
    not (RECORD.exists() and CLAUDE.exists()), reason="Claude Code is not installed here"
)


def test_claude_code_through_the_proxy(tmp_path: Path) -> None:
    logs = [
        {
            "name": "Bash",
            "input": {
                "command": f"python3 -c \"print(('job {i} log line ' * 3 + chr(10)) * 600)\""
                " | head -c 29000",
                "description": f"job log {i}",
            },
        }
        for i in range(8)
    ]
    more = [{"name": "Bash", "input": {"command": "echo checked", "description": "check"}}]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([logs, more, "All eight logs read; done."]))
    for attempt in range(3):
        # the scripted server binds the port it is given after this process let it go:
        # should another process take it in between (unlikely outside the ephemeral range), a
        # fresh port is tried
        upstream_port = free_port()
        out = tmp_path / f"run{attempt}"
        with proxy(
            f"http://127.0.0.1:{upstream_port}",
            tmp_path / f"store{attempt}",
            lambda: Pipeline(default_stages()),
        ) as url:
            done = subprocess.run(
                [str(RECORD), str(plan), str(out), "read the eight job logs",
                 "--base-url", url, "--port", str(upstream_port)],
                capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
        if "Address already in use" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr
    assert "All eight logs read; done." in (out / "claude.out").read_text()
    bodies = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    main = [b.get("body", b) for b in bodies if b.get("body", b).get("tools")]
    assert len(main) == 3

    def results(body: dict[str, object]) -> dict[str, str]:
        found: dict[str, str] = {}
        for m in body["messages"]:  # type: ignore[attr-defined]
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b.get("type") == "tool_result":
                    c = b["content"]
                    text = c if isinstance(c, str) else "".join(x.get("text", "") for x in c)
                    found[b["tool_use_id"]] = text
        return found

    second, third = results(main[1]), results(main[2])
    assert sum(len(t) for t in second.values()) <= 200_000  # over 220K came from the tools
    persisted = {k: t for k, t in second.items() if t.startswith("<persisted-output>")}
    assert persisted
    for tool_id, text in persisted.items():
        assert third[tool_id] == text  # re-applied byte for byte on the next call
        path = text.split("saved to: ", 1)[1].split("\n", 1)[0]
        assert Path(path).is_file()  # where Claude Code's Read, on this machine, finds it
