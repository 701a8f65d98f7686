"""What a client names bounds no metric: the model a request names is a label of the upstream
instruments, cut as a span attribute is and counted under ``other`` past a number of models
(``WireMetrics``), read by the OpenTelemetry SDK's own reader."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from pipeline.dropin.metrics import MAX_MODEL_LABELS, OTHER_MODELS, WireMetrics
from pipeline.tracing import ATTR, MAX_ATTRIBUTE_CHARS, METRIC


def _models(reader: InMemoryMetricReader) -> list[str]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        str(p.attributes[ATTR.REQUEST_MODEL])
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == METRIC.GENAI_OPERATION_DURATION
        for p in m.data.data_points
    ]


def test_models_a_client_names_are_labels_bounded_in_length_and_number() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = WireMetrics(provider)
    metrics.upstream(seconds=0.1, model="claude-test", status=200, tokens={})
    for k in range(3 * MAX_MODEL_LABELS):
        metrics.upstream(seconds=0.1, model=f"m{k}-" + "x" * 3_000, status=404, tokens={})
    metrics.upstream(seconds=0.1, model="claude-test", status=200, tokens={})  # still its own
    models = _models(reader)
    assert len(set(models)) == MAX_MODEL_LABELS + 1
    assert OTHER_MODELS in models and "claude-test" in models
    assert max(len(m) for m in models) <= MAX_ATTRIBUTE_CHARS
    provider.shutdown()


def test_the_bound_holds_for_every_app_on_one_provider() -> None:
    """Each ``wrap``ped client and proxy app makes its own ``WireMetrics``: on one meter
    provider they share the bound."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    for app in range(5):
        metrics = WireMetrics(provider)
        for k in range(MAX_MODEL_LABELS):
            metrics.upstream(seconds=0.1, model=f"app{app}-model{k}", status=200, tokens={})
    assert len(set(_models(reader))) == MAX_MODEL_LABELS + 1
    provider.shutdown()
