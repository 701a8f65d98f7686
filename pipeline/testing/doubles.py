"""Doubles for testing stages: an in-memory store, a span recorder, a quiet logger, ``run_stage``
and an exact comparison of message lists."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipeline.context import SessionContext
from pipeline.core import Pipeline, Stage
from pipeline.messages import Message
from pipeline.tracing import ATTR, decision_span_name, get_tracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Tracer

__all__ = [
    "MemoryStore",
    "QuietLogger",
    "RecordReads",
    "SpanRecorder",
    "assert_same_messages",
    "message_fields",
    "run_stage",
]


class MemoryStore:
    """A :class:`~pipeline.store.files.ToolResultStore` in memory: deterministic paths, no I/O.

    ``files`` maps each path to the text stored there. As in the file store, a second write of
    an id with the same text reuses the path and one with other text goes to
    ``<id>.<first 12 hex of its sha256>.<ext>``. Ids in ``failing`` fail to persist, every
    time, with ENOSPC.
    """

    def __init__(self, failing: Iterable[str] = (), *, prefix: str = "/mem") -> None:
        self.failing = frozenset(failing)
        self.prefix = prefix
        self.files: dict[str, str] = {}

    async def persist(self, tool_use_id: str, text: str, ext: str) -> str:
        """Keep ``text`` under ``<prefix>/<tool_use_id>.<ext>`` and return that path."""
        if tool_use_id in self.failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        path = f"{self.prefix}/{tool_use_id}.{ext}"
        if self.files.setdefault(path, text) != text:
            digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
            path = f"{self.prefix}/{tool_use_id}.{digest}.{ext}"
            self.files.setdefault(path, text)
        return path


class QuietLogger:
    """A structlog-shaped logger that keeps its events in ``events`` and prints nothing
    (``keep=False``: drops them, for long runs)."""

    def __init__(self, *, keep: bool = True) -> None:
        self.keep = keep
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        """(level, event, key-value pairs) of every call, in order."""

    def bind(self, **_kw: Any) -> QuietLogger:
        """The same logger (bound values are not kept)."""
        return self

    def _log(self, level: str, event: str, kw: dict[str, Any]) -> None:
        if self.keep:
            self.events.append((level, event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        """Keep a debug event."""
        self._log("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        """Keep an info event."""
        self._log("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        """Keep a warning."""
        self._log("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        """Keep an error."""
        self._log("error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """Keep an error (no traceback is recorded)."""
        self._log("error", event, kw)


class SpanRecorder:
    """Spans recorded in memory, for assertions on what a stage traced.

    Needs the OpenTelemetry SDK (the ``otel`` or ``dev`` extra); the library itself only
    depends on the API. Pass :attr:`tracer` to ``SessionContext(tracer=...)``::

        spans = SpanRecorder()
        ctx = SessionContext("s1", tmp_path, tracer=spans.tracer)
        ...
        [decision] = spans.decisions("tool_result_budget")
    """

    def __init__(self) -> None:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )
        except ImportError as exc:  # pragma: no cover - the dev extra installs it
            raise ImportError(
                "SpanRecorder needs the OpenTelemetry SDK: pip install 'sluicegate[otel]'"
            ) from exc
        self.exporter: InMemorySpanExporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = get_tracer(self.provider)

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        """Every finished span, in the order they ended."""
        return tuple(self.exporter.get_finished_spans())

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        """:attr:`spans` (the name ``InMemorySpanExporter`` gives it)."""
        return self.spans

    def named(self, name: str) -> list[ReadableSpan]:
        """The finished spans called ``name``."""
        return [s for s in self.spans if s.name == name]

    def attributes(self, name: str) -> list[Mapping[str, Any]]:
        """The attributes of every finished span called ``name``."""
        return [dict(s.attributes or {}) for s in self.named(name)]

    def decisions(self, stage: str) -> list[ReadableSpan]:
        """The decision spans of ``stage`` (``<stage>.<decision>``, whatever the decision), in
        the order they ended."""
        found = []
        for s in self.spans:
            attrs = s.attributes or {}
            decision = attrs.get(ATTR.DECISION)
            named = isinstance(decision, str) and s.name == decision_span_name(stage, decision)
            if named and attrs.get(ATTR.STAGE) == stage:
                found.append(s)
        return found

    def decision_attributes(self, stage: str) -> list[Mapping[str, Any]]:
        """The attributes of :meth:`decisions`."""
        return [dict(s.attributes or {}) for s in SpanRecorder.decisions(self, stage)]

    def holding(self, text: str) -> list[str]:
        """The names of the finished spans that hold ``text`` anywhere: an attribute, an
        event's name or attributes, the status (``[]``: none; a check that no span carries
        message content)."""
        found = []
        for s in self.spans:
            held = [*map(str, (s.attributes or {}).values()), str(s.status.description or "")]
            for event in s.events:
                held += [event.name, *map(str, (event.attributes or {}).values())]
            if any(text in h for h in held):
                found.append(s.name)
        return found

    def clear(self) -> None:
        """Forget the spans recorded so far."""
        self.exporter.clear()

    def __iter__(self) -> Iterator[ReadableSpan]:
        return iter(self.spans)


async def run_stage(
    stage: Stage, messages: Sequence[Message], ctx: SessionContext
) -> list[Message]:
    """Run one stage exactly as :meth:`Pipeline.run` would (lock, pass report, spans, error
    wrapping): a one-stage pipeline. ``ctx.report`` then tells what the stage did."""
    return await Pipeline([stage]).run(messages, ctx)


def message_fields(m: Message) -> dict[str, Any]:
    """Every field of ``m``, content as its exact JSON text (key order and ``1`` versus
    ``1.0`` kept apart): what two records must share to go over the wire as the same bytes."""
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    fields["content"] = json.dumps(m.content, ensure_ascii=False)
    return fields


def assert_same_messages(actual: Sequence[Message], expected: Sequence[Message]) -> None:
    """Raise ``AssertionError`` naming the first position and field where two message lists
    differ, comparing every field (content byte for byte, see :func:`message_fields`)."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} messages, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if a is e:
            continue
        fa, fe = message_fields(a), message_fields(e)
        for name, value in fa.items():
            if value != fe[name] or type(value) is not type(fe[name]):
                raise AssertionError(
                    f"message {i} differs in {name}: {_short(value)} != {_short(fe[name])}"
                )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


class RecordReads:
    """Which records a pass actually reads: is a pass as cheap as its new part?

    :meth:`watch` returns copies of messages whose field reads are recorded here (list
    operations -- comparing, copying, slicing -- read no field and are not counted)::

        reads = RecordReads()
        history = reads.watch(messages)
        await run_stage(stage, history, ctx)      # the first pass reads everything
        reads.reset()
        history.append(Message.user("next"))      # unwatched: not counted
        await run_stage(stage, history, ctx)
        assert reads.records == 0                 # no old record was looked at again
    """

    def __init__(self) -> None:
        self._watched: dict[int, Message] = {}  # holding them keeps their ids unique
        self._touched: set[int] = set()
        self.fields = 0
        """Field reads of watched records since the last :meth:`reset`."""
        watched, touched, counter = self._watched, self._touched, self

        class Watched(Message):
            __slots__ = ()

            def __getattribute__(self, name: str) -> Any:
                if id(self) in watched and not name.startswith("__"):
                    touched.add(id(self))
                    counter.fields += 1
                return object.__getattribute__(self, name)

        self._class = Watched

    def watch(self, messages: Iterable[Message]) -> list[Message]:
        """Copies of ``messages`` (every field the same) whose reads are recorded; records a
        stage derives from them (``with_content``) are not watched."""
        out: list[Message] = []
        for m in messages:
            copy = self._class(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)})
            self._watched[id(copy)] = copy
            out.append(copy)
        return out

    @property
    def records(self) -> int:
        """How many distinct watched records had a field read since the last :meth:`reset`."""
        return len(self._touched)

    def reset(self) -> None:
        """Start counting afresh."""
        self._touched.clear()
        self.fields = 0


def without_cache_control(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (a request's, as a server received them) with every ``cache_control``
    removed: what to compare with ``to_api`` of the records, since a client moves its cache
    breakpoint to the last block on every call."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b
                for b in content
            ]
        out.append({**m, "content": content})
    return out
