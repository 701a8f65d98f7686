"""Logging for the command line: the library's events as readable or JSON lines on stderr.

The library only hands its events to the stdlib logger ``sluicegate`` (see :mod:`pipeline.logs`);
the command line, being the application, decides where they go. For one command it puts a stderr
handler on that logger, whose :class:`structlog.stdlib.ProcessorFormatter` rebuilds each event
from the record's attributes, and takes everything back afterwards: ``main()`` may run many
times in one process (tests, notebooks). The loggers of the SDK and of OpenTelemetry are left
as the interpreter has them -- except under ``--log-json``, where every stderr line must be
JSON: then the root logger gets the same handler for the command's run (what other libraries
log, Python's warnings, uvicorn's and the event loop's lines), and :func:`say` writes the
command's own notices as events.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from typing import IO, Any

import structlog
from structlog.typing import Processor

from pipeline._cli.batched_lines import BatchedLines
from pipeline._cli.log_lines import LogLines
from pipeline._cli.safe_text import terminal_safe
from pipeline.logs import LOGGER_NAME, get_logger

__all__ = [
    "SERVER_LOGGERS",
    "configure_logging",
    "escape_controls",
    "flush_held_lines",
    "level_for",
    "log_formatter",
    "say",
]

SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")
"""Loggers whose own handlers (uvicorn's logging configuration from an earlier run in the
process) are set aside under ``--log-json``: their lines reach the root logger's JSON handler."""

_RUNS: list[tuple[bool, logging.Handler]] = []
"""Each configuration in force (innermost last): whether it writes JSON lines, its handler."""


def say(text: str, event: str, *, error: bool = False) -> None:
    """A notice of the command's own on stderr: ``text`` as it is, or, while JSON lines are
    configured (``--log-json``), the ``event`` at warning (``error``: error) level with the
    text as its ``detail``."""
    if _RUNS and _RUNS[-1][0]:
        log = get_logger()
        (log.error if error else log.warning)(event, detail=text)
    else:
        flush_held_lines()
        print(text, file=sys.stderr, flush=True)


def flush_held_lines() -> None:
    """Write the log lines held for stderr now (before a ``print`` there, so that what was
    logged first comes first)."""
    if _RUNS:
        _RUNS[-1][1].flush()


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
    general = structlog.stdlib.ProcessorFormatter(
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
    # the library's own records written straight into the same lines (pipeline._cli.log_lines)
    return LogLines(general, json_lines=json_lines, readable=not colors)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def configure_logging(
    verbosity: int, json_lines: bool, *, flush_every: float = 0.0
) -> Callable[[], None]:
    """Send the library's events to stderr at the level of ``verbosity``; return the function
    that undoes it (removes the handler, writes what it holds, restores the logger's level and
    propagation, and the structlog configuration).

    The stream is the ``sys.stderr`` of the moment (an in-process capture included).
    ``flush_every`` (seconds, a server's): lines below ``WARNING`` are held up to that long
    and written together (:class:`~pipeline._cli.batched_lines.BatchedLines`); 0 writes each
    line as it comes.
    """
    stream = sys.stderr
    handler = (
        BatchedLines(stream, flush_every) if flush_every > 0 else logging.StreamHandler(stream)
    )
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
    undo_json = _json_everywhere(handler) if json_lines else None
    _RUNS.append((json_lines, handler))

    def restore() -> None:
        if _RUNS:
            _RUNS.pop()
        logger.removeHandler(handler)
        if undo_json is not None:
            undo_json()
        handler.close()
        logger.setLevel(saved_level)
        logger.propagate = saved_propagate
        if saved_structlog is not None:
            structlog.configure(**saved_structlog)
        else:
            structlog.reset_defaults()

    return restore


def _json_everywhere(handler: logging.Handler) -> Callable[[], None]:
    """Every line of a JSON log is JSON: ``handler`` on the root logger (other libraries'
    records, Python's warnings), the server's loggers without handlers of their own (the proxy
    gives uvicorn no logging configuration then). Returns what undoes it."""
    root = logging.getLogger()
    root.addHandler(handler)
    servers = [logging.getLogger(name) for name in SERVER_LOGGERS]
    saved = [(lg, list(lg.handlers), lg.propagate) for lg in servers]
    for lg in servers:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True
    # (whether something captures them already: logging keeps the original hook while it does)
    captured = getattr(logging, "_warnings_showwarning", None) is not None
    if not captured:
        logging.captureWarnings(True)

    def undo() -> None:
        root.removeHandler(handler)
        for lg, handlers, propagate in saved:
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate
        if not captured:
            logging.captureWarnings(False)

    return undo
