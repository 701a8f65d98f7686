"""The command line's log lines, written straight from the library's records (:class:`LogLines`).

structlog's :class:`~structlog.stdlib.ProcessorFormatter` rebuilds an event from any record
(a copy of it, its message, its extra attributes), then its console renderer lays each field
out through a column object: ~0.1 ms for the proxy's access line, one per request, about a
tenth of what the proxy adds to a call of a short conversation. A library record already
holds its event's fields as attributes: :class:`LogLines` writes those into the same line
(readable: as the console renderer without colours writes it; JSON: as its JSON renderer
does), and hands everything else (another library's record, an event with an exception or a
stack, a terminal's coloured line) to the ProcessorFormatter it is given.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from pipeline._cli.safe_text import terminal_safe

__all__ = ["LogLines"]

_RECORD_FIELDS = frozenset(
    {*logging.LogRecord("", logging.NOTSET, "", 0, "", (), None).__dict__, "message", "asctime"}
)
_LEVEL_WIDTH = len("exception")
"""The console renderer's level column: as wide as the longest level name it knows."""
_EVENT_WIDTH = 30
_QUOTED = frozenset(" \t=\r\n\"'")
"""A string value holding one of these is shown as its ``repr``, as the console renderer does."""
_COLUMNS = frozenset({"timestamp", "level", "event", "logger", "logger_name", "exception", "stack"})
"""Fields the console renderer lays out on their own (a column, the lines after the event)."""
_LEVELS = {"warn": "warning", "exception": "error"}
"""Level names as structlog's ``add_log_level`` writes them."""


class LogLines(logging.Formatter):
    """Library events (a record with a string ``event`` attribute) as one line: JSON
    (``json_lines``) or readable; anything else by ``general``. ``readable`` False: readable
    lines go to ``general`` too (a terminal's, in colour)."""

    def __init__(self, general: logging.Formatter, *, json_lines: bool, readable: bool) -> None:
        super().__init__()
        self.general = general
        self.json_lines = json_lines
        self.readable = readable

    def format(self, record: logging.LogRecord) -> str:
        fields = record.__dict__
        event = fields.get("event")
        if (
            not isinstance(event, str)
            or record.exc_info
            or record.stack_info
            or not (self.json_lines or self.readable)
        ):
            return self.general.format(record)
        data: dict[str, Any] = {"event": event}
        for key, value in fields.items():
            if key not in _RECORD_FIELDS:
                data[key] = value
        level = record.levelname.lower()
        data["level"] = _LEVELS.get(level, level)
        data["timestamp"] = _timestamp()
        if self.json_lines:
            return json.dumps(data, default=_json_default)
        if not _COLUMNS.isdisjoint(data.keys() - {"event", "level", "timestamp"}):
            return self.general.format(record)  # a field the renderer lays out as a column
        return _readable(data)


def _json_default(value: Any) -> Any:
    # as structlog's JSONRenderer falls back: the value's own __structlog__, else its repr
    try:
        return value.__structlog__()
    except AttributeError:
        return repr(value)


def _timestamp() -> str:
    # as structlog's TimeStamper(fmt="iso", utc=True) stamps it: when the line is written
    return datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def _readable(data: dict[str, Any]) -> str:
    event = terminal_safe(data.pop("event"))
    level = data.pop("level")
    parts = [data.pop("timestamp"), f"[{level:<{_LEVEL_WIDTH}}]", f"{event:<{_EVENT_WIDTH}}"]
    for key in sorted(data):
        value = data[key]
        if isinstance(value, str):
            value = terminal_safe(value)
            shown = repr(value) if not _QUOTED.isdisjoint(value) else value
        else:
            shown = repr(value)
        parts.append(key + "=" + shown)  # a str subclass as its characters, not its __format__
    return " ".join(p for p in parts if p).rstrip(" ")
