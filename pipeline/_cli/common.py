"""What every command shares: exit codes, errors, the replay options, loading a transcript,
the store directory, request dumps and the logging/tracing set-up."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import trace

from pipeline._cli.cleanup import interrupts_deferred, remove_made_dir
from pipeline._cli.dumps import DumpFormat, RequestDumper, existing_dumps, parse_calls
from pipeline._cli.logging_setup import configure_logging
from pipeline._cli.metrics_setup import setup_metrics
from pipeline._cli.safe_text import terminal_safe
from pipeline._cli.telemetry import TelemetrySetupError, setup_tracing
from pipeline.core import Pipeline
from pipeline.policies import (
    DEFAULT_MAX_RESULT_SIZE_CHARS,
    MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
)
from pipeline.store.files import validate_session_id
from pipeline.store.sessions import STORE_RETRIES, STORE_TIMEOUT, SessionStates, in_turn_options
from pipeline.tracing import get_tracer
from pipeline.transcript.read import Transcript, TranscriptError, load_transcript
from stages import registry as stage_registry

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

_MAX_PROBLEMS_SHOWN = 20


class CliError(Exception):
    """A failure reported as one line on stderr and an exit code, never a traceback."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


class OutputError(CliError):
    """Standard output cannot be written (a full device, a closed descriptor, a reader gone).

    Not an ``OSError``: code that handles its own file errors must not swallow this one.
    """

    def __init__(self, exc: OSError) -> None:
        super().__init__(f"cannot write to standard output: {exc.strerror or exc}", EXIT_FAILED)
        self.broken_pipe = isinstance(exc, BrokenPipeError)


class GuardedStdout:
    """Standard output whose write errors become :class:`OutputError` (one line on stderr,
    exit 1) instead of a traceback; everything else is the wrapped stream's."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; raise :class:`OutputError` when the stream refuses it."""
        try:
            return self.stream.write(text)
        except OSError as exc:
            raise OutputError(exc) from None

    def flush(self) -> None:
        """Flush; raise :class:`OutputError` when the stream refuses it."""
        try:
            self.stream.flush()
        except OSError as exc:
            raise OutputError(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def pipeline_for(stage_specs: Sequence[str], per_message_chars: int) -> Pipeline:
    """The default pipeline with ``SLOT=STRATEGY[:k=v...]`` choices; ``ValueError`` naming
    what is wrong."""
    config = {}
    for spec in stage_specs:
        slot, _, _ = stage_registry.parse_stage_spec(spec)
        config[slot] = spec.partition("=")[2]
    return stage_registry.build_pipeline(config, per_message_chars=per_message_chars)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Everything a replay honours (the command-line contract in docs/behaviour.md)."""

    per_message_chars: int = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
    per_tool_chars: int = DEFAULT_MAX_RESULT_SIZE_CHARS
    store: Path | None = None
    keep_store: bool = False
    """Keep the temporary store made when ``store`` is None (``--keep-store``)."""
    json: bool = False
    dump_requests: Path | None = None
    dump_calls: frozenset[int] | None = None
    """Only these calls are dumped (None: all)."""
    dump_format: DumpFormat = "full"
    progress: bool | None = None
    """None: shown when stderr is a terminal."""
    console_spans: bool = False
    stage_specs: tuple[str, ...] = ()
    """``SLOT=STRATEGY[:k=v...]`` choices applied to the default pipeline."""

    def pipeline(self) -> Pipeline:
        """The pipeline these options describe (the default one, with ``--stage`` choices)."""
        try:
            return pipeline_for(self.stage_specs, self.per_message_chars)
        except ValueError as exc:
            raise CliError(f"--stage: {exc}") from None

    def dumper(self) -> RequestDumper | None:
        """The writer of ``--dump-requests`` (its directory created and writable), or None.

        A directory already holding ``NNNN.json`` files is refused: they would be overwritten
        (the input transcript among them, if it is named so) or, from a longer earlier run,
        left mixed in with this run's.
        """
        if self.dump_requests is None:
            return None
        directory = self.dump_requests
        writable_dir(directory, "--dump-requests")
        found = existing_dumps(directory)
        if found:
            shown = ", ".join(p.name for p in found[:3]) + (", ..." if len(found) > 3 else "")
            raise CliError(
                f"--dump-requests {directory}: already holds {len(found)} request dump(s) "
                f"({shown}), from an earlier run; give an empty or new directory"
            )
        return RequestDumper(directory, calls=self.dump_calls, format=self.dump_format)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayOptions:
        """The options of a parsed ``replay`` or ``demo`` command line."""
        return cls(
            per_message_chars=args.per_message_chars,
            per_tool_chars=args.per_tool_chars,
            # an object store URL (proxy, agent) is the command's own business
            store=args.store if not isinstance(args.store, str) else None,
            keep_store=getattr(args, "keep_store", False),
            json=getattr(args, "json", False),  # a server (the proxy) prints none of these
            dump_requests=getattr(args, "dump_requests", None),
            dump_calls=_dump_calls(getattr(args, "dump_calls", None)),
            dump_format=getattr(args, "dump_format", "full"),
            progress=getattr(args, "progress", None),
            console_spans=args.console_spans,
            stage_specs=tuple(getattr(args, "stage", None) or ()),
        )


def object_store_states(
    args: argparse.Namespace, *, spool: Path | None = None
) -> SessionStates | None:
    """The sessions' states on the object store ``--store`` names (with ``--store-timeout``
    and ``--store-retries``; ``spool``: where results it cannot take wait); None for a local
    ``--store`` (or none), where those two are refused. ``CliError`` for a URL that is not
    ``s3://BUCKET/PREFIX`` or ``az://CONTAINER/PREFIX``, or a missing extra."""
    location = args.store
    timeout, retries = getattr(args, "store_timeout", None), getattr(args, "store_retries", None)
    cool_down = getattr(args, "store_cool_down", None)
    if not isinstance(location, str):
        if timeout is not None or retries is not None or cool_down is not None:
            raise CliError(
                "--store-timeout, --store-retries and --store-cool-down apply to an s3:// or "
                "az:// --store"
            )
        return None
    if not location.lower().startswith(("s3://", "az://")):
        # a memory:// store would live and die with one process: nothing a fleet can share
        raise CliError(
            "--store: give a directory, s3://BUCKET/PREFIX or az://CONTAINER/PREFIX, got "
            f"{safe_url(location)}"
        )
    options: dict[str, Any] = {}
    if timeout is not None or retries is not None:
        options = in_turn_options(
            STORE_TIMEOUT if timeout is None else timeout,
            STORE_RETRIES if retries is None else retries,
        )
    try:
        if cool_down is not None:
            options["cool_down"] = cool_down or None  # 0: no breaker, every call asks
        return SessionStates(location, spool=spool, **options)
    except ImportError:
        raise CliError(
            "an object store needs the objectstore extra: pip install 'sluicegate[objectstore]'"
        ) from None
    except ValueError as exc:
        raise CliError(f"--store: {exc}") from None


def safe_url(url: str) -> str:
    """A URL as safe to print: its scheme and host only (a userinfo or a query may hold a
    secret), bounded and terminal-safe."""
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return repr(terminal_safe(f"{scheme[:20]}{sep}{host[:100]}/..."))


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def load(path: Path, *, lenient: bool, defer_texts: int | None = None) -> Transcript:
    """Load a transcript or raise :class:`CliError` naming the file (and line);
    ``defer_texts``: see :func:`~pipeline.transcript.read.load_transcript`."""
    if not path.is_file():
        reason = "no such file" if not path.exists() else "not a regular file"
        raise CliError(f"{path}: {reason}")
    try:
        transcript = load_transcript(path, strict=not lenient, defer_texts=defer_texts)
    except TranscriptError as exc:
        raise CliError(f"{exc.path}:{exc.line}: {exc.reason}") from None
    except (OSError, UnicodeError) as exc:
        raise CliError(f"{path}: cannot read: {exc}") from None
    _report_skipped(transcript)
    return transcript


def _report_skipped(transcript: Transcript) -> None:
    for noted, told, what in (
        (transcript.problems, "skipped", "skipped lines"),
        (transcript.repeated, "warning:", "repeated records"),
        (transcript.out_of_order, "warning:", "records out of order"),
    ):
        for p in noted[:_MAX_PROBLEMS_SHOWN]:
            where = f"{transcript.path}:{p.line}: {p.reason}"
            print(f"sluicegate: {told} {terminal_safe(where)}", file=sys.stderr)
        if len(noted) > _MAX_PROBLEMS_SHOWN:
            more = len(noted) - _MAX_PROBLEMS_SHOWN
            print(f"sluicegate: ... and {more} more {what}", file=sys.stderr)
    if transcript.problems:
        print(
            f"sluicegate: {len(transcript.problems)} malformed line(s) skipped in "
            f"{terminal_safe(str(transcript.path))}",
            file=sys.stderr,
        )


def session_id_for(transcript: Transcript) -> str:
    """The transcript's session id, else one derived from the file name (always a valid id)."""
    candidates = [transcript.session_id or ""]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", transcript.path.stem)[:128]
    candidates.append(stem)
    for candidate in candidates:
        try:
            return validate_session_id(candidate)
        except ValueError:
            continue
    return "session"


# ---------------------------------------------------------------------------------------------
# Running a replay
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StoreDir:
    """The store directory of one command (see :func:`store_root`)."""

    path: Path
    temporary: bool
    """Made by this command because no ``--store`` was given."""
    kept: bool
    """Still there when the command ends: a ``--store``, or a temporary one kept by
    ``--keep-store``. What the output says of persisted files depends on it."""


@contextlib.contextmanager
def store_root(options: ReplayOptions, *, prefix: str = "sluicegate-") -> Iterator[StoreDir]:
    """The store directory of a command, for the ``with`` block: ``--store``, else a new
    temporary directory that is removed when the block ends (returns, fails or is
    interrupted) unless ``--keep-store`` was given.

    A ``--store`` is never removed; the commands check it can be written before any work
    (:func:`writable_dir`).
    """
    if options.store is not None:
        if options.store.exists() and not options.store.is_dir():
            raise CliError(f"--store {options.store}: not a directory")
        yield StoreDir(options.store, temporary=False, kept=True)
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    made = os.lstat(path)  # what is removed at the end must be this very directory
    try:
        yield StoreDir(path, temporary=True, kept=options.keep_store)
    finally:
        if not options.keep_store:
            with interrupts_deferred():  # a second Ctrl-C must not stop the removal halfway
                remove_made_dir(path, (made.st_dev, made.st_ino))


def _unwritable(directory: Path) -> str | None:
    """Why no file can be written in ``directory`` (created if missing), or None."""
    if directory.exists() and not directory.is_dir():
        return "not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # permissions alone do not tell (root ignores them; a read-only mount does not):
        # create and remove a file
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".sluicegate-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write there: {exc.strerror or exc}"
    return None


def writable_dir(directory: Path, flag: str) -> None:
    """Create ``directory`` if needed and make sure a file can be written in it, or raise
    :class:`CliError` (exit 2) naming ``flag``: before any work, not halfway through it."""
    problem = _unwritable(directory)
    if problem is not None:
        raise CliError(f"{flag} {directory}: {problem}")


def writable_file(path: Path, flag: str) -> None:
    """Make sure ``path`` can be created or replaced (its directory created if needed), or
    raise :class:`CliError` (exit 2) naming ``flag``. Nothing is left at ``path``."""
    if path.is_dir():
        raise CliError(f"{flag} {path}: is a directory")
    if path.exists() and not path.is_file():
        # a device or a pipe: replacing it would unlink it (as root, /dev/null itself)
        raise CliError(f"{flag} {path}: not a regular file")
    problem = _unwritable(path.parent)
    if problem is not None:
        raise CliError(f"{flag} {path}: {path.parent}: {problem}")


def _dump_calls(spec: str | None) -> frozenset[int] | None:
    if spec is None:
        return None
    try:
        return parse_calls(spec)
    except ValueError as exc:
        raise CliError(f"--dump-calls: {exc}") from None


@dataclass(frozen=True)
class Telemetry:
    """What :func:`telemetry` set up: a tracer (None: spans are no-ops) and the SDK providers
    behind it and behind the metrics (None when nothing asked for them)."""

    tracer: trace.Tracer | None
    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None


@contextlib.contextmanager
def telemetry(
    args: argparse.Namespace,
    *,
    metrics: bool = False,
    verbosity: int = 0,
    log_flush: float = 0.0,
) -> Iterator[Telemetry]:
    """Logging, tracing and (``metrics=True``) metrics from the options and the standard
    ``OTEL_*`` variables -- the one set-up of every command -- flushed and undone on exit.
    ``verbosity``: added to ``-v`` (a server logs its requests by default); ``log_flush``:
    seconds an info line may wait to be written with others (a server's, ``--log-flush``).

    The logging set-up (a stderr handler on the ``sluicegate`` logger) is undone afterwards, so
    ``main()`` can be called in-process (tests, notebooks) without leaving a handler bound to
    this run's stderr."""
    restore_logging = configure_logging(
        args.verbose + verbosity, args.log_json, flush_every=log_flush
    )
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    try:
        try:
            tracer_provider = setup_tracing(args.console_spans)
            meter_provider = setup_metrics() if metrics else None
        except TelemetrySetupError as exc:
            raise CliError(str(exc)) from None
        tracer = get_tracer(tracer_provider) if tracer_provider is not None else None
        yield Telemetry(tracer, tracer_provider, meter_provider)
    finally:
        try:
            for provider in (tracer_provider, meter_provider):
                if provider is not None:
                    provider.shutdown()  # flushes what is batched
        finally:
            restore_logging()


def with_tracing(
    args: argparse.Namespace, run: Callable[[trace.Tracer | None, TracerProvider | None], int]
) -> int:
    """Set up logging and tracing (:func:`telemetry`), run, and always flush spans before
    returning."""
    with telemetry(args) as set_up:
        return run(set_up.tracer, set_up.tracer_provider)
