"""The service recipes of ``docs/operating.md`` (``examples/service``): the command each one
starts is run as written -- only the paths, the port and the interpreter swapped for this
machine's -- answers ``/healthz``, and stops on SIGTERM as a service manager stops it: exit 0.
And the Jaeger recipe's proxy session exports the trace it promises."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.cli_support import clean_env
from tests.otlp_receiver import OtlpReceiver

pytest.importorskip("uvicorn", reason="the proxy extra is not installed")

SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"


def unit_command(home: Path) -> list[str]:
    """The systemd unit's ``ExecStart``, ``%h`` being ``home``."""
    text = (SERVICE / "sluicegate.service").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart=").replace("%h", str(home)))


def container_command() -> list[str]:
    """The Dockerfile's ``ENTRYPOINT`` (exec form)."""
    text = (SERVICE / "Dockerfile").read_text()
    (line,) = [x for x in text.splitlines() if x.startswith("ENTRYPOINT ")]
    command: list[str] = json.loads(line.removeprefix("ENTRYPOINT "))
    return command


def run_as_service(command: list[str], tmp_path: Path) -> None:
    assert command[0].endswith("sluicegate") and command[1] == "proxy"
    args = command[2:]
    args[args.index("--port") + 1] = "0"
    args[args.index("--host") + 1] = "127.0.0.1"
    store = Path(args[args.index("--store") + 1])
    if not store.is_relative_to(tmp_path):  # the container's /data
        args[args.index("--store") + 1] = str(tmp_path / "data")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "proxy", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert proc.stderr is not None
        events = []
        while not events or events[-1]["event"] != "proxy.listening":
            events.append(json.loads(proc.stderr.readline()))  # --log-json: every line JSON
        if "--retain" in args:  # the start-up prune, told as an event too
            assert events[0]["event"] == "store.pruned" and events[0]["removed_files"] == 0
        url = events[-1]["url"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as answer:
            assert answer.read() == b"ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert json.loads(rest.splitlines()[-1])["event"] == "proxy.stopped"


def test_the_systemd_unit_starts_a_proxy_that_stops_cleanly(tmp_path: Path) -> None:
    command = unit_command(tmp_path)
    assert "--retain" in command and "--max-store-size" in command
    run_as_service(command, tmp_path)


def test_the_container_entrypoint_starts_a_proxy_that_stops_cleanly(tmp_path: Path) -> None:
    run_as_service(container_command(), tmp_path)


def test_the_jaeger_recipes_proxy_session_is_one_trace_per_request(tmp_path: Path) -> None:
    script = SERVICE.parent / "jaeger" / "proxy_session.py"
    with OtlpReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, str(script)],
            env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        spans = receiver.spans
    requests = [s for s in spans if s.name == "wire.request"]
    assert len(requests) == 2 and len({s.trace_id for s in requests}) == 2
    persists = [s for s in spans if s.name == "tool_result_budget.persist"]
    assert sorted(str(s.attributes["sluicegate.reason"]) for s in persists) == [
        "per_message",
        "per_message",
        "per_tool",
    ]
    assert {s.trace_id for s in persists} == {requests[0].trace_id}
    assert [s for s in spans if s.name == "tool_result_budget.reapply"]  # the second request
    assert done.stderr.count("wire.request") == 2
