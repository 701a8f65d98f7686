"""Logging and tracing set-up for the command line (the library itself configures neither).

The OpenTelemetry SDK is imported lazily: the library depends on the API only, and the SDK comes
with the ``otel`` extra.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal
from urllib.parse import SplitResult, urlsplit, urlunsplit

from pipeline._cli.logging_setup import say
from pipeline._cli.safe_text import terminal_safe

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "DEFAULT_OTLP_PROTOCOL",
    "DEFAULT_SERVICE_NAME",
    "GRPC",
    "GRPC_EXTRA",
    "HTTP_PROTOBUF",
    "OTLP_DEFAULT_PORTS",
    "OTLP_ENDPOINT_VARS",
    "OTLP_PROTOCOL_VARS",
    "ExportWatch",
    "OtlpProtocol",
    "OtlpTarget",
    "TelemetrySetupError",
    "otlp_protocol",
    "otlp_traces_endpoint",
    "setup_tracing",
]

OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
DEFAULT_SERVICE_NAME = "sluicegate"

OtlpProtocol = Literal["http/protobuf", "grpc"]
"""The OTLP protocols spans can be exported with."""
HTTP_PROTOBUF: Final = "http/protobuf"
GRPC: Final = "grpc"
DEFAULT_OTLP_PROTOCOL: Final = HTTP_PROTOBUF
OTLP_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
"""The protocol variables, the one that wins first (the OTel specification's order)."""
OTLP_DEFAULT_PORTS: Final[Mapping[OtlpProtocol, int]] = {HTTP_PROTOBUF: 4318, GRPC: 4317}
"""The standard port of each protocol: the default endpoint, and what receivers listen on."""
GRPC_EXTRA: Final = "otel-grpc"
"""The extra that installs the OTLP/gRPC exporter."""
_HTTP_TRACES_PATH = "v1/traces"
_EXPORTER_LOGGER = "opentelemetry.exporter"


class TelemetrySetupError(RuntimeError):
    """Tracing was asked for but cannot be set up (the SDK or the chosen exporter is missing,
    an unsupported OTLP protocol is configured)."""


def _missing_sdk(exc: ImportError) -> TelemetrySetupError:
    return TelemetrySetupError(
        f"exporting spans needs the OpenTelemetry SDK ({exc.name or exc}); "
        "install it with: pip install 'sluicegate[otel]'"
    )


def _missing_grpc_exporter(var: str | None, exc: ImportError) -> TelemetrySetupError:
    return TelemetrySetupError(
        f"{var or OTLP_PROTOCOL_VARS[-1]}=grpc needs the OTLP/gRPC exporter "
        f"({exc.name or exc}); install it with: pip install 'sluicegate[{GRPC_EXTRA}]'"
    )


def otlp_protocol(environ: Mapping[str, str] = os.environ) -> tuple[OtlpProtocol, str | None]:
    """The OTLP protocol spans are exported with and the variable that chose it (None: the
    default, ``http/protobuf``). ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` wins over
    ``OTEL_EXPORTER_OTLP_PROTOCOL``; an empty value counts as unset. Any value other than
    ``http/protobuf`` or ``grpc`` (``http/json`` included) raises :class:`TelemetrySetupError`
    naming the variable."""
    for var in OTLP_PROTOCOL_VARS:
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        value = raw.lower()
        for protocol in (HTTP_PROTOBUF, GRPC):
            if value == protocol:
                return protocol, var
        shown = terminal_safe(raw, limit=80)
        why = " (no OTLP/JSON exporter is available)" if value == "http/json" else ""
        raise TelemetrySetupError(
            f"{var}={shown} is not supported{why}; "
            f"use {HTTP_PROTOBUF} (the default) or {GRPC}, or unset it"
        )
    return DEFAULT_OTLP_PROTOCOL, None


def otlp_traces_endpoint(protocol: OtlpProtocol, environ: Mapping[str, str] = os.environ) -> str:
    """The endpoint spans go to, by the OTLP exporter rules: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    as it is; else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``http://localhost:<port>``) with
    ``/v1/traces`` appended for ``http/protobuf``, and as it is for ``grpc`` (the exporter uses
    its host:port; ``http://`` means an insecure channel)."""
    traces = environ.get(OTLP_ENDPOINT_VARS[1])
    if traces:
        return traces
    base = environ.get(OTLP_ENDPOINT_VARS[0]) or f"http://localhost:{OTLP_DEFAULT_PORTS[protocol]}"
    if protocol == GRPC:
        return base
    return f"{base.removesuffix('/')}/{_HTTP_TRACES_PATH}"


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    """Where spans are exported and how."""

    protocol: OtlpProtocol
    endpoint: str
    """As the exporter is given it (a full URL for ``http/protobuf``)."""
    protocol_var: str | None = None
    """The variable that chose the protocol (None: the default)."""


def setup_tracing(console_spans: bool) -> TracerProvider | None:
    """An SDK tracer provider when an OTLP endpoint is configured or console spans are asked
    for; None (spans are no-ops) otherwise. The global provider is left alone.

    The protocol comes from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (see :func:`otlp_protocol`); headers, timeout, compression
    and certificates are read from the standard variables by the exporter itself. Spans that
    could not be exported are reported as one ``sluicegate: warning:`` line on stderr when the
    provider shuts down. Raises :class:`TelemetrySetupError` (a bad protocol value, a missing
    SDK or exporter) before anything runs.
    """
    exporting = any(os.environ.get(var) for var in OTLP_ENDPOINT_VARS)
    if not exporting and not console_spans:
        return None
    # the protocol is checked only when spans are exported: it matters for nothing else
    protocol, protocol_var = otlp_protocol() if exporting else (DEFAULT_OTLP_PROTOCOL, None)
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as exc:
        raise _missing_sdk(exc) from None
    service = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    if exporting:
        target = OtlpTarget(protocol, otlp_traces_endpoint(protocol), protocol_var)
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(target)))
    if console_spans:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    return provider


def _otlp_exporter(target: OtlpTarget) -> SpanExporter:
    """The OTLP exporter of ``target.protocol``, watched for failed exports."""
    try:
        if target.protocol == GRPC:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcSpanExporter,
                )
            except ImportError as exc:
                raise _missing_grpc_exporter(target.protocol_var, exc) from None
            # insecure unless the endpoint is https:// (or OTEL_EXPORTER_OTLP_INSECURE says so)
            inner: SpanExporter = GrpcSpanExporter(endpoint=target.endpoint)
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpSpanExporter,
                )
            except ImportError as exc:
                raise _missing_sdk(exc) from None
            inner = HttpSpanExporter(endpoint=target.endpoint)
    except TelemetrySetupError:
        raise
    except Exception as exc:  # a bad compression, certificate or header value
        raise TelemetrySetupError(f"cannot set up OTLP {target.protocol} export: {exc}") from None
    return _watched(inner, ExportWatch(target))


def _watched(inner: SpanExporter, watch: ExportWatch) -> SpanExporter:
    """``inner`` with its results counted by ``watch``, which reports at shutdown."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class WatchedExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception as exc:  # counted and explained, not a traceback from a thread
                watch.exported(len(spans), ok=False, error=f"{type(exc).__name__}: {exc}")
                return SpanExportResult.FAILURE
            watch.exported(len(spans), ok=result is SpanExportResult.SUCCESS)
            return result

        def shutdown(self) -> None:
            try:
                inner.shutdown()
            finally:
                watch.finish()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return inner.force_flush(timeout_millis)

    watch.start()
    return WatchedExporter()


class ExportWatch(logging.Handler):
    """Counts the spans an OTLP exporter failed to send, and keeps the exporter's own log
    records (retry and failure messages, which would otherwise reach stderr unformatted, one
    per attempt) to explain the failure in one ``sluicegate: warning:`` line at the end."""

    _MAX_KEPT = 20

    def __init__(self, target: OtlpTarget) -> None:
        super().__init__(logging.WARNING)
        self.target = target
        self.spans = 0
        self.failed = 0
        self.messages: list[str] = []
        self._counts = threading.Lock()
        self._saved_propagate: bool | None = None

    def start(self) -> None:
        """Take the exporters' log records (``opentelemetry.exporter.*``) until :meth:`finish`."""
        logger = logging.getLogger(_EXPORTER_LOGGER)
        self._saved_propagate = logger.propagate
        logger.addHandler(self)
        logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        """Keep one exporter log record's message."""
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format
            message = str(record.msg)
        with self._counts:
            if len(self.messages) < self._MAX_KEPT:
                self.messages.append(message)
            else:
                self.messages[-1] = message

    def exported(self, count: int, *, ok: bool, error: str | None = None) -> None:
        """Count one export call of ``count`` spans."""
        with self._counts:
            self.spans += count
            if not ok:
                self.failed += count
                if error is not None and len(self.messages) < self._MAX_KEPT:
                    self.messages.append(error)

    def finish(self) -> None:
        """Give the exporters' log records back, and print the warning if spans were lost."""
        logger = logging.getLogger(_EXPORTER_LOGGER)
        logger.removeHandler(self)
        if self._saved_propagate is not None:
            logger.propagate = self._saved_propagate
            self._saved_propagate = None
        try:
            line = self.warning()
        except Exception as exc:  # a warning that cannot be built must not fail the command
            line = f"sluicegate: warning: spans could not be exported ({type(exc).__name__})"
        if line is not None:
            say(line, "telemetry.export_failed")

    def warning(self) -> str | None:
        """The ``sluicegate: warning:`` line for the spans that were lost, or None."""
        with self._counts:
            if self.failed == 0:
                return None
            failed, spans, messages = self.failed, self.spans, list(self.messages)
        text = "\n".join(messages)
        target = self.target
        other: OtlpProtocol = HTTP_PROTOBUF if target.protocol == GRPC else GRPC
        mismatch = False
        if target.protocol == HTTP_PROTOBUF and "BadStatusLine" in text:
            reason, mismatch = "the endpoint does not answer HTTP/1.1 (an OTLP/gRPC port?)", True
        elif target.protocol == GRPC and ("Failed parsing HTTP/2" in text or "http1" in text):
            reason, mismatch = "the endpoint does not speak HTTP/2 (an OTLP/HTTP port?)", True
        elif "refused" in text.lower():
            reason = "connection refused"
        elif "timed out" in text.lower() or "DEADLINE_EXCEEDED" in text:
            reason = "timed out"
        else:
            # the HTTP exporter names the error only when it has time left to retry: ask the
            # network whether the endpoint can be reached at all
            first = messages[0] if messages else "the exporter gave no reason"
            shown = _without_secrets(first, target.endpoint)
            reason = _unreachable(target.endpoint) or terminal_safe(shown, limit=200)
        port = _port_of(target.endpoint)
        var = target.protocol_var or OTLP_PROTOCOL_VARS[-1]
        hint = ""
        if mismatch:
            hint = f"; to export over OTLP {other}, set {var}={other}"
        elif port == OTLP_DEFAULT_PORTS[other]:
            hint = f"; port {port} is the usual OTLP {other} port (set {var}={other}?)"
        elif "code: 404" in text and os.environ.get(OTLP_ENDPOINT_VARS[1]):
            hint = (
                f"; {OTLP_ENDPOINT_VARS[1]} is used as it is: does it end in /{_HTTP_TRACES_PATH}?"
            )
        return (
            f"sluicegate: warning: {failed} of {spans} spans could not be exported to "
            f"{_shown_endpoint(target.endpoint)} (OTLP {target.protocol}): {reason}{hint}"
        )


def _split(endpoint: str) -> SplitResult:
    """An endpoint URL, or a gRPC ``host:port``, split."""
    return urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")


def _port_of(endpoint: str) -> int | None:
    """The port of an endpoint URL or ``host:port``; None when it names none."""
    try:
        return _split(endpoint).port
    except ValueError:
        return None


def _without_secrets(message: str, endpoint: str) -> str:
    """An exporter's message with the endpoint as given (it may hold a password or a token in
    its query) replaced by the shown one, and any other ``user:password@`` cut out."""
    if endpoint:
        message = message.replace(endpoint, _shown_endpoint(endpoint))
    return _USERINFO.sub(r"\1***@", message)


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://|'|\s|^)[^\s/@'\"]+:[^\s/@'\"]*@")


def _unreachable(endpoint: str) -> str | None:
    """Why no TCP connection to ``endpoint`` can be opened (within a second), or None when one
    can (or the endpoint names no host, or cannot be read as a URL)."""
    try:
        parts = _split(endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        return terminal_safe(f"the endpoint is not a valid URL ({exc})", limit=200)
    if not parts.hostname:
        return None
    try:
        with socket.create_connection((parts.hostname, port), timeout=1):
            return None
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no answer from {terminal_safe(parts.hostname, limit=100)}:{port}"
    except OSError as exc:  # a name that does not resolve, a network that is down
        return terminal_safe(f"cannot connect: {exc.strerror or exc}", limit=200)


def _shown_endpoint(endpoint: str) -> str:
    """``endpoint`` for a message: any ``user:password@`` and query left out, control characters
    escaped (an endpoint that is no valid URL is cut short)."""
    try:
        parts = _split(endpoint)
    except ValueError:
        return terminal_safe(endpoint.rpartition("@")[2], limit=100)
    netloc = parts.netloc.rpartition("@")[2]
    endpoint = urlunsplit(parts._replace(netloc=netloc, query="")).removeprefix("//")
    return terminal_safe(endpoint, limit=300)
