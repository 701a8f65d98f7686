"""The library's loggers: structlog events delivered through the standard library's ``logging``.

A library must not decide where its log lines go. Unless the application has configured
structlog itself, :func:`get_logger` returns a structlog logger that hands every event to the
stdlib logger ``sluicegate`` as one :class:`logging.LogRecord`: the message is the event name
followed by its key-value pairs, and each pair is also a record attribute (``record.event``,
``record.decision``, ``record.trace_id``...), so the application's handlers, filters, levels and
formatters decide everything. Nothing is configured here: with no handler anywhere, Python's
last-resort handler prints warnings and errors on stderr, and nothing ever goes to stdout.

An application that has configured structlog gets the events through its own processors and
logger factory instead. Either way every event carries ``trace_id``/``span_id`` while a span is
current, and whatever is bound with :func:`structlog.contextvars.bound_contextvars` (a replay
binds ``call``) where the processor chain merges context variables. No event holds message
content.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog
from opentelemetry import trace
from structlog.typing import Processor

__all__ = ["LOGGER_NAME", "add_trace_ids", "get_logger"]

LOGGER_NAME = "sluicegate"
"""The stdlib logger every library event goes to (configure its level and handlers)."""

_LEVELS: Mapping[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}

_RECORD_FIELDS = logging.LogRecord("", logging.NOTSET, "", 0, "", (), None).__dict__
_RESERVED = frozenset({*_RECORD_FIELDS, "message", "asctime"})
"""Attribute names a LogRecord has or gets when formatted: ``extra`` may not set them
(``makeRecord`` raises ``KeyError``), so a field of that name is passed as ``<name>_``."""

_LOG_KWARGS = ("exc_info", "stack_info")
_NOT_IN_MESSAGE = frozenset({"level", "trace_id", "span_id"})
"""Fields left out of the message text: the record's level and the ids are attributes, and the
ids would double the length of every line a plain formatter prints."""

_CALLER_DEPTH = 3
"""Frames from ``Logger.log`` up to the code that logged (``_proxy_to_logger``, the bound
logger's ``info``/``warning``..., the caller): the record's file, line and function are the
caller's, not structlog's."""


def add_trace_ids(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: add ``trace_id``/``span_id`` of the current span, if any."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event_dict.setdefault("span_id", format(ctx.span_id, "016x"))
    return event_dict


def _text(value: Any) -> str:
    """One value as the message shows it: plain when that is unambiguous, else its ``repr``
    (which escapes control characters, so the last-resort handler prints none raw)."""
    try:
        if isinstance(value, str):
            text = str(value)  # a StrEnum member as its value, not <Decision.PERSIST: ...>
            plain = text and text.isprintable() and not any(c in text for c in " =\"'")
            return text if plain else repr(text)
        return repr(value)
    except Exception:  # a hostile __repr__ must not make logging raise into the pipeline
        return f"<{type(value).__name__}>"


def _to_log_kwargs(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> dict[str, Any]:
    """Final processor: the ``Logger.log`` keyword arguments of one event -- ``msg`` (the event
    name and its pairs, for formatters that show only the message), ``extra`` (every field,
    the event name as ``event``, for handlers that read record attributes), and ``exc_info``/
    ``stack_info`` when given."""
    kwargs: dict[str, Any] = {k: event_dict.pop(k) for k in _LOG_KWARGS if k in event_dict}
    event = str(event_dict.pop("event", ""))
    extra: dict[str, Any] = {"event": event}
    for key, value in event_dict.items():
        extra[f"{key}_" if key in _RESERVED else key] = value
    kwargs["msg"] = _Message(event, event_dict)
    kwargs["extra"] = extra
    return kwargs


class _Message:
    """A record's message: the event name and its pairs, written when a formatter asks for it
    (``record.getMessage()``), once; one that reads the record's attributes never does."""

    __slots__ = ("_event", "_fields", "_text")

    def __init__(self, event: str, fields: Mapping[str, Any]) -> None:
        self._event, self._fields = event, fields
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            parts = [self._event]
            parts += [
                f"{k}={_text(v)}" for k, v in self._fields.items() if k not in _NOT_IN_MESSAGE
            ]
            self._text = " ".join(parts)
        return self._text

    def __repr__(self) -> str:
        return repr(str(self))

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        return (str, (str(self),))  # a record sent elsewhere carries the text, by any protocol


_STDLIB_PROCESSORS: list[Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    add_trace_ids,
    _to_log_kwargs,
]


class _StdlibLogger(structlog.stdlib.BoundLogger):
    """A structlog logger over a stdlib one that asks the stdlib logger first: an event below
    its effective level costs one cached level check -- no event dict, no processor, no
    formatting (the stages log a debug line per tool result)."""

    def _proxy_to_logger(
        self,
        method_name: str,
        event: str | None = None,
        *event_args: str,
        **event_kw: Any,
    ) -> Any:
        level = _LEVELS.get(method_name, logging.INFO)
        if not self._logger.isEnabledFor(level):
            return None
        if event_args and event is not None:
            event = event % event_args  # stdlib-style interpolation, as the base class offers
        stacklevel = _CALLER_DEPTH + max(0, int(event_kw.pop("stacklevel", 1)) - 1)
        try:
            _args, kwargs = self._process_event(method_name, event, event_kw)
        except structlog.DropEvent:
            return None
        self._logger.log(level, stacklevel=stacklevel, **kwargs)
        return None


def get_logger(**initial: Any) -> Any:
    """A structlog logger for library events, with ``initial`` bound (``session_id``...).

    When the application has not configured structlog: a logger that delivers each event to
    the stdlib logger ``sluicegate`` (see the module's description), level-checked before any
    work. When it has: a logger built from the application's processors and logger factory,
    with the current trace and span ids added first. The choice is made here, when the logger
    is made (a :class:`~pipeline.context.SessionContext` makes its logger when it is built).
    """
    if not structlog.is_configured():
        return _StdlibLogger(logging.getLogger(LOGGER_NAME), _STDLIB_PROCESSORS, dict(initial))
    # the ids are added first so that whatever the application's chain ends in sees them
    processors = [add_trace_ids, *structlog.get_config()["processors"]]
    return structlog.wrap_logger(None, processors=processors).bind(**initial)
