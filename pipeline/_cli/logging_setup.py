"""Logging for the command line: the library's events as readable or JSON lines on stderr.

The library only hands its events to the stdlib logger ``sluicegate`` (see :mod:`pipeline.logs`);
the command line, being the application, decides where they go. For one command it puts a stderr
handler on that logger, whose :class:`structlog.stdlib.ProcessorFormatter` rebuilds each event
from the record's attributes, and takes everything back afterwards: ``main()`` may run many
times in one process (tests, notebooks). The loggers of the SDK and of OpenTelemetry are left
as the interpreter has them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from typing import IO, Any

import structlog
from structlog.typing import Processor

from pipeline._cli.safe_text import terminal_safe
from pipeline.logs import LOGGER_NAME

__all__ = [
    "FOREIGN_JSON_LOGGERS",
    "configure_logging",
    "escape_controls",
    "level_for",
    "log_formatter",
]

FOREIGN_JSON_LOGGERS = ("uvicorn", "asyncio")
"""Loggers of others whose lines go out as JSON too under ``--log-json``."""


def escape_controls(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor for readable lines: string values (ids, tool names, paths from the
    transcript) with control characters escaped, so none reaches the terminal raw. Other values
    are rendered with ``repr``, which escapes them already; JSON lines need neither."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = terminal_safe(value)
    return event_dict


def level_for(verbosity: int) -> int:
    """The level ``-v`` flags ask for: warnings by default, ``-v`` info, ``-vv`` debug."""
    if verbosity <= 0:
        return logging.WARNING
    return logging.INFO if verbosity == 1 else logging.DEBUG


def log_formatter(json_lines: bool, *, colors: bool = False) -> logging.Formatter:
    """The formatter of the command line's log lines: one JSON object per line, or a readable
    line (time, level, event, then its fields) with control characters escaped."""
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=colors)
    )
    return structlog.stdlib.ProcessorFormatter(
        # a library record is "foreign" to structlog (a plain LogRecord): its fields, the event
        # name among them, are record attributes, which ExtraAdder copies back into the event
        foreign_pre_chain=[
            structlog.stdlib.ExtraAdder(),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([structlog.processors.format_exc_info] if json_lines else [escape_controls]),
            renderer,
        ],
    )


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def configure_logging(verbosity: int, json_lines: bool) -> Callable[[], None]:
    """Send the library's events to stderr at the level of ``verbosity``; return the function
    that undoes it (removes the handler, restores the logger's level and propagation, and the
    structlog configuration).

    The stream is the ``sys.stderr`` of the moment (an in-process capture included).
    """
    stream = sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(log_formatter(json_lines, colors=_is_terminal(stream)))
    logger = logging.getLogger(LOGGER_NAME)
    saved_level, saved_propagate = logger.level, logger.propagate
    saved_structlog = structlog.get_config() if structlog.is_configured() else None
    # The library's loggers go through stdlib logging only while structlog is unconfigured;
    # in-process, something earlier (a test, a notebook) may have configured it.
    structlog.reset_defaults()
    logger.addHandler(handler)
    logger.setLevel(level_for(verbosity))
    # the lines are printed here: a handler the embedding process put on the root logger
    # (pytest's, a notebook's) must not print them a second time
    logger.propagate = False
    # every line of a JSON log is JSON: the server's and the event loop's lines too (the
    # proxy then gives uvicorn no logging configuration of its own)
    foreign = [logging.getLogger(name) for name in FOREIGN_JSON_LOGGERS] if json_lines else []
    saved_foreign = [(f, f.propagate) for f in foreign]
    for f in foreign:
        f.addHandler(handler)
        f.propagate = False

    def restore() -> None:
        logger.removeHandler(handler)
        for f, propagate in saved_foreign:
            f.removeHandler(handler)
            f.propagate = propagate
        handler.close()
        logger.setLevel(saved_level)
        logger.propagate = saved_propagate
        if saved_structlog is not None:
            structlog.configure(**saved_structlog)
        else:
            structlog.reset_defaults()

    return restore
