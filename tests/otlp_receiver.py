"""A tiny OTLP/HTTP trace and metric receiver for tests: the real wire format, decoded by
opentelemetry-proto.

Start it with ``with OtlpReceiver() as rx:``; point an exporter at ``rx.traces_endpoint`` (or
``rx.endpoint`` for traces and metrics); read ``rx.spans`` and ``rx.points`` (flattened,
attributes decoded to plain Python values).
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedPoint", "ReceivedSpan"]

TRACES_PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"


@dataclass(frozen=True, slots=True)
class ReceivedPoint:
    """One exported data point: a counter's value, or a histogram's count and sum."""

    metric: str
    unit: str
    attributes: dict[str, Any]
    value: float
    """A sum's value; a histogram's sum."""
    count: int = 1
    """A histogram's count (1 for a sum)."""


def decode_metrics(body: bytes) -> list[ReceivedPoint]:
    """The data points of one ``ExportMetricsServiceRequest`` protobuf body."""
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    points: list[ReceivedPoint] = []
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind == "sum":
                    for p in m.sum.data_points:
                        value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
                        attrs = {kv.key: _value(kv.value) for kv in p.attributes}
                        points.append(ReceivedPoint(m.name, m.unit, attrs, value))
                elif kind == "histogram":
                    for h in m.histogram.data_points:
                        attrs = {kv.key: _value(kv.value) for kv in h.attributes}
                        points.append(ReceivedPoint(m.name, m.unit, attrs, h.sum, h.count))
    return points


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span, with ids as hex strings (``parent_span_id`` is "" for a root)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    links: tuple[str, ...] = ()
    """The span ids this span links to."""
    start_ns: int = 0
    end_ns: int = 0
    status: str = "UNSET"
    """``UNSET``, ``OK`` or ``ERROR``."""


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest`` protobuf body."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        resource=resource,
                        scope=ss.scope.name,
                        links=tuple(link.span_id.hex() for link in s.links),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status=("UNSET", "OK", "ERROR")[s.status.code],
                    )
                )
    return spans


class _Handler(BaseHTTPRequestHandler):
    def sink(self, body: bytes, path: str) -> int:
        """Take one request body; return the HTTP status to answer with."""
        raise NotImplementedError

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        encoding = (self.headers.get("Content-Encoding") or "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        status = self.sink(body, self.path)
        response = (
            ExportMetricsServiceResponse()
            if self.path == METRICS_PATH
            else ExportTraceServiceResponse()
        )
        payload = response.SerializeToString() if status == 200 else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        return


class OtlpReceiver:
    """An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1 and a random port, in a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._points: list[ReceivedPoint] = []
        self.requests = 0
        self.bad_paths: list[str] = []
        receiver = self

        class Handler(_Handler):
            def sink(self, body: bytes, path: str) -> int:
                return receiver._accept(body, path)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _accept(self, body: bytes, path: str) -> int:
        if path == METRICS_PATH:
            points = decode_metrics(body)
            with self._lock:
                self._points.extend(points)
            return 200
        if path != TRACES_PATH:
            with self._lock:
                self.bad_paths.append(path)
            return 404
        spans = decode(body)
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1
        return 200

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def traces_endpoint(self) -> str:
        """The full URL for ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}{TRACES_PATH}"

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter appends the path)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    @property
    def points(self) -> list[ReceivedPoint]:
        """Every metric data point received so far (cumulative: the last export of a metric
        holds its totals)."""
        with self._lock:
            return list(self._points)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10
    ) -> bool:
        """Wait until ``predicate(spans)`` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.spans):
                return True
            time.sleep(0.05)
        return predicate(self.spans)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
