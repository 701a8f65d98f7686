"""The gauges of the conversations a proxy holds (``WireMetrics.watch_held``), read by the
OpenTelemetry SDK's own reader: made once per meter provider, summing every index watched on
it, and forgetting an index once it is gone."""

from __future__ import annotations

import gc
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from pipeline.dropin.metrics import WireMetrics
from pipeline.tracing import METRIC


class _Index:
    """What a conversations index says of itself: how many held, what they last sent."""

    def __init__(self, held: int, size: int) -> None:
        self.held, self.held_bytes = held, size


def _read(index: _Index) -> tuple[int, int]:
    return index.held, index.held_bytes


def _gauges(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        m.name: [p.value for p in m.data.data_points]
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name in (METRIC.CONVERSATIONS_HELD, METRIC.CONVERSATIONS_HELD_SIZE)
    }


def test_two_apps_on_one_provider_are_summed_and_one_gone_is_forgotten() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    first, second = _Index(2, 1_000), _Index(1, 500)
    WireMetrics(provider).watch_held(first, _read)
    WireMetrics(provider).watch_held(second, _read)  # a second app, its own WireMetrics
    assert _gauges(reader) == {
        METRIC.CONVERSATIONS_HELD: [3],
        METRIC.CONVERSATIONS_HELD_SIZE: [1_500],
    }
    second.held, second.held_bytes = 4, 9_000  # read when collected, not when watched
    del first
    gc.collect()
    assert _gauges(reader) == {
        METRIC.CONVERSATIONS_HELD: [4],
        METRIC.CONVERSATIONS_HELD_SIZE: [9_000],
    }
    provider.shutdown()


def test_providers_are_gauged_apart() -> None:
    one, other = InMemoryMetricReader(), InMemoryMetricReader()
    providers = [MeterProvider(metric_readers=[one]), MeterProvider(metric_readers=[other])]
    indexes = [_Index(1, 10), _Index(5, 50)]
    for provider, index in zip(providers, indexes, strict=True):
        WireMetrics(provider).watch_held(index, _read)
    assert _gauges(one)[METRIC.CONVERSATIONS_HELD] == [1]
    assert _gauges(other)[METRIC.CONVERSATIONS_HELD_SIZE] == [50]
    for provider in providers:
        provider.shutdown()
