"""The command line, ``python -m pipeline`` (console script ``sluicegate``).

This is the composition root: the only module of ``pipeline`` that imports the concrete
``stages``. Everything else here is plumbing around :func:`pipeline.replay.replay_messages`:
argument parsing, logging and tracing set-up, progress, and the table / JSON output.

Exit codes: 0 done; 1 the replay failed part-way (a stage error, an unwritable dump directory);
2 bad usage or bad input (a missing file, a malformed transcript line, a missing OTel SDK).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import statistics
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from opentelemetry import trace

import stages
from pipeline import demo
from pipeline.context import SessionContext
from pipeline.core import Pipeline, StageError
from pipeline.policies import (
    DEFAULT_MAX_RESULT_SIZE_CHARS,
    MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
    ToolPolicies,
)
from pipeline.replay import CallResult, find_calls, replay_messages
from pipeline.storage import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.tracing import ATTR, SPAN_REPLAY, get_logger, get_tracer
from pipeline.transcript import Transcript, TranscriptError, load_transcript

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["CliError", "ReplayOptions", "ReplaySummary", "build_parser", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
DEFAULT_SERVICE_NAME = "sluicegate"
UNDERCOUNT_TOLERANCE = 0.10
_MAX_PROBLEMS_SHOWN = 20


class CliError(Exception):
    """A failure reported as one line on stderr and an exit code, never a traceback."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Everything a replay honours (the DESIGN.md CLI contract)."""

    per_message_chars: int = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
    per_tool_chars: int = DEFAULT_MAX_RESULT_SIZE_CHARS
    store: Path | None = None
    json: bool = False
    dump_requests: Path | None = None
    progress: bool | None = None
    """None: shown when stderr is a terminal."""
    console_spans: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayOptions:
        """The options of a parsed ``replay`` or ``demo`` command line."""
        return cls(
            per_message_chars=args.per_message_chars,
            per_tool_chars=args.per_tool_chars,
            store=args.store,
            json=args.json,
            dump_requests=args.dump_requests,
            progress=args.progress,
            console_spans=args.console_spans,
        )


# ---------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------

_STORE_HELP = (
    "directory for persisted results (<DIR>/<session>/tool-results/). Default: a new temporary "
    "directory, which is KEPT so the paths in the output stay readable; its location is printed "
    "in the summary (and in the JSON summary's 'store'). Delete it when done."
)
_TRACING_EPILOG = """\
tracing:
  Spans are exported over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT or
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (service.name "sluicegate" unless
  OTEL_SERVICE_NAME is set); nothing is exported otherwise. Needs the SDK:
  pip install 'sluicegate[otel]'. Spans never hold message content.

exit codes: 0 ok, 1 replay failed part-way, 2 bad usage or bad input.
"""


def _para(text: str) -> str:
    # the raw formatter keeps the epilog's layout; descriptions are wrapped here instead
    return textwrap.fill(text, width=79)


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _add_replay_options(p: argparse.ArgumentParser) -> None:
    budget = p.add_argument_group("budget")
    budget.add_argument(
        "--per-message-chars",
        type=_positive_int,
        default=MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
        metavar="N",
        help="per-message budget: tool_result chars in one API-level user message "
        "(default %(default)s)",
    )
    budget.add_argument(
        "--per-tool-chars",
        type=_positive_int,
        default=DEFAULT_MAX_RESULT_SIZE_CHARS,
        metavar="N",
        help="per-tool cap (default %(default)s); Claude Code's declared limits below it still "
        "apply (Bash 30000, Grep 20000, ...) and Read is never persisted",
    )
    budget.add_argument("--store", type=Path, metavar="DIR", help=_STORE_HELP)

    out = p.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help='one JSON object per call on stdout, then a final {"summary": {...}} line '
        "(default: an aligned table)",
    )
    out.add_argument(
        "--dump-requests",
        type=Path,
        metavar="DIR",
        help="write DIR/NNNN.json: the exact 'messages' array sent for call NNNN",
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    out.add_argument("--console-spans", action="store_true", help="also print every span to stderr")
    out.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log to stderr at INFO (-v) or DEBUG (-vv); default WARNING",
    )
    out.add_argument(
        "--log-json", action="store_true", help="log JSON lines instead of readable text"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``sluicegate`` / ``python -m pipeline`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="sluicegate",
        description="Replay agent sessions through sluicegate's context-budget pipeline "
        "(tool_result_budget -> history_snip -> microcompact -> context_collapse -> autocompact).",
        epilog="Run 'sluicegate COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    replay = sub.add_parser(
        "replay",
        help="replay a recorded Claude Code session (JSONL), call by call",
        description=_para(
            "Replay a Claude Code transcript through the default pipeline exactly as a "
            "live loop would have run it: for each API call (each distinct assistant message.id, "
            "in order) the conversation as it stood just before that call goes through the "
            "pipeline, with one session context carried across calls, and is normalised to wire "
            "form. The main thread is replayed (sub-agent records interleaved in older files are "
            "left out). The replay starts from an empty ledger and never writes to the transcript."
        ),
        epilog=_TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("transcript", type=Path, metavar="TRANSCRIPT.jsonl")
    replay.add_argument(
        "--lenient",
        action="store_true",
        help="skip malformed lines (listed on stderr) instead of failing on the first",
    )
    _add_replay_options(replay)
    replay.set_defaults(handler=_cmd_replay)

    demo_p = sub.add_parser(
        "demo",
        help="generate a realistic session and replay it (no API key, no network)",
        description=_para(
            "Generate a Claude Code session deterministically (ten parallel ~40K-char "
            "tool outputs in one turn, a ~56K Read, a single ~80K Bash output, small results), "
            "write it as a JSONL transcript, and replay it through the default pipeline, showing "
            "per call what the budget persisted and re-applied."
        ),
        epilog=_TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_p.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="write the generated transcript here (replaced if it exists); default: "
        "demo-session.jsonl in the store directory",
    )
    demo_p.add_argument(
        "--seed",
        type=int,
        default=demo.DEFAULT_SEED,
        help="generator seed (default %(default)s); the same seed gives the same file",
    )
    _add_replay_options(demo_p)
    demo_p.set_defaults(handler=_cmd_demo)
    return parser


# ---------------------------------------------------------------------------------------------
# Logging and tracing
# ---------------------------------------------------------------------------------------------


def configure_logging(verbosity: int, json_lines: bool) -> None:
    """structlog to stderr. Must run before any SessionContext is built: the library's
    loggers copy the processor chain when they are created."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _missing_sdk(exc: ImportError) -> CliError:
    return CliError(
        f"exporting spans needs the OpenTelemetry SDK ({exc.name or exc}); "
        "install it with: pip install 'sluicegate[otel]'"
    )


def setup_tracing(console_spans: bool) -> TracerProvider | None:
    """An SDK tracer provider when an OTLP endpoint is configured or console spans are asked
    for; None (spans are no-ops) otherwise. The global provider is left alone."""
    exporting = any(os.environ.get(var) for var in OTLP_ENDPOINT_VARS)
    if not exporting and not console_spans:
        return None
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as exc:
        raise _missing_sdk(exc) from None
    service = os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    if exporting:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise _missing_sdk(exc) from None
        # the exporter reads the endpoint, headers and timeout from the standard env vars
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console_spans:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    return provider


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
# Summary
# ---------------------------------------------------------------------------------------------


def _nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclasses.dataclass(slots=True)
class ReplaySummary:
    """Totals over a replay, and how far the token estimate was from the API's count."""

    session_id: str
    store: Path
    per_message_chars: int
    per_tool_chars: int
    calls: int = 0
    persisted: int = 0
    persisted_chars: int = 0
    reapplied: int = 0
    persist_failed: int = 0
    peak_request_chars: int = 0
    calls_with_actual_tokens: int = 0
    relative_errors: list[float] = dataclasses.field(default_factory=list)
    """(estimated − actual) / actual, for calls whose actual count is known and > 0."""

    def add(self, result: CallResult, request_chars: int) -> None:
        """Count one call."""
        self.calls += 1
        self.persisted += len(result.persisted)
        self.persisted_chars += sum(p.chars for p in result.persisted)
        self.reapplied += result.reapplied
        self.persist_failed += len(result.persist_failed)
        self.peak_request_chars = max(self.peak_request_chars, request_chars)
        actual = result.actual_tokens
        if actual is not None:
            self.calls_with_actual_tokens += 1
            if actual > 0:
                self.relative_errors.append((result.estimated_tokens - actual) / actual)

    @property
    def median_abs_error(self) -> float | None:
        """Median of |estimated − actual| / actual."""
        errors = [abs(e) for e in self.relative_errors]
        return statistics.median(errors) if errors else None

    @property
    def p95_abs_error(self) -> float | None:
        """95th percentile (nearest rank) of |estimated − actual| / actual."""
        errors = sorted(abs(e) for e in self.relative_errors)
        return _nearest_rank(errors, 0.95) if errors else None

    @property
    def undercount_share(self) -> float | None:
        """Share of calls whose estimate was more than 10% below the actual count."""
        if not self.relative_errors:
            return None
        under = sum(1 for e in self.relative_errors if e < -UNDERCOUNT_TOLERANCE)
        return under / len(self.relative_errors)

    def to_json(self) -> dict[str, Any]:
        """The ``summary`` object of the final ``--json`` line."""

        def rounded(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {
            "session_id": self.session_id,
            "calls": self.calls,
            "persisted": self.persisted,
            "persisted_chars": self.persisted_chars,
            "reapplied": self.reapplied,
            "persist_failed": self.persist_failed,
            "peak_request_chars": self.peak_request_chars,
            "calls_with_actual_tokens": self.calls_with_actual_tokens,
            "abs_rel_error_median": rounded(self.median_abs_error),
            "abs_rel_error_p95": rounded(self.p95_abs_error),
            "undercount_gt_10pct_share": rounded(self.undercount_share),
            "per_message_chars": self.per_message_chars,
            "per_tool_chars": self.per_tool_chars,
            "store": str(self.store),
        }


# ---------------------------------------------------------------------------------------------
# Output: progress on stderr; a table or JSON lines on stdout
# ---------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr, redrawn in place; inert when disabled."""

    WIDTH = 30

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled and total > 0
        self.done = 0
        self._drawn = False

    def advance(self) -> None:
        """One more call replayed."""
        self.done += 1
        self.draw()

    def draw(self) -> None:
        """(Re)draw the bar."""
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\rreplaying [{bar}] {self.done}/{self.total} calls")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the bar so other output does not land on its line."""
        if self._drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 40) + "\r")
            self.stream.flush()
            self._drawn = False


class Output(Protocol):
    """Where per-call results and the summary go."""

    def call(self, result: CallResult, request_chars: int) -> None:
        """Report one call."""

    def summary(self, summary: ReplaySummary) -> None:
        """Report the totals."""


class JsonOutput:
    """The ``--json`` contract: one object per call, then ``{"summary": {...}}``."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def call(self, result: CallResult, request_chars: int) -> None:
        """Write ``CallResult.to_json()`` as one line."""
        self._line(result.to_json())

    def summary(self, summary: ReplaySummary) -> None:
        """Write the summary line."""
        self._line({"summary": summary.to_json()})

    def _line(self, obj: dict[str, Any]) -> None:
        self.stream.write(json.dumps(obj) + "\n")
        self.stream.flush()


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


class TableOutput:
    """An aligned table: a row per call, a line per newly persisted result, then totals."""

    COLUMNS = (
        ("call", 5),
        ("message_id", 30),
        ("est.tokens", 11),
        ("act.tokens", 11),
        ("error", 8),
        ("persisted", 10),
        ("reapplied", 10),
        ("req.chars", 12),
    )

    def __init__(self, stream: IO[str], results_dir: Path) -> None:
        self.stream = stream
        self.results_dir = results_dir.absolute()
        self._header_written = False

    def _row(self, cells: Sequence[str]) -> str:
        parts = []
        for (name, width), cell in zip(self.COLUMNS, cells, strict=True):
            parts.append(cell.ljust(width) if name == "message_id" else cell.rjust(width))
        return " ".join(parts).rstrip()

    def _show_path(self, path: str) -> str:
        # the directory is printed once in the summary; rows show file names only
        try:
            return str(Path(path).relative_to(self.results_dir))
        except ValueError:
            return path

    def call(self, result: CallResult, request_chars: int) -> None:
        """Write the call's row and its persisted results."""
        lines = []
        if not self._header_written:
            lines.append(self._row([name for name, _ in self.COLUMNS]))
            self._header_written = True
        actual = result.actual_tokens
        error = (result.estimated_tokens - actual) / actual if actual else None
        lines.append(
            self._row(
                [
                    str(result.call.number),
                    result.call.message_id,
                    _fmt_int(result.estimated_tokens),
                    _fmt_int(actual),
                    "-" if error is None else f"{error * 100:+.1f}%",
                    str(len(result.persisted)),
                    str(result.reapplied),
                    _fmt_int(request_chars),
                ]
            )
        )
        for p in result.persisted:
            lines.append(
                f"      + persisted {self._show_path(p.path)}  {p.tool_name or '?'}, "
                f"{p.chars:,} chars, {p.reason}"
            )
        for tool_use_id in result.persist_failed:
            lines.append(f"      ! persist failed for {tool_use_id}: original content sent")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

    def summary(self, s: ReplaySummary) -> None:
        """Write the totals."""
        lines = [""] if self._header_written else []
        lines += [
            f"session {s.session_id}: {s.calls} calls, {s.persisted} persisted "
            f"({s.persisted_chars:,} chars), {s.reapplied} re-applied, "
            f"{s.persist_failed} persist failures, peak request {s.peak_request_chars:,} chars",
        ]
        if s.relative_errors:
            under = s.undercount_share or 0.0
            lines.append(
                f"token estimate vs API usage ({s.calls_with_actual_tokens}/{s.calls} calls "
                f"known): median |error| {_fmt_pct(s.median_abs_error)}, "
                f"p95 {_fmt_pct(s.p95_abs_error)}, under-counted by >10% in "
                f"{round(under * len(s.relative_errors))} ({_fmt_pct(under)})"
            )
        else:
            lines.append("token estimate vs API usage: no call with known usage")
        lines.append(
            f"limits: {s.per_message_chars:,} chars per message, {s.per_tool_chars:,} per tool"
        )
        lines.append(f"persisted results: {self.results_dir}")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Running a replay
# ---------------------------------------------------------------------------------------------


def _store_root(options: ReplayOptions) -> Path:
    if options.store is None:
        return Path(tempfile.mkdtemp(prefix="sluicegate-"))
    if options.store.exists() and not options.store.is_dir():
        raise CliError(f"--store {options.store}: not a directory")
    return options.store


def _dump_request(directory: Path, result: CallResult) -> None:
    target = directory / f"{result.call.number:04d}.json"
    try:
        text = json.dumps(result.request, ensure_ascii=False, indent=2)
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        # lone surrogates from an undecodable transcript byte: escaped JSON is still exact
        data = json.dumps(result.request, indent=2).encode("ascii")
    try:
        target.write_bytes(data)
    except OSError as exc:
        raise CliError(f"cannot write {target}: {exc.strerror or exc}", EXIT_FAILED) from None


async def _replay_calls(
    transcript: Transcript,
    pipe: Pipeline,
    ctx: SessionContext,
    options: ReplayOptions,
    output: Output,
    summary: ReplaySummary,
    progress: Progress,
) -> None:
    # one trace per replay: every call's pipeline.run is a child of this span
    with ctx.tracer.start_as_current_span(
        SPAN_REPLAY, attributes={ATTR.CONVERSATION_ID: ctx.session_id}
    ):
        async for result in replay_messages(transcript.messages, pipe, ctx):
            chars = result.request_chars
            summary.add(result, chars)
            if options.dump_requests is not None:
                _dump_request(options.dump_requests, result)
            progress.clear()
            output.call(result, chars)
            progress.advance()
    progress.clear()
    output.summary(summary)


def run_replay(transcript: Transcript, options: ReplayOptions, tracer: trace.Tracer | None) -> int:
    """Replay ``transcript`` through the default pipeline and write the results to stdout."""
    session_id = session_id_for(transcript)
    store = _store_root(options)
    if options.dump_requests is not None:
        try:
            options.dump_requests.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot create {options.dump_requests}: {exc.strerror}") from None
    ctx = SessionContext(
        session_id,
        root=store,
        tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
        tracer=tracer,
    )
    pipe = Pipeline(stages.default_stages(per_message_chars=options.per_message_chars))
    summary = ReplaySummary(session_id, store, options.per_message_chars, options.per_tool_chars)
    results_dir = store / session_id / TOOL_RESULTS_SUBDIR
    output: Output = (
        JsonOutput(sys.stdout) if options.json else TableOutput(sys.stdout, results_dir)
    )
    show_progress = sys.stderr.isatty() if options.progress is None else options.progress
    progress = Progress(len(find_calls(transcript.messages)), sys.stderr, show_progress)
    log = get_logger(session_id=session_id)
    log.info("replay.start", transcript=str(transcript.path), calls=progress.total)
    try:
        anyio.run(_replay_calls, transcript, pipe, ctx, options, output, summary, progress)
    except StageError as exc:
        progress.clear()
        raise CliError(f"{transcript.path}: call {summary.calls}: {exc}", EXIT_FAILED) from None
    log.info("replay.done", calls=summary.calls, persisted=summary.persisted)
    return EXIT_OK


def _with_tracing(args: argparse.Namespace, run: Callable[[trace.Tracer | None], int]) -> int:
    """Set up logging and tracing, run, and always flush spans before returning.

    The global structlog configuration is restored afterwards, so ``main()`` can be called
    in-process (tests, notebooks) without leaving loggers bound to this run's stderr.
    """
    saved_logging = structlog.get_config()
    configure_logging(args.verbose, args.log_json)
    provider: TracerProvider | None = None
    try:
        provider = setup_tracing(args.console_spans)
        tracer = get_tracer(provider) if provider is not None else None
        return run(tracer)
    finally:
        if provider is not None:
            provider.shutdown()  # flushes the batch processor
        structlog.configure(**saved_logging)


def _cmd_replay(args: argparse.Namespace) -> int:
    options = ReplayOptions.from_args(args)

    def go(tracer: trace.Tracer | None) -> int:
        transcript = load(args.transcript, lenient=args.lenient)
        return run_replay(transcript, options, tracer)

    return _with_tracing(args, go)


def _cmd_demo(args: argparse.Namespace) -> int:
    store = args.store or Path(tempfile.mkdtemp(prefix="sluicegate-demo-"))
    options = dataclasses.replace(ReplayOptions.from_args(args), store=store)
    path: Path = args.out or store / "demo-session.jsonl"

    def go(tracer: trace.Tracer | None) -> int:
        try:
            demo.write_session(path, seed=args.seed)
        except OSError as exc:
            raise CliError(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED) from None
        if not options.json:
            print(f"generated a Claude Code session (seed {args.seed}): {path}")
        return run_replay(load(path, lenient=False), options, tracer)

    return _with_tracing(args, go)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (``sluicegate`` console script entry)."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
        return code
    except CliError as exc:
        print(f"sluicegate: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, without a traceback at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("sluicegate: interrupted", file=sys.stderr)
        return 130
