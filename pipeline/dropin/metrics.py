"""What a drop-in counts (``wrap``, the proxy), through the OpenTelemetry metrics API.

The library depends on the API only: with no SDK installed, or none configured, every
instrument is a no-op. An application gives a ``MeterProvider`` (the command line does, from
the standard ``OTEL_*`` variables) or configures the global one. Names follow the OpenTelemetry
HTTP and GenAI semantic conventions where they exist (:mod:`pipeline.tracing` holds them all):

- ``http.server.request.duration`` (s): each request the proxy answered, by method, route and
  status -- its count is the request count by status;
- ``gen_ai.client.operation.duration`` (s): each upstream call, from sending it to the end of
  its response; ``gen_ai.client.token.usage`` ({token}): the response's input and output
  tokens (``gen_ai.token.type``); ``gen_ai.client.inference.usage.cache_read.input_tokens`` and
  ``...cache_write.input_tokens``: the cache's;
- ``sluicegate.pipeline.duration`` (s): each request's pipeline pass;
  ``sluicegate.tool_results.persisted`` ({result}): results newly persisted, by reason;
  ``sluicegate.chars.kept_off_wire`` ({char}): characters of tool output a request did not
  carry because a replacement stood in for it (counted in every request that re-applies it);
- ``sluicegate.conversations.held`` ({conversation}) and ``sluicegate.conversations.held.size``
  (By), gauges read when the metrics are collected: the conversations the proxy holds in
  memory and what their last requests come to, each its body's bytes and 2 KiB a message
  (its resident size grows by ~0.7-1.5 times that; both bounded: ``--max-conversations``,
  ``--max-held-size``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar, cast

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from pipeline.tracing import ATTR, METRIC, TRACER_NAME, AttributeValue, bounded_attribute

__all__ = ["WireMetrics"]

T = TypeVar("T")

_Watched = list[tuple["weakref.ref[object]", Callable[[object], tuple[int, int]]]]
_WATCHED: dict[int, tuple[object, _Watched]] = {}
"""By meter provider (held, so that its id stays its own): what its gauges of conversations
held sum (:meth:`WireMetrics.watch_held`)."""
_WATCHED_LOCK = threading.Lock()
_MODELS: dict[int, tuple[object, set[str]]] = {}
"""By meter provider (held, as above): the model labels its instruments were given."""

_TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304]
_SECOND_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


MAX_MODEL_LABELS = 64
"""Distinct ``gen_ai.request.model`` labels the drop-ins' metrics give on one meter provider
(every proxy app and ``wrap``ped client on it); later models are
counted under :data:`OTHER_MODELS`."""
OTHER_MODELS = "other"


class WireMetrics:
    """The instruments of a drop-in, made once from ``meter_provider`` (default: the global
    one)."""

    def __init__(self, meter_provider: metrics.MeterProvider | None = None) -> None:
        meter = self._meter = metrics.get_meter(TRACER_NAME, meter_provider=meter_provider)
        self._provider = meter_provider or metrics.get_meter_provider()
        with _WATCHED_LOCK:
            entry = _MODELS.setdefault(id(self._provider), (self._provider, set()))
        self._models = entry[1]
        """The model labels given on this provider (by every app on it: at most
        :data:`MAX_MODEL_LABELS`)."""
        self.http_duration = meter.create_histogram(
            METRIC.HTTP_SERVER_DURATION,
            unit="s",
            description="Requests the proxy answered",
            explicit_bucket_boundaries_advisory=_SECOND_BUCKETS,
        )
        self.operation_duration = meter.create_histogram(
            METRIC.GENAI_OPERATION_DURATION,
            unit="s",
            description="Upstream Messages calls, sending to the end of the response",
            explicit_bucket_boundaries_advisory=_SECOND_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            METRIC.GENAI_TOKEN_USAGE,
            unit="{token}",
            description="Input and output tokens of each response",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self.cache_read = meter.create_counter(
            METRIC.GENAI_CACHE_READ, unit="{token}", description="Input tokens read from cache"
        )
        self.cache_write = meter.create_counter(
            METRIC.GENAI_CACHE_WRITE, unit="{token}", description="Input tokens written to cache"
        )
        self.pipeline_duration = meter.create_histogram(
            METRIC.PIPELINE_DURATION,
            unit="s",
            description="The pipeline pass of each request",
            explicit_bucket_boundaries_advisory=_SECOND_BUCKETS,
        )
        self.persisted = meter.create_counter(
            METRIC.PERSISTED, unit="{result}", description="Tool results newly persisted"
        )
        self.kept_off = meter.create_counter(
            METRIC.KEPT_OFF_WIRE,
            unit="{char}",
            description="Tool-output characters a request did not carry (a replacement did)",
        )

    def watch_held(self, held: T, read: Callable[[T], tuple[int, int]]) -> None:
        """Gauge what ``read(held)`` says -- conversations held, the bytes of their last
        requests -- whenever the metrics are collected, for as long as ``held`` lives (held
        weakly: a meter outlives the apps whose instruments it made). The gauges are made once
        per meter provider (a second instrument of a name would be dropped) and sum every
        ``held`` watched on it: what the process holds."""
        with _WATCHED_LOCK:
            entry = _WATCHED.get(id(self._provider))
            first = entry is None
            if entry is None:
                entry = _WATCHED[id(self._provider)] = (self._provider, [])
            watched = entry[1]
            watched.append((weakref.ref(held), cast("Callable[[object], tuple[int, int]]", read)))
        if not first:
            return

        def observed(at: int) -> Callable[[CallbackOptions], Iterator[Observation]]:
            def callback(_options: CallbackOptions) -> Iterator[Observation]:
                with _WATCHED_LOCK:  # those let go are forgotten here
                    live = [(ref, r, t) for ref, r in watched if (t := ref()) is not None]
                    watched[:] = [(ref, r) for ref, r, _ in live]
                yield Observation(sum(r(t)[at] for _, r, t in live))

            return callback

        self._meter.create_observable_gauge(
            METRIC.CONVERSATIONS_HELD,
            callbacks=[observed(0)],
            unit="{conversation}",
            description="Conversations held in memory",
        )
        self._meter.create_observable_gauge(
            METRIC.CONVERSATIONS_HELD_SIZE,
            callbacks=[observed(1)],
            unit="By",
            description="The bytes of the last request of each conversation held, summed",
        )

    def request(
        self, *, status: int, seconds: float, method: str = "POST", route: str = "/v1/messages"
    ) -> None:
        """One request answered (the proxy's)."""
        self.http_duration.record(
            seconds,
            {
                ATTR.HTTP_METHOD: method,
                ATTR.HTTP_ROUTE: route,
                ATTR.HTTP_STATUS: status,
            },
        )

    def passed(self, *, seconds: float, persisted: Mapping[str, int], kept_off: int) -> None:
        """One pipeline pass: how long, what it persisted by reason, what it kept off."""
        self.pipeline_duration.record(seconds)
        for reason, count in persisted.items():
            self.persisted.add(count, {ATTR.REASON: reason})
        if kept_off:
            self.kept_off.add(kept_off)

    def _model_label(self, model: str) -> str:
        """``model`` as a label: cut as a span attribute is, and :data:`OTHER_MODELS` once
        :data:`MAX_MODEL_LABELS` others were given (the client names the model: each name a
        series of every instrument it labels, without this bound)."""
        label = bounded_attribute(model)
        models = self._models
        if label not in models:
            with _WATCHED_LOCK:
                if len(models) >= MAX_MODEL_LABELS:
                    return OTHER_MODELS
                models.add(label)
        return label

    def upstream(
        self, *, seconds: float, model: str | None, status: int, tokens: Mapping[str, int]
    ) -> None:
        """One upstream call, ended: its duration and the tokens its response reported (as
        :func:`pipeline.dropin.wire_request.usage_attributes` counts them; none when it failed)."""
        attributes: dict[str, AttributeValue] = {
            ATTR.OPERATION_NAME: "chat",
            ATTR.PROVIDER_NAME: "anthropic",
        }
        if model:
            attributes[ATTR.REQUEST_MODEL] = self._model_label(model)
        if status >= 400:
            attributes[ATTR.ERROR_TYPE] = str(status)
        self.operation_duration.record(seconds, attributes)
        for kind, key in (
            ("input", ATTR.USAGE_INPUT_TOKENS),
            ("output", ATTR.USAGE_OUTPUT_TOKENS),
        ):
            if key in tokens:
                self.token_usage.record(tokens[key], {**attributes, ATTR.TOKEN_TYPE: kind})
        for counter, key in (
            (self.cache_read, ATTR.USAGE_CACHE_READ_TOKENS),
            (self.cache_write, ATTR.USAGE_CACHE_WRITE_TOKENS),
        ):
            if tokens.get(key, 0) > 0:
                counter.add(tokens[key], attributes)
