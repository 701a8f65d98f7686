"""What every command shares: exit codes, errors, the replay options, loading a transcript,
the store directory, request dumps and the logging/tracing set-up."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from opentelemetry import trace

from pipeline._cli.dumps import DumpFormat, RequestDumper, parse_calls
from pipeline._cli.telemetry import TelemetrySetupError, configure_logging, setup_tracing
from pipeline.core import Pipeline
from pipeline.policies import (
    DEFAULT_MAX_RESULT_SIZE_CHARS,
    MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
)
from pipeline.replay import CallResult
from pipeline.storage import validate_session_id
from pipeline.tracing import get_tracer
from pipeline.transcript import Transcript, TranscriptError, load_transcript
from stages import registry as stage_registry

if TYPE_CHECKING:
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


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Everything a replay honours (the command-line contract in docs/behaviour.md)."""

    per_message_chars: int = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
    per_tool_chars: int = DEFAULT_MAX_RESULT_SIZE_CHARS
    store: Path | None = None
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
        config = {}
        for spec in self.stage_specs:
            try:
                slot, _, _ = stage_registry.parse_stage_spec(spec)
            except ValueError as exc:
                raise CliError(f"--stage: {exc}") from None
            config[slot] = spec.partition("=")[2]
        try:
            return stage_registry.build_pipeline(config, per_message_chars=self.per_message_chars)
        except ValueError as exc:
            raise CliError(f"--stage: {exc}") from None

    def dumper(self) -> RequestDumper | None:
        """The writer of ``--dump-requests`` (its directory created), or None."""
        if self.dump_requests is None:
            return None
        try:
            self.dump_requests.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot create {self.dump_requests}: {exc.strerror}") from None
        return RequestDumper(self.dump_requests, calls=self.dump_calls, format=self.dump_format)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayOptions:
        """The options of a parsed ``replay`` or ``demo`` command line."""
        return cls(
            per_message_chars=args.per_message_chars,
            per_tool_chars=args.per_tool_chars,
            store=args.store,
            json=args.json,
            dump_requests=args.dump_requests,
            dump_calls=_dump_calls(getattr(args, "dump_calls", None)),
            dump_format=getattr(args, "dump_format", "full"),
            progress=args.progress,
            console_spans=args.console_spans,
            stage_specs=tuple(getattr(args, "stage", None) or ()),
        )


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def load(path: Path, *, lenient: bool) -> Transcript:
    """Load a transcript or raise :class:`CliError` naming the file (and line)."""
    if not path.is_file():
        reason = "no such file" if not path.exists() else "not a regular file"
        raise CliError(f"{path}: {reason}")
    try:
        transcript = load_transcript(path, strict=not lenient)
    except TranscriptError as exc:
        raise CliError(f"{exc.path}:{exc.line}: {exc.reason}") from None
    except (OSError, UnicodeError) as exc:
        raise CliError(f"{path}: cannot read: {exc}") from None
    _report_skipped(transcript)
    return transcript


def _report_skipped(transcript: Transcript) -> None:
    problems = transcript.problems
    for p in problems[:_MAX_PROBLEMS_SHOWN]:
        print(f"sluicegate: skipped {transcript.path}:{p.line}: {p.reason}", file=sys.stderr)
    if len(problems) > _MAX_PROBLEMS_SHOWN:
        more = len(problems) - _MAX_PROBLEMS_SHOWN
        print(f"sluicegate: ... and {more} more skipped lines", file=sys.stderr)
    if problems:
        print(
            f"sluicegate: {len(problems)} malformed line(s) skipped in {transcript.path}",
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


def store_root(options: ReplayOptions) -> Path:
    if options.store is None:
        return Path(tempfile.mkdtemp(prefix="sluicegate-"))
    if options.store.exists() and not options.store.is_dir():
        raise CliError(f"--store {options.store}: not a directory")
    return options.store


def _dump_calls(spec: str | None) -> frozenset[int] | None:
    if spec is None:
        return None
    try:
        return parse_calls(spec)
    except ValueError as exc:
        raise CliError(f"--dump-calls: {exc}") from None


def dump_request(dumper: RequestDumper | None, result: CallResult) -> None:
    """Write one call's request if ``--dump-requests`` asked for it."""
    if dumper is None:
        return
    try:
        dumper.dump(result.call.number, result.request)
    except OSError as exc:
        where = dumper.directory / f"{result.call.number:04d}.json"
        raise CliError(f"cannot write {where}: {exc.strerror or exc}", EXIT_FAILED) from None


def with_tracing(
    args: argparse.Namespace, run: Callable[[trace.Tracer | None, TracerProvider | None], int]
) -> int:
    """Set up logging and tracing, run, and always flush spans before returning.

    The global structlog configuration is restored afterwards, so ``main()`` can be called
    in-process (tests, notebooks) without leaving loggers bound to this run's stderr.
    """
    saved_logging = structlog.get_config()
    configure_logging(args.verbose, args.log_json)
    provider: TracerProvider | None = None
    try:
        try:
            provider = setup_tracing(args.console_spans)
        except TelemetrySetupError as exc:
            raise CliError(str(exc)) from None
        tracer = get_tracer(provider) if provider is not None else None
        return run(tracer, provider)
    finally:
        if provider is not None:
            provider.shutdown()  # flushes the batch processor
        structlog.configure(**saved_logging)
