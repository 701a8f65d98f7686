"""Logging and tracing set-up for the command line (the library itself configures neither).

The OpenTelemetry SDK is imported lazily: the library depends on the API only, and the SDK comes
with the ``otel`` extra.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import structlog

from pipeline._cli.safe_text import terminal_safe

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "OTLP_ENDPOINT_VARS",
    "TelemetrySetupError",
    "configure_logging",
    "escape_controls",
    "setup_tracing",
]

OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
DEFAULT_SERVICE_NAME = "sluicegate"


class TelemetrySetupError(RuntimeError):
    """Tracing was asked for but cannot be set up (the SDK is missing)."""


def escape_controls(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor for readable lines: string values (ids, tool names, paths from the
    transcript) with control characters escaped, so none reaches the terminal raw. Other values
    are rendered with ``repr``, which escapes them already; JSON lines need neither."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = terminal_safe(value)
    return event_dict


def configure_logging(verbosity: int, json_lines: bool) -> None:
    """structlog to stderr. Must run before any SessionContext is built: the library's
    loggers copy the processor chain when they are created."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([] if json_lines else [escape_controls]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _missing_sdk(exc: ImportError) -> TelemetrySetupError:
    return TelemetrySetupError(
        f"exporting spans needs the OpenTelemetry SDK ({exc.name or exc}); "
        "install it with: pip install 'sluicegate[otel]'"
    )


def setup_tracing(console_spans: bool) -> TracerProvider | None:
    """An SDK tracer provider when an OTLP endpoint is configured or console spans are asked
    for; None (spans are no-ops) otherwise. The global provider is left alone."""
    exporting = any(os.environ.get(var) for var in OTLP_ENDPOINT_VARS)
    if not exporting and not console_spans:
        return None
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
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise _missing_sdk(exc) from None
        # the exporter reads the endpoint, headers and timeout from the standard env vars
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console_spans:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    return provider
