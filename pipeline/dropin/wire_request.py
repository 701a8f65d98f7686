"""One client request at the wire (``wrap``, the proxy), seen through to its end: its span, its
measures and its access-log line.

:class:`WireRequest` starts the ``wire.request`` span (the pass becomes its child, and so does
the ``wire.upstream`` span of the call it sends, from sending to the response's end) and keeps it
open until the response has gone by -- a streamed one included -- so the span can say what the
call cost: the GenAI request model, the response's id and model, its token usage (input,
output, cache read and write), how long the pipeline and the upstream took, and the
server-side context edits the API reports it applied. At its end it records the metrics
(:class:`~pipeline.dropin.metrics.WireMetrics`) and logs one ``wire.request`` event: conversation,
tenant, call, status, durations, what the pass persisted and re-applied, characters in and
out, tokens; a failure (an unreachable upstream, a refused request) included, with the error's
type. Neither the span nor the line holds content.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from pipeline.tracing import ATTR, SPAN_WIRE_UPSTREAM, AttributeValue, bounded_attribute

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from pipeline.context import PassReport
    from pipeline.dropin.adapter import WireSession
    from pipeline.dropin.metrics import WireMetrics

__all__ = ["CLIENT_LEFT", "WireRequest", "usage_attributes"]

CLIENT_LEFT = "client_disconnected"
"""The error of a request whose client went away before its answer was whole."""

_USAGE_ATTRIBUTES = (
    ("output_tokens", ATTR.USAGE_OUTPUT_TOKENS),
    ("cache_read_input_tokens", ATTR.USAGE_CACHE_READ_TOKENS),
    ("cache_creation_input_tokens", ATTR.USAGE_CACHE_WRITE_TOKENS),
)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_attributes(usage: Mapping[str, Any]) -> dict[str, int]:
    """A response's ``usage`` as GenAI span attributes (integer counts only). Input tokens are
    counted as the GenAI conventions count them, the cached ones included: the API's
    ``input_tokens`` is only what came after its last cache breakpoint."""
    counts = {
        key: n for field, key in _USAGE_ATTRIBUTES if (n := _count(usage.get(field))) is not None
    }
    uncached = _count(usage.get("input_tokens"))
    if uncached is not None:
        counts[ATTR.USAGE_INPUT_TOKENS] = (
            uncached
            + counts.get(ATTR.USAGE_CACHE_READ_TOKENS, 0)
            + counts.get(ATTR.USAGE_CACHE_WRITE_TOKENS, 0)
        )
    iterations = usage.get("iterations")
    compactions = [
        i for i in (iterations if isinstance(iterations, list) else []) if _is_compaction(i)
    ]
    if compactions:
        for key, fields in _COMPACTION_ATTRIBUTES:
            counts[key] = sum(_count(i.get(f)) or 0 for i in compactions for f in fields)
    return counts


_COMPACTION_ATTRIBUTES = (
    (
        ATTR.COMPACTION_INPUT_TOKENS,
        ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"),
    ),
    (ATTR.COMPACTION_OUTPUT_TOKENS, ("output_tokens",)),
)


def _is_compaction(iteration: Any) -> bool:
    return isinstance(iteration, Mapping) and iteration.get("type") == "compaction"


def applied_edits(context_management: Any) -> list[str]:
    """The types of the edits a response's ``context_management.applied_edits`` lists."""
    edits = (
        context_management.get("applied_edits") if isinstance(context_management, Mapping) else None
    )
    if not isinstance(edits, list):
        return []
    return [str(e["type"])[:64] for e in edits if isinstance(e, Mapping) and "type" in e][:32]


def _set_http_status(span: trace.Span, status: int) -> None:
    span.set_attribute(ATTR.HTTP_STATUS, status)
    if status >= 400:
        span.set_status(Status(StatusCode.ERROR, f"upstream status {status}"))


class WireRequest:
    """One client request of ``session`` (see the module docstring). ``messages``: how many
    the client sent; ``body``: its JSON (the model and stream flag are read from it);
    ``chars_in``: its size as received (the proxy: its body's length); ``context``: where to
    start the span (default: the current context); ``metrics``: where to count it."""

    def __init__(
        self,
        session: WireSession,
        body: Mapping[str, Any],
        *,
        chars_in: int | None = None,
        context: Context | None = None,
        metrics: WireMetrics | None = None,
        tenant: str | None = None,
    ) -> None:
        self.session = session
        self.metrics = metrics
        self.started = time.monotonic()
        model = body.get("model")
        self.model = bounded_attribute(model) if isinstance(model, str) else None
        messages = body.get("messages")
        self.fields: dict[str, Any] = {
            "session_id": session.session_id,
            "tenant": tenant,
            "model": self.model,
            "stream": bool(body.get("stream")),
            "messages": len(messages) if isinstance(messages, list) else 0,
            "chars_in": chars_in,
        }
        self.span = session.start_request_span(self.fields["messages"], context=context)
        self.fields["call"] = session.ctx.call
        attributes: dict[str, AttributeValue] = {ATTR.REQUEST_STREAM: self.fields["stream"]}
        if self.model:
            attributes[ATTR.REQUEST_MODEL] = self.model
        if tenant:
            attributes[ATTR.TENANT] = tenant
        if chars_in is not None:
            attributes[ATTR.CHARS_IN] = chars_in
        self.span.set_attributes(attributes)
        self.status: int | None = None
        self.sent_at: float | None = None
        self.upstream_span: trace.Span | None = None
        """The upstream call's span, from :meth:`prepared` (the request goes) to :meth:`end`."""
        self.tokens: Mapping[str, int] = {}
        self.cut: str | None = None
        """The error that cut the upstream's body after its status (:meth:`cut_off`)."""
        self._ended = False

    @contextmanager
    def active(self) -> Iterator[WireRequest]:
        """The span current for the pass and the sending; an exception leaving it ends the
        request, recorded by its type alone (its text may quote content)."""
        try:
            with trace.use_span(self.span, end_on_exit=False, record_exception=False,
                                set_status_on_exception=False):  # fmt: skip
                yield self
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.end(error=type(exc).__name__)
            else:  # cancelled: no failure of the request's own
                self.end()
            raise

    def prepared(self, report: PassReport, seconds: float, chars_out: int | None) -> None:
        """What the pass did for this request (its report, taken before another pass of the
        conversation may run), how long it took, the size of the request it made."""
        persisted: dict[str, int] = {}
        for p in report.persisted:
            persisted[p.reason] = persisted.get(p.reason, 0) + 1
        self.fields.update(
            pipeline_ms=round(seconds * 1000, 3),
            persisted=len(report.persisted),
            reapplied=report.reapplied,
            kept_off_wire=report.chars_kept_off,
            chars_out=chars_out,
        )
        self.span.set_attribute(ATTR.PIPELINE_MS, round(seconds * 1000, 3))
        if chars_out is not None:
            self.span.set_attribute(ATTR.CHARS_OUT, chars_out)
        if self.metrics is not None:
            self.metrics.passed(
                seconds=seconds, persisted=persisted, kept_off=report.chars_kept_off
            )
        self.sent_at = time.monotonic()
        if self.upstream_span is None:
            # this request's call number, whatever call of the session started since
            ids: dict[str, AttributeValue] = {ATTR.CONVERSATION_ID: self.session.session_id}
            if self.fields["call"] is not None:
                ids[ATTR.CALL] = self.fields["call"]
            self.upstream_span = self.session.ctx.tracer.start_span(
                SPAN_WIRE_UPSTREAM,
                context=trace.set_span_in_context(self.span),
                attributes=ids,
                record_exception=False,
                set_status_on_exception=False,
            )

    def answered(self, status: int) -> None:
        """The upstream's status (its headers have come)."""
        self.status = status
        spans = [self.span] if self.upstream_span is None else [self.span, self.upstream_span]
        for span in spans:
            _set_http_status(span, status)

    def cut_off(self, error: str) -> None:
        """The upstream's body broke off after its status came (``error``: the exception's
        type): the request ends failed, and the upstream's span with it."""
        self.cut = error

    def observed(
        self,
        *,
        response_id: str | None,
        model: str | None,
        usage: Mapping[str, Any] | None,
        context_management: Any = None,
    ) -> None:
        """What the response said of itself: id, model, usage, applied context edits."""
        attributes: dict[str, AttributeValue] = {}
        if response_id:
            attributes[ATTR.RESPONSE_ID] = self.fields["response_id"] = bounded_attribute(
                response_id
            )
        if model:
            attributes[ATTR.RESPONSE_MODEL] = bounded_attribute(model)
        if usage is not None:
            counts = usage_attributes(usage)
            attributes.update(counts)
            self.fields.update((k.removeprefix("gen_ai.usage."), v) for k, v in counts.items())
            self.tokens = counts
        edits = applied_edits(context_management)
        if edits:
            attributes[ATTR.APPLIED_EDITS] = edits  # type: ignore[assignment]
            self.fields["applied_edits"] = edits
        self.span.set_attributes(attributes)

    def end(self, *, status: int | None = None, error: str | None = None) -> None:
        """The request is over (once; later calls do nothing): the span ended, the metrics
        recorded, the access line logged."""
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        answered = self.status is not None
        error = error or self.cut
        if status is not None:  # the client's answer (the upstream's, when it gave one)
            self.status = status
            _set_http_status(self.span, status)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
            self.span.set_attribute(ATTR.ERROR_TYPE, error)
            self.fields["error"] = error
        upstream = None if self.sent_at is None else now - self.sent_at
        if upstream is not None:
            self.span.set_attribute(ATTR.UPSTREAM_MS, round(upstream * 1000, 3))
        if self.upstream_span is not None:
            if error is not None and (not answered or self.cut is not None):  # its failure
                self.upstream_span.set_status(Status(StatusCode.ERROR, error))
                self.upstream_span.set_attribute(ATTR.ERROR_TYPE, error)
            self.upstream_span.end()
        self.span.end()
        self.fields.update(
            status=self.status,
            ms=round((now - self.started) * 1000, 3),
            upstream_ms=None if upstream is None else round(upstream * 1000, 3),
        )
        if self.metrics is not None and upstream is not None:
            self.metrics.upstream(
                seconds=upstream,
                model=self.model,
                status=self.status or 0,
                tokens=self.tokens,
            )
        logger = self.session.ctx.logger
        log = logger.warning if error is not None or (self.status or 0) >= 500 else logger.info
        # the line names this request's span, whatever context its end runs in (a relayed
        # body ends in the server's task, which a kept-alive connection made during another)
        with trace.use_span(self.span, end_on_exit=False):
            log("wire.request", **{k: v for k, v in self.fields.items() if v is not None})
