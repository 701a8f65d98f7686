"""Every example runs, on the real SDK, against the local scripted Messages server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.testing import Reply, ScriptedMessagesServer
from tests.wire_support import conversation_dirs, free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def script(body: dict[str, Any]) -> Reply:
    calls = sum(1 for m in body["messages"] if m["role"] == "assistant")
    tools = {t["name"] for t in body.get("tools", [])}
    if "fetch_logs" in tools and calls == 0:
        return Reply(
            [
                {
                    "type": "tool_use",
                    "id": "toolu_logs",
                    "name": "fetch_logs",
                    "input": {"service": "checkout"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_cfg",
                    "name": "get_config",
                    "input": {"name": "timeout_ms"},
                },
            ],
            stop_reason="tool_use",
        )
    return Reply([{"type": "text", "text": "SCRIPTED ANSWER"}])


@pytest.fixture
def server() -> Iterator[ScriptedMessagesServer]:
    with ScriptedMessagesServer(script) as s:
        yield s


def example_run(
    name: str, server: ScriptedMessagesServer, cwd: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``examples/name`` against ``server`` (``env``: more environment variables)."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=cwd,
        env={
            **os.environ,
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": "test-key",
            "ANTHROPIC_MODEL": "claude-scripted",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_example(name: str, server: ScriptedMessagesServer, cwd: Path) -> str:
    done = example_run(name, server, cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


def tool_results(body: dict[str, Any]) -> dict[str, Any]:
    return {
        b["tool_use_id"]: b["content"]
        for m in body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    }


def test_quickstart(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    out = run_example("quickstart.py", server, tmp_path)
    assert "SCRIPTED ANSWER" in out
    (body,) = server.requests
    sent = tool_results(body)["toolu_1"]
    assert sent.startswith("<persisted-output>\nOutput too large (214.8KB).")
    assert (
        tmp_path / ".sluicegate" / "quickstart" / "tool-results" / "toolu_1.txt"
    ).stat().st_size == 220_000


def test_custom_stage(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    out = run_example("custom_stage.py", server, tmp_path)
    assert "Pipeline(tool_result_budget → redact_secrets → history_snip" in out
    (body,) = server.requests
    assert tool_results(body)["toolu_1"] == "API_KEY=sk-***"


def test_swap_strategy(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    out = run_example("swap_strategy.py", server, tmp_path)
    assert "cleared 3 of 5 tool results" in out
    results = tool_results(server.requests[0])
    cleared = [tid for tid, c in results.items() if c == "[Old tool result content cleared]"]
    assert cleared == ["toolu_0", "toolu_1", "toolu_2"]


def test_agent_with_tools(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    out = run_example("agent_with_tools.py", server, tmp_path)
    assert "end_turn after 2 calls: SCRIPTED ANSWER" in out
    results = tool_results(server.requests[1])
    assert results["toolu_logs"].startswith("<persisted-output>")
    assert results["toolu_cfg"] == "250"
    assert "persisted: toolu_logs.txt" in out
    assert (tmp_path / ".sluicegate" / "agent-example.jsonl").exists()


def test_wrap_client(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    out = run_example("wrap_client.py", server, tmp_path)
    assert "SCRIPTED ANSWER" in out
    sent = tool_results(server.requests[0])["toolu_1"]
    assert sent.startswith("<persisted-output>\nOutput too large (214.8KB).")
    (session,) = conversation_dirs(tmp_path / ".sluicegate")
    (saved,) = (session / "tool-results").glob("toolu_1.*.txt")  # named by its content
    assert saved.stat().st_size == 220_000


def test_proxy_server(server: ScriptedMessagesServer, tmp_path: Path) -> None:
    for _ in range(3):
        port = free_port()
        done = example_run("proxy_server.py", server, tmp_path, PROXY_PORT=str(port))
        if "could not listen" not in done.stderr:
            break  # else another process took the port meanwhile: try a fresh one
    assert done.returncode == 0, done.stderr
    assert "SCRIPTED ANSWER" in done.stdout
    sent = tool_results(server.requests[0])["toolu_log"]
    assert sent.startswith("<persisted-output>\nOutput too large (")


def test_the_proxy_example_says_so_when_its_port_is_taken(
    server: ScriptedMessagesServer, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = example_run("proxy_server.py", server, tmp_path, PROXY_PORT=str(port))
    assert done.returncode != 0  # it ends, rather than wait for a server that never starts
    assert f"could not listen on 127.0.0.1:{port}" in done.stderr
    assert server.requests == []


OFFLINE = {
    "quickstart.py": ["persisted toolu_1 (Bash, 220,000 chars, per_tool limit)", "request: "],
    "wrap_client.py": ["decision=persist", "persisted=1"],
    "custom_stage.py": ["the model is sent: API_KEY=sk-***"],
    "swap_strategy.py": ["cleared 3 of 5 tool results"],
    "agent_with_tools.py": ["end_turn after 2 calls", "persisted: toolu_logs.txt"],
    "proxy_server.py": ["decision=persist", "kept_off_wire="],
}


@pytest.mark.parametrize("name", sorted(OFFLINE))
def test_each_example_runs_offline_and_says_what_was_decided(name: str, tmp_path: Path) -> None:
    """No key, no network: the example talks to pipeline.testing's stand-in for the API and
    prints (or logs) what the pipeline decided."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env={**env, "PROXY_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    for expected in OFFLINE[name]:
        assert expected in said, said[-2000:]
    assert sorted(OFFLINE) == sorted(p.name for p in EXAMPLES.glob("*.py"))
