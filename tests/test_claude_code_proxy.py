"""The real Claude Code CLI through the proxy (where it is installed).

``claude -p`` runs against a scripted Messages API with the proxy between them. In the first
test the model's side asks for eight parallel Bash calls whose outputs together exceed the 200K
per-message budget, then one more call, then ends; in the second it launches a background
sub-agent, whose report Claude Code appends to a tool result of the main thread, and works on
while the sub-agent runs. Claude Code installs under /tmp on first use of the recording tool
beside the repository (about 370 MB), so these tests only run where that has happened.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pipeline import Pipeline, ToolPolicies
from pipeline.testing import Reply, ScriptedMessagesServer
from stages import default_stages
from tests.claude_code_support import recording
from tests.wire_support import TAG, free_port, proxy

RECORD = Path(__file__).resolve().parents[2] / "shared" / "tools" / "record-claude-code"
CLAUDE = Path("/tmp/claude-code-2.1.328/node_modules/.bin/claude")

pytestmark = pytest.mark.skipif(not CLAUDE.exists(), reason="Claude Code is not installed here")


@pytest.mark.skipif(not RECORD.exists(), reason="the recording tool is not beside the repository")
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


def test_a_background_agents_report_reaches_the_main_thread(tmp_path: Path) -> None:
    """A background sub-agent's report, through the proxy, reaches the main thread intact.

    The main thread launches a general-purpose ``Agent`` in the background, then works: turns
    of eight parallel Bash calls with equal outputs of 28,999 chars (under Claude Code's own
    30,000 for Bash), 232K a turn against the 200K per-message budget, so two of each eight are
    persisted; three turns at least, and one more after the report has come. The sub-agent
    (``cc_is_subagent=true`` in its billing line) runs one command and reports with a unique
    marker. Claude Code appends that report, a ``<task-notification>`` in a
    ``<system-reminder>``, to the last tool_result of the next message the main thread sends,
    and repeats it byte for byte after. That text is Claude Code's, not the tool's: the proxy
    must neither count it in the result's size (it would make that result the largest, so the
    first persisted) nor persist it with the output (the model would see a preview without
    the report), and whatever it sends for that output later (a cleared marker, once the
    context grows) carries it too.
    """
    marker = f"REPORT-MARKER-{secrets.token_hex(6)}"
    done_text = "Main work done."

    def subagent(body: dict[str, Any]) -> bool:
        system = body.get("system")
        head = system[0].get("text", "") if isinstance(system, list) and system else system
        return "cc_is_subagent=true" in str(head)

    def bash(id_: str, command: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": id_, "name": "Bash",
                "input": {"command": command, "description": id_}}  # fmt: skip

    def script(body: dict[str, Any]) -> Reply:
        if not body.get("tools"):  # a title, a quota probe
            return Reply([{"type": "text", "text": "ok"}])
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if subagent(body):
            if turn == 0:
                return Reply([bash("toolu_sub_0", "sleep 1; echo subwork")], stop_reason="tool_use")
            return Reply([{"type": "text", "text": f"All good. {marker} (end of report)"}])
        if turn == 0:
            agent = {"description": "Background check", "prompt": "Run one command, report back.",
                     "subagent_type": "general-purpose", "run_in_background": True}  # fmt: skip
            launch = {"type": "tool_use", "id": "toolu_main_agent", "name": "Agent", "input": agent}
            return Reply([launch], stop_reason="tool_use")
        reported = marker in json.dumps(body["messages"][:-1])  # before this request's results
        if turn <= 3 or (turn < 12 and not reported):
            # Claude Code runs these one after another: one sleep a turn is enough
            calls = [
                bash(
                    f"toolu_main_{turn}_{i}",
                    ("sleep 2; " if i == 0 else "")
                    + f"python3 -c \"print((('turn {turn} job {i} ' * 6 + chr(10)) * 400)"
                    '[:29000].strip())"',
                )
                for i in range(8)
            ]
            return Reply(calls, stop_reason="tool_use")
        return Reply([{"type": "text", "text": done_text}])

    sent: list[dict[str, Any]] = []  # what Claude Code sent to the proxy
    root = tmp_path / "store"
    home, work, scratch = tmp_path / "home", tmp_path / "work", tmp_path / "cc-tmp"
    for d in (home, work, scratch):
        d.mkdir()
    scratch.chmod(0o700)
    with (
        ScriptedMessagesServer(script) as upstream,
        proxy(
            upstream.base_url,
            root,
            lambda: Pipeline(default_stages()),
            around=recording(sent),
            tool_policies=ToolPolicies.claude_code(),
        ) as url,
    ):
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "TERM": "dumb",
            "HOME": str(home),
            "CLAUDE_CODE_TMPDIR": str(scratch),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "sk-ant-test",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        done = subprocess.run(
            ["timeout", "240", str(CLAUDE), "-p", "run the steps",
             "--allowedTools", "Agent Bash Read Write Edit Grep Glob",
             "--model", "claude-sonnet-4-5"],
            cwd=work, env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done_text in done.stdout
    main = [b for b in upstream.requests if b.get("tools") and not subagent(b)]
    assert any(subagent(b) for b in upstream.requests)  # through the proxy too

    def results(body: dict[str, Any]) -> dict[str, Any]:
        return {
            b["tool_use_id"]: b["content"]
            for m in body["messages"]
            if isinstance(m["content"], list)
            for b in m["content"]
            if b.get("type") == "tool_result"
        }

    holding = [
        (i, tool_id, content)
        for i, body in enumerate(main)
        for tool_id, content in results(body).items()
        if marker in str(content)
    ]
    assert holding, "the report never reached the main thread"
    first, tool_id, carried = holding[0]
    assert [(i, t) for i, t, _ in holding] == [(i, tool_id) for i in range(first, len(main))]
    # the tail Claude Code sent (everything from the first reminder: the tool's output has none)
    original = next(
        r[tool_id]
        for b in sent
        if b.get("tools") and not subagent(b)
        for r in [results(b)]
        if tool_id in r
    )
    assert isinstance(original, str)
    tail = original[original.index("\n\n<system-reminder>") :]
    assert marker in tail and tail.endswith("</system-reminder>")
    # reached the model as sent, whatever the proxy did with the output before it (kept it,
    # persisted it, cleared it on a later call), in every request from then on
    assert carried == original or carried.startswith(TAG)
    for _, _, content in holding:
        assert content.endswith(tail)
        assert marker not in content[: -len(tail)]
    # the proxy did persist results, and none with the report in it
    assert any(
        isinstance(c, str) and c.startswith(TAG) and str(root) in c
        for b in main
        for c in results(b).values()
    )
    stored = [p for p in root.rglob("*") if p.is_file()]
    assert stored
    assert not [p for p in stored if marker.encode() in p.read_bytes()]
