"""``python -m pipeline agent``: the CLI coding agent, real SDK against the scripted server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import load_transcript, to_api
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError, without_cache_control
from pipeline.wire.pairing import check_pairing


def _env(server: ScriptedMessagesServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ANTHROPIC_"))}
    env |= {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "test-key"}
    return env


def _run(
    server: ScriptedMessagesServer, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "agent", "--model", "claude-test", *args],
        cwd=cwd,
        env=env if env is not None else _env(server),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _results(body: dict[str, Any]) -> dict[str, Any]:
    return {
        b["tool_use_id"]: b
        for m in body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    }


def _script(
    steps: list[Callable[[dict[str, Any]], list[dict[str, Any]]]],
) -> Callable[..., Reply | ScriptError]:
    def script(body: dict[str, Any]) -> Reply | ScriptError:
        k = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if k < len(steps):
            return Reply(steps[k](body), stop_reason="tool_use")
        return Reply([{"type": "text", "text": "FINAL ANSWER"}])

    return script


def _use(tid: str, name: str, **inp: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": inp}


def test_bash_output_is_persisted_and_read_back(tmp_path: Path) -> None:
    def read_back(body: dict[str, Any]) -> list[dict[str, Any]]:
        replaced = _results(body)["toolu_sh"]["content"]
        path = replaced.split("Full output saved to: ")[1].split("\n")[0]
        return [_use("toolu_rd", "read_file", path=path, offset=19_990, limit=5)]

    steps = [lambda body: [_use("toolu_sh", "bash", command="seq 1 20000")], read_back]
    with ScriptedMessagesServer(_script(steps)) as server:
        proc = _run(server, tmp_path, "--allow-bash", "count to 20000")
        bodies = server.requests
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "FINAL ANSWER"
    assert [t["name"] for t in bodies[0]["tools"]] == ["read_file", "bash"]
    # seq 1 20000 prints 108,894 chars: over bash's 30,000, so the gate persisted it
    sh = _results(bodies[1])["toolu_sh"]["content"]
    assert sh.startswith("<persisted-output>\nOutput too large (106.3KB).")
    rd = _results(bodies[2])["toolu_rd"]["content"]
    assert rd.startswith("19990\n19991\n19992\n19993\n19994\n")
    assert "[end_turn after 3 calls]" in proc.stderr
    (transcript,) = (tmp_path / ".sluicegate").glob("*/transcript.jsonl")
    loaded = load_transcript(transcript)
    assert check_pairing(to_api(loaded.messages)) == []


def test_bash_is_off_without_the_flag_and_files_stay_inside(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("alpha\nbeta\n")
    steps = [
        lambda body: [
            _use("toolu_1", "read_file", path="notes.txt"),
            _use("toolu_2", "read_file", path="/etc/passwd"),
            _use("toolu_3", "bash", command="touch pwned"),
        ]
    ]
    with ScriptedMessagesServer(_script(steps)) as server:
        proc = _run(server, tmp_path, "read my notes")
        bodies = server.requests
    assert proc.returncode == 0, proc.stderr
    assert [t["name"] for t in bodies[0]["tools"]] == ["read_file"]
    results = _results(bodies[1])
    assert results["toolu_1"]["content"] == "alpha\nbeta\n"
    assert results["toolu_2"]["is_error"] is True
    assert (
        results["toolu_3"]["is_error"] is True
        and "no tool named 'bash'" in results["toolu_3"]["content"]
    )
    assert not (tmp_path / "pwned").exists()


def test_resume_continues_the_session(tmp_path: Path) -> None:
    steps = [lambda body: [_use("toolu_1", "read_file", path="a.txt")]]
    (tmp_path / "a.txt").write_text("hello\n")
    with ScriptedMessagesServer(_script(steps)) as server:
        first = _run(server, tmp_path, "--session-id", "s-1", "read a.txt")
        assert first.returncode == 0, first.stderr
        transcript = tmp_path / ".sluicegate" / "s-1" / "transcript.jsonl"
        second = _run(server, tmp_path, "--resume", str(transcript), "and again")
        bodies = [{**b, "messages": without_cache_control(b["messages"])} for b in server.requests]
    assert second.returncode == 0, second.stderr
    # the resumed request starts with everything the first session sent and received
    assert bodies[2]["messages"][:4] == (
        [
            *bodies[1]["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": "FINAL ANSWER"}]},
        ]
    )
    assert bodies[2]["messages"][-1] == {"role": "user", "content": "and again"}


def test_results_on_s3_are_read_back_by_their_uri_and_survive_a_resume(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``--store s3://BUCKET/PREFIX``: the persisted output is an object (moto's S3 on
    127.0.0.1), read_file reads it by its URI, the transcript stays local, and a resume (with
    the same --store) reads it again."""
    moto = request.getfixturevalue("moto_s3")
    bucket = moto.new_bucket()
    store = f"s3://{bucket}/agents"

    def script(body: dict[str, Any]) -> Reply:
        k = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if k == 0:
            return Reply([_use("toolu_sh", "bash", command="seq 1 20000")], stop_reason="tool_use")
        if k in (1, 3):  # in the first run, and again in the resumed one
            replaced = _results(body)["toolu_sh"]["content"]
            uri = replaced.split("Full output saved to: ")[1].split("\n")[0]
            read = _use(f"toolu_rd{k}", "read_file", path=uri, offset=19_990, limit=2)
            return Reply([read], stop_reason="tool_use")
        return Reply([{"type": "text", "text": "FINAL ANSWER"}])

    with ScriptedMessagesServer(script) as server:
        env = {k: v for k, v in _env(server).items() if not k.startswith("AWS_")} | moto.env()
        args = ["--allow-bash", "--store", store, "--session-id", "s3-session"]
        proc = _run(server, tmp_path, *args, "count to 20000", env=env)
        transcript = tmp_path / ".sluicegate" / "s3-session" / "transcript.jsonl"
        resumed = _run(
            server, tmp_path, "--store", store, "--resume", str(transcript), "again", env=env
        )
        bodies = server.requests
    assert proc.returncode == 0, proc.stderr
    assert f"results on {store}" in proc.stderr
    uri = f"{store}/s3-session/tool-results/toolu_sh.txt"
    assert f"Full output saved to: {uri}" in _results(bodies[1])["toolu_sh"]["content"]
    page = "19990\n19991\n\n[lines 19990-19991 of 20000; next: offset=19992]"
    assert _results(bodies[2])["toolu_rd1"]["content"] == page
    assert transcript.is_file()
    assert not (tmp_path / ".sluicegate" / "s3-session" / "tool-results").exists()
    assert resumed.returncode == 0, resumed.stderr
    assert _results(bodies[-1])["toolu_rd3"]["content"] == page
    objects = [m["path"] for chunk in moto.store(bucket).list("agents") for m in chunk]
    assert objects == ["agents/s3-session/tool-results/toolu_sh.txt"]


def test_the_agent_refuses_a_store_url_it_cannot_use(tmp_path: Path) -> None:
    with ScriptedMessagesServer(lambda body: Reply([{"type": "text", "text": "x"}])) as server:
        proc = _run(server, tmp_path, "--store", "memory:///x", "hi")
        timeout = _run(server, tmp_path, "--store-timeout", "2", "hi")
    assert proc.returncode == 2 and "s3://BUCKET/PREFIX" in proc.stderr
    assert timeout.returncode == 2 and "apply to an s3:// or az:// --store" in timeout.stderr


def test_api_error_is_reported_without_a_traceback(tmp_path: Path) -> None:
    with ScriptedMessagesServer(
        lambda body: ScriptError(529, "overloaded_error", "Overloaded")
    ) as server:
        proc = _run(server, tmp_path, "--max-retries", "0", "hi")
        attempts = len(server.requests)
    assert proc.returncode == 1
    assert attempts == 1
    assert "overloaded (status 529, request id req_scripted_000001)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_is_a_usage_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "agent", "hi"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "no model" in proc.stderr
