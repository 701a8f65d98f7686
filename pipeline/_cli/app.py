"""The command line, ``python -m pipeline`` (console script ``sluicegate``).

This package is the composition root: the only place that names the concrete ``stages``. The
library (everything else under ``pipeline``) never imports it.

Exit codes: 0 done; 1 the command failed part-way (a stage error, an unwritable dump directory,
an API error); 2 bad usage or bad input (a missing file, a malformed transcript line, a missing
OTel SDK); 130 interrupted (SIGINT); 143 terminated (SIGTERM). An interrupted or terminated
command still removes the temporary store it made.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from types import FrameType
from typing import IO

from pipeline._cli.common import EXIT_FAILED, CliError, GuardedStdout, OutputError
from pipeline._cli.parser import build_parser
from pipeline._cli.safe_text import terminal_safe

__all__ = ["build_parser", "main"]


def _discard_stdout(stream: IO[str]) -> None:
    """Point standard output at /dev/null, so the interpreter's final flush of what is still
    buffered neither fails again nor prints a traceback at exit."""
    with contextlib.suppress(OSError, ValueError):  # no descriptor (in-process capture)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class _Termination:
    """SIGTERM taken the way Ctrl-C is, so that the command's ``finally`` blocks run -- the
    temporary store is removed -- instead of the process dying where it is; remembered, so that
    the exit code says which signal it was.

    "The way Ctrl-C is" means through whatever handles SIGINT at that moment: inside an event
    loop, the loop's own handler (asyncio cancels the main task and the loop unwinds cleanly);
    elsewhere Python's, which raises ``KeyboardInterrupt`` where the command stands. A
    ``KeyboardInterrupt`` raised directly inside a running loop could land in the middle of its
    machinery (a client's constructor, a shutdown), leaving warnings, tracebacks or a hang.
    """

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt):
            on_interrupt(signal.SIGINT, frame)
            return
        raise KeyboardInterrupt  # SIGINT ignored or left to the OS: stop here all the same

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handler for the block (main thread only: elsewhere signals cannot be set)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self)
        try:
            yield
        finally:
            # None: a handler not set from Python, which cannot be put back from here
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (``sluicegate`` console script entry)."""
    try:
        args = _parsed(argv)
    except OutputError as exc:  # ``--help`` or a usage message that could not be written
        if not exc.broken_pipe:
            print(f"sluicegate: error: {exc}", file=sys.stderr)
        return exc.code
    termination = _Termination()
    with termination.installed():
        return _run(args, termination)


def _parsed(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; what argparse writes before it exits (help, a usage error) is flushed
    then, so a full device is :class:`OutputError`, not an exit 0 with the text lost."""
    stdout = sys.stdout
    if stdout is None:
        return build_parser().parse_args(argv)
    sys.stdout = GuardedStdout(stdout)
    try:
        return build_parser().parse_args(argv)
    except (SystemExit, OutputError):
        try:
            sys.stdout.flush()
        except OutputError:
            _discard_stdout(stdout)
            raise
        raise
    finally:
        sys.stdout = stdout


def _run(args: argparse.Namespace, termination: _Termination) -> int:
    stdout, stderr = sys.stdout, sys.stderr
    if stderr is None:
        # started with stderr closed: print(file=None) would write diagnostics to stdout
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
    if stdout is None:  # started with stdout closed (``>&-``): nowhere to write the output
        _tell(args, "sluicegate: error: standard output is closed", "cli.failed")
        _restore_stderr(stderr)
        return EXIT_FAILED
    sys.stdout = GuardedStdout(stdout)
    try:
        code: int = args.handler(args)
        sys.stdout.flush()  # a full device is reported here, not at interpreter exit
        return code
    except OutputError as exc:
        _discard_stdout(stdout)
        if not exc.broken_pipe:  # the reader went away (``| head``): stop quietly
            _tell(args, f"sluicegate: error: {exc}", "cli.failed")
        return exc.code
    except CliError as exc:
        _tell(args, f"sluicegate: error: {terminal_safe(str(exc), limit=2_000)}", "cli.failed")
        return exc.code
    except BrokenPipeError:
        _discard_stdout(stdout)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if termination.received:
            _tell(args, "sluicegate: terminated", "cli.terminated", "warning")
            return 143
        _tell(args, "sluicegate: interrupted", "cli.interrupted", "warning")
        return 130
    finally:
        sys.stdout = stdout
        _restore_stderr(stderr)


def _tell(args: argparse.Namespace, text: str, event: str, level: str = "error") -> None:
    """The command's last line on stderr: ``text``, or under ``--log-json`` (every line of a
    JSON log is JSON) the ``event`` at ``level`` with the text as its ``detail``."""
    if getattr(args, "log_json", False) is True:
        stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        line = json.dumps({"event": event, "detail": text, "level": level, "timestamp": stamp})
        print(line, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


def _restore_stderr(stderr: IO[str] | None) -> None:
    if sys.stderr is not stderr:
        sys.stderr.close()
        sys.stderr = stderr
