"""OTLP as users configure it: ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` picks OTLP/HTTP or
OTLP/gRPC, anything else is refused before any work, and spans that cannot be delivered are
reported in one warning line.

The receivers are real: a gRPC server implementing the collector's ``TraceService`` (grpcio and
opentelemetry-proto, from the dev extra) and the OTLP/HTTP receiver of ``tests.otlp_receiver``.
The CLI runs as a subprocess with a short exporter timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pipeline._cli.app import main
from pipeline._cli.demo_session import OUTPUT_MARKER
from pipeline._cli.telemetry import (
    GRPC,
    GRPC_EXTRA,
    HTTP_PROTOBUF,
    OTLP_DEFAULT_PORTS,
    ExportWatch,
    OtlpTarget,
    TelemetrySetupError,
    otlp_protocol,
    otlp_traces_endpoint,
)
from tests.cli_support import clean_env, parse_json_lines, run_cli
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, decode

PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
FAST = {"OTEL_EXPORTER_OTLP_TIMEOUT": "2"}  # seconds (the Python exporters' unit)
STAGES = ["tool_result_budget", "history_snip", "microcompact", "context_collapse", "autocompact"]


class GrpcOtlpReceiver:
    """An OTLP/gRPC trace receiver (the collector's ``TraceService``) on 127.0.0.1 and a random
    port; ``spans`` decoded like the HTTP receiver's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                spans = decode(request.SerializeToString())
                with receiver._lock:
                    receiver._spans.extend(spans)
                    receiver.requests += 1
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        """For ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``http://``: an insecure channel)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> GrpcOtlpReceiver:
        self._server.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.stop(grace=None).wait(5)


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_no_content(spans: list[ReceivedSpan]) -> None:
    """No tool output text in any span attribute (the check of the OTLP/HTTP tests)."""
    for s in spans:
        for value in s.attributes.values():
            assert OUTPUT_MARKER not in json.dumps(value, default=str), s.name


# ---------------------------------------------------------------------------------------------
# grpc
# ---------------------------------------------------------------------------------------------


def test_grpc_export_of_the_live_demo(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as rx:
        env = clean_env(**{PROTOCOL: GRPC, ENDPOINT: rx.endpoint}, **FAST)
        proc = run_cli("demo", "--json", "--store", tmp_path, env=env)
        spans = rx.spans
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # delivered: no warning
    calls, summary = parse_json_lines(proc.stdout)
    runs = [s for s in spans if s.name == "pipeline.run"]
    assert len(runs) == len(calls) == 5
    assert len([s for s in spans if s.name == "agent.turn"]) == len(calls)
    by_id = {s.span_id: s for s in spans}
    for run in runs:
        assert by_id[run.parent_span_id].name == "agent.turn"
        stage_spans = [s for s in spans if s.parent_span_id == run.span_id]
        assert [s.name for s in stage_spans] == [f"stage.{n}" for n in STAGES]
        assert run.attributes["gen_ai.conversation.id"] == summary["session_id"]
    assert {s.resource.get("service.name") for s in spans} == {"sluicegate"}
    assert_no_content(spans)


def test_traces_protocol_wins_over_the_general_one(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as rx:
        env = clean_env(
            **{TRACES_PROTOCOL: GRPC, PROTOCOL: HTTP_PROTOBUF, ENDPOINT: rx.endpoint}, **FAST
        )
        proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
        spans = rx.spans
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    calls, _ = parse_json_lines(proc.stdout)
    assert sum(1 for s in spans if s.name == "pipeline.run") == len(calls)


# ---------------------------------------------------------------------------------------------
# http/protobuf (the default; tests/test_cli.py and test_demo_live.py cover it unset)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "protocol_env",
    [
        {PROTOCOL: HTTP_PROTOBUF},
        {PROTOCOL: " HTTP/Protobuf "},  # trimmed, any case
        # the traces variable wins: the general one is not even looked at
        {TRACES_PROTOCOL: HTTP_PROTOBUF, PROTOCOL: "bogus"},
        {TRACES_PROTOCOL: "", PROTOCOL: HTTP_PROTOBUF},  # empty counts as unset
    ],
)
def test_http_protobuf_named_explicitly(tmp_path: Path, protocol_env: dict[str, str]) -> None:
    with OtlpReceiver() as rx:
        env = clean_env(**protocol_env, **{ENDPOINT: rx.endpoint}, **FAST)
        proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
        spans = rx.spans
        assert rx.bad_paths == []  # /v1/traces appended to the base endpoint
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    calls, _ = parse_json_lines(proc.stdout)
    assert sum(1 for s in spans if s.name == "pipeline.run") == len(calls)
    assert_no_content(spans)


# ---------------------------------------------------------------------------------------------
# unsupported values: exit 2 before any work
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("var", [PROTOCOL, TRACES_PROTOCOL])
@pytest.mark.parametrize("value", ["http/json", "bogus"])
def test_unsupported_protocol_is_refused(tmp_path: Path, var: str, value: str) -> None:
    out = tmp_path / "session.jsonl"
    env = clean_env(**{var: value, ENDPOINT: f"http://127.0.0.1:{closed_port()}"}, **FAST)
    proc = run_cli("demo", "--json", "--store", tmp_path, "--out", out, env=env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("sluicegate: error: ")
    assert f"{var}={value} is not supported" in line
    assert "http/protobuf" in line and "grpc" in line
    assert not out.exists()  # nothing ran


def test_protocol_is_not_checked_when_nothing_is_exported(tmp_path: Path) -> None:
    # no endpoint: no export, so a protocol meant for other programs does not stop the command
    proc = run_cli(
        "demo", "--replay", "--json", "--store", tmp_path, env=clean_env(**{PROTOCOL: "x"})
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_missing_grpc_exporter_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv(PROTOCOL, GRPC)
    monkeypatch.setenv(ENDPOINT, f"http://127.0.0.1:{closed_port()}")
    # a None entry makes the import fail, as if the extra were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    capsys.readouterr()
    code = main(["demo", "--replay", "--json", "--store", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    (line,) = err.splitlines()
    assert f"{PROTOCOL}=grpc" in line and f"pip install 'sluicegate[{GRPC_EXTRA}]'" in line
    assert not (tmp_path / "demo-session.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# spans that cannot be delivered: one warning line, the command's own result stands
# ---------------------------------------------------------------------------------------------


def _only_warning(proc: Any) -> str:
    assert proc.returncode == 0, proc.stderr  # the work was done
    parse_json_lines(proc.stdout)
    (line,) = proc.stderr.splitlines()  # the exporters' retry messages are not shown
    assert line.startswith("sluicegate: warning: ")
    return str(line)


@pytest.mark.parametrize("protocol", [HTTP_PROTOBUF, GRPC])
def test_unreachable_endpoint_gives_one_warning(tmp_path: Path, protocol: str) -> None:
    port = closed_port()
    # at a 1 s timeout the HTTP exporter gives up without naming the error: the warning finds
    # the reason itself
    env = clean_env(
        **{PROTOCOL: protocol, ENDPOINT: f"http://127.0.0.1:{port}"}, OTEL_EXPORTER_OTLP_TIMEOUT="1"
    )
    proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
    line = _only_warning(proc)
    shown = f"http://127.0.0.1:{port}" + ("/v1/traces" if protocol == HTTP_PROTOBUF else "")
    assert f"could not be exported to {shown} (OTLP {protocol}): connection refused" in line


def test_http_against_a_grpc_port_says_so(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as rx:
        env = clean_env(**{ENDPOINT: rx.endpoint}, **FAST)  # http/protobuf, the default
        proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
        assert rx.spans == []
    line = _only_warning(proc)
    assert f"(OTLP {HTTP_PROTOBUF})" in line and "an OTLP/gRPC port?" in line
    assert f"set {PROTOCOL}=grpc" in line


def test_grpc_against_an_http_port_says_so(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        env = clean_env(**{TRACES_PROTOCOL: GRPC, ENDPOINT: rx.endpoint}, **FAST)
        proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
        assert rx.spans == []
    line = _only_warning(proc)
    assert f"(OTLP {GRPC})" in line and "an OTLP/HTTP port?" in line
    assert f"set {TRACES_PROTOCOL}=http/protobuf" in line  # the variable that chose grpc


# ---------------------------------------------------------------------------------------------
# the rules themselves
# ---------------------------------------------------------------------------------------------


def test_protocol_rules() -> None:
    assert otlp_protocol({}) == (HTTP_PROTOBUF, None)
    assert otlp_protocol({PROTOCOL: "grpc"}) == (GRPC, PROTOCOL)
    assert otlp_protocol({PROTOCOL: "grpc", TRACES_PROTOCOL: "http/protobuf"}) == (
        HTTP_PROTOBUF,
        TRACES_PROTOCOL,
    )
    assert otlp_protocol({PROTOCOL: "grpc", TRACES_PROTOCOL: "  "}) == (GRPC, PROTOCOL)
    with pytest.raises(TelemetrySetupError, match=r"OTLP/JSON"):
        otlp_protocol({PROTOCOL: "http/json"})
    with pytest.raises(TelemetrySetupError, match=r"\\x1b"):  # a value is shown escaped
        otlp_protocol({TRACES_PROTOCOL: "\x1b[31mred"})


def test_endpoint_rules() -> None:
    assert otlp_traces_endpoint(HTTP_PROTOBUF, {ENDPOINT: "http://h:4318"}) == (
        "http://h:4318/v1/traces"
    )
    assert otlp_traces_endpoint(HTTP_PROTOBUF, {ENDPOINT: "http://h:4318/"}) == (
        "http://h:4318/v1/traces"
    )
    assert otlp_traces_endpoint(HTTP_PROTOBUF, {ENDPOINT: "http://h/base"}) == (
        "http://h/base/v1/traces"
    )
    both = {ENDPOINT: "http://h:1", TRACES_ENDPOINT: "http://t:2/custom"}
    assert otlp_traces_endpoint(HTTP_PROTOBUF, both) == "http://t:2/custom"  # as it is
    assert otlp_traces_endpoint(GRPC, both) == "http://t:2/custom"
    assert otlp_traces_endpoint(GRPC, {ENDPOINT: "http://h:4317"}) == "http://h:4317"
    for protocol in (HTTP_PROTOBUF, GRPC):
        assert f"localhost:{OTLP_DEFAULT_PORTS[protocol]}" in otlp_traces_endpoint(protocol, {})


def test_warning_hides_credentials_and_hints_at_the_usual_port() -> None:
    watch = ExportWatch(OtlpTarget(HTTP_PROTOBUF, "http://user:secret@collector:4317/v1/traces"))
    assert watch.warning() is None
    watch.exported(10, ok=True)
    assert watch.warning() is None
    watch.exported(3, ok=False, error="ConnectionError: something")
    line = watch.warning()
    assert line is not None and "secret" not in line
    assert line.startswith("sluicegate: warning: 3 of 13 spans could not be exported to ")
    assert "http://collector:4317/v1/traces (OTLP http/protobuf)" in line
    assert f"port 4317 is the usual OTLP grpc port (set {PROTOCOL}=grpc?)" in line
