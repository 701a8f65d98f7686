"""The two span helpers every content-bearing span goes through: an exception is recorded by
its type alone, and a span started during the anthropic SDK's own call goes beside it."""

from __future__ import annotations

import anyio
import pytest
from opentelemetry.trace import Status, StatusCode

from pipeline.spans import ANTHROPIC_SDK_SCOPE, beside_sdk_call, content_safe_span
from pipeline.testing import SpanRecorder

SECRET = "MY-SECRET-PROMPT"


def test_an_exception_is_recorded_by_its_type_alone() -> None:
    spans = SpanRecorder()
    # the caller still gets the whole exception
    with pytest.raises(ValueError, match=SECRET), content_safe_span(spans.tracer, "work"):
        raise ValueError(f"could not parse: {SECRET}")
    [span] = spans.named("work")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError"
    assert span.events == ()


def test_a_status_set_inside_is_kept() -> None:
    spans = SpanRecorder()
    with pytest.raises(RuntimeError), content_safe_span(spans.tracer, "work") as span:
        span.set_status(Status(StatusCode.ERROR, "rate_limit"))
        raise RuntimeError("after the status")
    [done] = spans.named("work")
    assert done.status.description == "rate_limit"


def test_a_cancellation_is_no_failure() -> None:
    spans = SpanRecorder()

    async def cancelled() -> None:
        with anyio.move_on_after(0):
            with content_safe_span(spans.tracer, "work"):
                await anyio.sleep(1)

    anyio.run(cancelled)
    [span] = spans.named("work")
    assert span.status.status_code is StatusCode.UNSET
    assert span.events == ()


@pytest.mark.parametrize("scope", [ANTHROPIC_SDK_SCOPE, f"{ANTHROPIC_SDK_SCOPE}.bedrock"])
def test_a_span_started_during_an_sdk_call_goes_beside_it(scope: str) -> None:
    spans = SpanRecorder()
    sdk = spans.provider.get_tracer(scope)
    with (
        spans.tracer.start_as_current_span("caller") as caller,
        sdk.start_as_current_span("anthropic.messages.create"),
        spans.tracer.start_as_current_span("ours", context=beside_sdk_call()),
    ):
        pass
    [ours] = spans.named("ours")
    assert ours.parent is not None
    assert ours.parent.span_id == caller.get_span_context().span_id


def test_beside_a_root_sdk_call_is_a_trace_of_its_own() -> None:
    spans = SpanRecorder()
    sdk = spans.provider.get_tracer(ANTHROPIC_SDK_SCOPE)
    with (
        sdk.start_as_current_span("anthropic.messages.create") as call,
        spans.tracer.start_as_current_span("ours", context=beside_sdk_call()),
    ):
        pass
    [ours] = spans.named("ours")
    assert ours.parent is None
    assert ours.context.trace_id != call.get_span_context().trace_id


def test_any_other_current_span_is_left_as_the_parent() -> None:
    spans = SpanRecorder()
    other = spans.provider.get_tracer("some.other.library")
    with other.start_as_current_span("theirs"):
        assert beside_sdk_call() is None
    assert beside_sdk_call() is None  # no span at all
