"""Metrics for the command line: a meter provider from the standard ``OTEL_*`` variables.

- ``OTEL_METRICS_EXPORTER``: ``otlp`` (the default when an OTLP endpoint is configured),
  ``prometheus`` (a scrape endpoint on ``OTEL_EXPORTER_PROMETHEUS_HOST``:``..._PORT``, default
  ``localhost:9464``; needs the ``prometheus`` extra), ``console`` (stderr), or ``none``;
- the OTLP exporter reads its endpoint (``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``/v1/metrics``), headers and protocol itself;
  ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) sets how often it exports.

The SDK is imported lazily (the ``otel`` extra); the library itself uses the API only.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from pipeline._cli.safe_text import terminal_safe
from pipeline._cli.telemetry import (
    GRPC,
    GRPC_EXTRA,
    OTLP_ENDPOINT_VARS,
    TelemetrySetupError,
    otlp_protocol,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader

__all__ = ["METRICS_ENDPOINT_VAR", "PROMETHEUS_EXTRA", "setup_metrics"]

METRICS_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
PROMETHEUS_EXTRA = "prometheus"
_EXPORTER_VAR = "OTEL_METRICS_EXPORTER"
_CHOICES = ("otlp", "prometheus", "console", "none")


def setup_metrics() -> MeterProvider | None:
    """An SDK meter provider for what the variables ask (see the module); None when they ask
    for nothing (no exporter named and no OTLP endpoint) or for ``none``. Raises
    :class:`~pipeline._cli.telemetry.TelemetrySetupError` for an unknown exporter or a missing
    package, before anything runs."""
    chosen = os.environ.get(_EXPORTER_VAR, "").strip().lower()
    if not chosen:
        endpoint = os.environ.get(METRICS_ENDPOINT_VAR) or os.environ.get(OTLP_ENDPOINT_VARS[0])
        chosen = "otlp" if endpoint else "none"
    if chosen not in _CHOICES:
        shown = terminal_safe(chosen, limit=40)
        raise TelemetrySetupError(
            f"{_EXPORTER_VAR}={shown} is not supported; use one of {', '.join(_CHOICES)}"
        )
    if chosen == "none":
        return None
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    except ImportError as exc:
        raise TelemetrySetupError(
            f"exporting metrics needs the OpenTelemetry SDK ({exc.name or exc}); "
            "install it with: pip install 'sluicegate[otel]'"
        ) from None
    service = os.environ.get("OTEL_SERVICE_NAME") or "sluicegate"
    reader = _reader(chosen)
    return MeterProvider(metric_readers=[reader], resource=Resource.create({SERVICE_NAME: service}))


def _reader(chosen: str) -> MetricReader:
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    if chosen == "console":
        return PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr))
    if chosen == "prometheus":
        return _prometheus()
    protocol, var = otlp_protocol()
    try:
        if protocol == GRPC:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter as GrpcMetricExporter,
                )
            except ImportError as exc:
                raise TelemetrySetupError(
                    f"{var}=grpc needs the OTLP/gRPC exporter ({exc.name or exc}); "
                    f"install it with: pip install 'sluicegate[{GRPC_EXTRA}]'"
                ) from None
            return PeriodicExportingMetricReader(GrpcMetricExporter())
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError as exc:
            raise TelemetrySetupError(
                f"exporting metrics needs the OTLP exporter ({exc.name or exc}); "
                "install it with: pip install 'sluicegate[otel]'"
            ) from None
        return PeriodicExportingMetricReader(OTLPMetricExporter())
    except TelemetrySetupError:
        raise
    except Exception as exc:  # a bad header, certificate or compression value
        raise TelemetrySetupError(f"cannot set up OTLP metric export: {exc}") from None


def _prometheus() -> MetricReader:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise TelemetrySetupError(
            f"{_EXPORTER_VAR}=prometheus needs its exporter ({exc.name or exc}); "
            f"install it with: pip install 'sluicegate[{PROMETHEUS_EXTRA}]'"
        ) from None
    host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
    raw = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT") or "9464"
    try:
        port = int(raw)
        if not 0 <= port <= 65_535:
            raise ValueError
    except ValueError:
        shown = terminal_safe(raw, limit=20)
        raise TelemetrySetupError(f"OTEL_EXPORTER_PROMETHEUS_PORT={shown} is not a port") from None
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise TelemetrySetupError(
            f"cannot serve Prometheus metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None
    return PrometheusMetricReader()
