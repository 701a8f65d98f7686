"""Span helpers for spans that enclose message content: an exception that leaves one is
recorded by its type alone, and one started during the anthropic SDK's own call goes beside
that call's span, not inside it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

__all__ = ["ANTHROPIC_SDK_SCOPE", "beside_sdk_call", "content_safe_span"]

ANTHROPIC_SDK_SCOPE = "com.anthropic.sdk.python"
"""The instrumentation scope of the anthropic SDK's own spans (one ``CLIENT`` span per API call;
a platform client's scope adds a suffix to it)."""


def beside_sdk_call() -> otel_context.Context | None:
    """The context to start a span in so that it goes beside the anthropic SDK's call span
    rather than inside it, when that span is the current one (code run as the SDK's middleware
    runs inside its call); None when it is not (start in the current context).

    The SDK's GenAI span is the model call's alone: a pipeline pass is its sibling or its
    parent, never its child. The OpenTelemetry API does not say a span's parent; the SDK's spans
    do (``span.parent``), and a span of another implementation is left where it is."""
    span = trace.get_current_span()
    name = getattr(getattr(span, "instrumentation_scope", None), "name", None)
    # the platform clients add a suffix: ``com.anthropic.sdk.python.bedrock``...
    if not isinstance(name, str) or not (
        name == ANTHROPIC_SDK_SCOPE or name.startswith(f"{ANTHROPIC_SDK_SCOPE}.")
    ):
        return None
    parent = getattr(span, "parent", None)
    current = otel_context.get_current()
    if parent is None:  # the call's span starts a trace: so does the pass beside it
        return trace.set_span_in_context(trace.INVALID_SPAN, current)
    if not isinstance(parent, trace.SpanContext):
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), current)


@contextlib.contextmanager
def content_safe_span(tracer: trace.Tracer, name: str, **kwargs: Any) -> Iterator[trace.Span]:
    """``tracer.start_as_current_span(name, **kwargs)``, but an exception that leaves it is
    recorded by its type alone: its text may quote message content (a third-party stage's
    error, a ``StageError`` that carries it), and no span may hold content. The status is set
    to ERROR with the type's name unless the code inside set one (a more precise reason); no
    exception event is added. A cancellation leaves the status alone."""
    with tracer.start_as_current_span(
        name, record_exception=False, set_status_on_exception=False, **kwargs
    ) as span:
        try:
            yield span
        except Exception as exc:  # not a cancellation: that is no failure of the span's work
            status = getattr(span, "status", None)  # the SDK's spans say theirs; the API's do not
            if getattr(status, "status_code", StatusCode.UNSET) is StatusCode.UNSET:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
