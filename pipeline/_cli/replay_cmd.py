"""``replay``: a recorded session through a pipeline, call by call (``--compare``: several)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from opentelemetry import trace

from pipeline._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    ReplayOptions,
    StoreDir,
    load,
    pipeline_for,
    session_id_for,
    store_root,
    with_tracing,
    writable_dir,
    writable_file,
)
from pipeline._cli.dumps import RequestDumper
from pipeline._cli.report import (
    JsonOutput,
    Output,
    Progress,
    ReplaySummary,
    TableOutput,
    transcript_info,
)
from pipeline._cli.safe_text import terminal_safe
from pipeline.context import SessionContext
from pipeline.core import Pipeline, PipelineHalt, StageError, rereading_stages
from pipeline.logs import get_logger
from pipeline.policies import ToolPolicies
from pipeline.spans import content_safe_span
from pipeline.store.files import TOOL_RESULTS_SUBDIR
from pipeline.store.records import RecordLog
from pipeline.tracing import ATTR, SPAN_REPLAY
from pipeline.transcript.deferred import DEFER_AT
from pipeline.transcript.read import Transcript
from pipeline.transcript.replay import (
    CallResult,
    find_calls,
    replay_messages,
)
from pipeline.wire.deferred import TranscriptChanged
from stages import registry as stage_registry
from stages.autocompact import ContextWindowExceeded

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from pipeline._cli.compare import Price

_MAX_PAIRING_WARNINGS = 20
"""Calls warned about one by one; a problem early in a long session is in every later request,
and the summary counts them all."""


def halted(exc: PipelineHalt) -> str:
    """Why a pipeline refused to build a request, naming the stage and its limit."""
    if isinstance(exc, ContextWindowExceeded):
        return (
            f"autocompact stopped the session: the context (~{exc.size:,} tokens, estimated) is "
            f"at or over its blocking limit of {exc.limit:,} tokens and compaction could not "
            "bring it below; the session cannot be replayed with that setting"
        )
    return f"a stage stopped the session ({type(exc).__name__}): {exc}"


def _warn_pairing(result: CallResult, summary: ReplaySummary) -> None:
    problems = result.pairing_problems
    count = len(problems)
    summary.add_pairing(count)
    if not count:
        return
    result_number = result.call.number
    shown = summary.calls_with_pairing_problems
    if shown <= _MAX_PAIRING_WARNINGS:
        first = terminal_safe(str(problems[0]))
        print(
            f"sluicegate: warning: call {result_number}: the request has {count} broken tool "
            f"pairing(s) the API would reject, first: {first}",
            file=sys.stderr,
        )
    if shown == _MAX_PAIRING_WARNINGS:
        print(
            "sluicegate: warning: further calls with broken pairing are only counted "
            "(see the summary)",
            file=sys.stderr,
        )


async def _replay_calls(
    transcript: Transcript, pipe: Pipeline, run: Run, progress: Progress
) -> None:
    ctx, summary, output = run.ctx, run.summary, run.output
    # the session's own trace, carrying the totals; each call is a trace linked to it
    with content_safe_span(
        ctx.tracer, SPAN_REPLAY, attributes={ATTR.CONVERSATION_ID: ctx.session_id}
    ) as session:
        # each call is printed (and dumped) before the next: the request list can be shared,
        # and an output no later request carries goes back to the file
        async for result in replay_messages(
            transcript.messages,
            pipe,
            ctx,
            requests=transcript.requests,
            shared=True,
            release=transcript.deferred_texts > 0,
        ):
            chars = run.counted(result)
            progress.clear()
            _warn_pairing(result, summary)
            output.call(result, chars)
            progress.advance()
        session.set_attributes(
            {
                ATTR.CALLS: summary.calls,
                ATTR.PERSISTED: summary.persisted,
                ATTR.REAPPLIED: summary.reapplied,
                ATTR.PERSIST_FAILED: summary.persist_failed,
            }
        )
    progress.clear()
    output.summary(summary)


@dataclass(slots=True)
class Run:
    """One run into a store (a replay, or the live demo): its session context, what it
    reports, and where its requests are dumped."""

    ctx: SessionContext
    summary: ReplaySummary
    output: Output
    dumper: RequestDumper | None

    @classmethod
    def open(
        cls,
        session_id: str,
        store_dir: StoreDir,
        options: ReplayOptions,
        tracer: trace.Tracer | None,
        transcript: RecordLog | None = None,
    ) -> Run:
        """A run of ``session_id`` into ``store_dir`` (the live demo writes ``transcript``)."""
        dumper = options.dumper()  # a directory that cannot be made fails before the run
        store = store_dir.path
        ctx = SessionContext(
            session_id,
            root=store,
            tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
            tracer=tracer,
            transcript=transcript,
        )
        summary = ReplaySummary(
            session_id, store, options.per_message_chars, options.per_tool_chars
        )
        summary.store_kept = store_dir.kept
        results_dir = store / session_id / TOOL_RESULTS_SUBDIR
        output: Output = (
            JsonOutput(sys.stdout) if options.json else TableOutput(sys.stdout, results_dir)
        )
        return cls(ctx, summary, output, dumper)

    def counted(self, result: CallResult) -> int:
        """``result`` added to the summary, its request written if ``--dump-requests`` asked
        for it; the chars of its request."""
        chars = result.request_chars
        self.summary.add(result, chars)
        if self.dumper is not None:
            try:
                self.dumper.dump(result.call.number, result.request)
            except OSError as exc:
                where = self.dumper.directory / f"{result.call.number:04d}.json"
                why = exc.strerror or exc
                raise CliError(f"cannot write {where}: {why}", EXIT_FAILED) from None
        return chars

    @contextmanager
    def calls(self, where: str, *, first: Callable[[], None] | None = None) -> Iterator[None]:
        """A stage's error or a halt in a call, as the command's failure (exit 1) naming
        ``where`` and the call; ``first`` runs before it is raised (a progress line cleared)."""
        try:
            yield
        except (StageError, PipelineHalt) as exc:
            if first is not None:
                first()
            why = halted(exc) if isinstance(exc, PipelineHalt) else str(exc)
            raise CliError(f"{where}: call {self.summary.calls}: {why}", EXIT_FAILED) from None


def deferred_from(options: ReplayOptions) -> int | None:
    """From how many characters a replay with ``options`` leaves tool outputs in the file
    until it reaches them (and puts them back once no request can carry them): None when a
    stage of its pipeline may read an output again."""
    return None if rereading_stages(options.pipeline()) else DEFER_AT


def run_replay(
    transcript: Transcript,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    store: StoreDir | None = None,
) -> int:
    """Replay ``transcript`` through the default pipeline and write the results to stdout.

    ``store``: the store directory the caller holds (the demo's, which its transcript is in);
    default: ``--store``, else a temporary directory removed at the end unless
    ``--keep-store``.
    """
    pipe = options.pipeline()  # a bad --stage is refused before any directory is made
    if store is not None:
        return _replay_into(store, transcript, pipe, options, tracer)
    with store_root(options) as made:
        return _replay_into(made, transcript, pipe, options, tracer)


def _replay_into(
    store_dir: StoreDir,
    transcript: Transcript,
    pipe: Pipeline,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
) -> int:
    session_id = session_id_for(transcript)
    run = Run.open(session_id, store_dir, options, tracer)
    run.summary.transcript = transcript_info(transcript)
    show_progress = sys.stderr.isatty() if options.progress is None else options.progress
    progress = Progress(len(find_calls(transcript.messages)), sys.stderr, show_progress)
    log = get_logger(session_id=session_id)
    log.info("replay.start", transcript=str(transcript.path), calls=progress.total)
    with run.calls(str(transcript.path), first=progress.clear):
        try:
            anyio.run(_replay_calls, transcript, pipe, run, progress)
        except TranscriptChanged as exc:
            progress.clear()
            raise CliError(str(exc), EXIT_FAILED) from None
    summary = run.summary
    log.info("replay.done", calls=summary.calls, persisted=summary.persisted)
    return EXIT_OK


def _compare_pipelines(spec: str, options: ReplayOptions) -> dict[str, Pipeline]:
    """The pipelines ``--compare`` names (at least one), or :class:`CliError` (exit 2)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise CliError(
            f"--compare {spec!r}: name at least one pipeline "
            f"({', '.join(stage_registry.COMPARISON_POINTS)}, or SLOT=STRATEGY[:k=v])"
        )
    pipelines: dict[str, Pipeline] = {}
    for name in names:
        try:
            if "=" in name:  # the default pipeline with this one change
                pipelines[name] = pipeline_for((name,), options.per_message_chars)
            else:
                pipelines[name] = stage_registry.comparison_pipeline(
                    name, per_message_chars=options.per_message_chars
                )
        except ValueError as exc:
            raise CliError(f"--compare: {exc}") from None
    return pipelines


def check_plot_path(path: Path) -> None:
    """Refuse (exit 2) a ``--plot`` path that could not be written, before the replays run."""
    import pipeline._cli.compare as compare

    try:
        formats = compare.plot_formats()
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    suffix = path.suffix[1:].lower()
    if path.is_dir():
        raise CliError(f"--plot {path}: is a directory; name the image file (e.g. sizes.png)")
    if suffix not in formats:
        why = f"unsupported format {suffix!r}" if suffix else "no file extension"
        raise CliError(f"--plot {path}: {why}; use one of: {', '.join(sorted(formats))}")
    writable_file(path, "--plot")


@dataclasses.dataclass(frozen=True, slots=True)
class CompareSetup:
    """What ``--compare`` asks for, checked before any transcript is read."""

    pipelines: dict[str, Pipeline]
    prices: Mapping[str, Price]
    plot: Path | None


def prepare_compare(args: argparse.Namespace, options: ReplayOptions) -> CompareSetup:
    """The pipelines, prices and plot path of ``replay --compare``, or :class:`CliError`
    (exit 2) naming what is wrong."""
    import pipeline._cli.compare as compare

    pipelines = _compare_pipelines(args.compare, options)
    if args.prices is not None and not args.prices.is_file():
        # reading a FIFO would wait for a writer forever; a directory gives a raw OSError
        reason = "no such file" if not args.prices.exists() else "not a regular file"
        raise CliError(f"--prices {args.prices}: {reason}")
    try:
        prices = compare.load_prices(args.prices) if args.prices else compare.PRICES
    except (OSError, ValueError) as exc:
        raise CliError(f"--prices: {exc}") from None
    if args.plot is not None:
        check_plot_path(args.plot)
    return CompareSetup(pipelines, prices, args.plot)


def run_compare(
    transcript: Transcript,
    setup: CompareSetup,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
) -> int:
    """``replay --compare``: one table row per pipeline (their stores under one ``--store``,
    else under one temporary directory removed at the end unless ``--keep-store``)."""
    with store_root(options) as store_dir:
        code = _compare_into(store_dir.path, transcript, setup, options, tracer)
        if store_dir.temporary and store_dir.kept:
            # the cost table names no path: say where --keep-store kept the results (on
            # stderr, so --json output stays JSON lines)
            shown = terminal_safe(str(store_dir.path.absolute()))
            print(f"sluicegate: persisted results kept in {shown}", file=sys.stderr)
        return code


def _compare_into(
    store: Path,
    transcript: Transcript,
    setup: CompareSetup,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
) -> int:
    import pipeline._cli.compare as compare

    session_id = session_id_for(transcript)
    policies = ToolPolicies.claude_code(cap=options.per_tool_chars)
    current = ""

    def context(name: str) -> SessionContext:
        nonlocal current
        current = name
        root = store / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return SessionContext(session_id, root, tool_policies=policies, tracer=tracer)

    try:
        runs = anyio.run(
            lambda: compare.compare_pipelines(
                transcript.messages, setup.pipelines, context, prices=setup.prices
            )
        )
    except StageError as exc:
        raise CliError(f"{transcript.path}: pipeline {current!r}: {exc}", EXIT_FAILED) from None
    except PipelineHalt as exc:
        raise CliError(
            f"{transcript.path}: pipeline {current!r}: {halted(exc)}", EXIT_FAILED
        ) from None
    if options.json:
        for run in runs:
            print(json.dumps({"compare": run.row()}, allow_nan=False))
    else:
        print(f"{terminal_safe(transcript.path.name)}: {runs[0].calls if runs else 0} calls")
        print(compare.format_table(runs))
    if setup.plot is not None:
        try:
            compare.plot_sizes(runs, setup.plot, title=transcript.path.name)
        except RuntimeError as exc:
            raise CliError(str(exc)) from None
        except (OSError, ValueError) as exc:  # the checks passed, yet the write failed
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CliError(f"--plot {setup.plot}: cannot write: {reason}", EXIT_FAILED) from None
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    if args.store is not None:  # a typo must not make every persist fail, quietly
        writable_dir(args.store, "--store")
    options = ReplayOptions.from_args(args)
    # option errors are reported before the transcript is read (it may be large)
    setup: CompareSetup | None = None
    if args.dump_requests is None:
        for flag, given in (
            ("--dump-calls", args.dump_calls),
            ("--dump-format", args.dump_format != "full"),
        ):
            if given:
                raise CliError(f"{flag} requires --dump-requests")
    if args.compare is not None:
        if args.dump_requests is not None:
            raise CliError(
                "--dump-requests is not taken with --compare (it dumps one pipeline's requests)"
            )
        setup = prepare_compare(args, options)
    else:
        for flag, value in (("--prices", args.prices), ("--plot", args.plot)):
            if value is not None:
                raise CliError(f"{flag} requires --compare")
        options.pipeline()

    def go(tracer: trace.Tracer | None, _provider: TracerProvider | None) -> int:
        defer = deferred_from(options) if setup is None else None  # (--compare: several)
        transcript = load(args.transcript, lenient=args.lenient, defer_texts=defer)
        # the loaded session lives until the end and never forms cycles to collect: keep the
        # collector from walking it again and again (an application's choice, not the library's)
        gc.freeze()
        if setup is not None:
            return run_compare(transcript, setup, options, tracer)
        return run_replay(transcript, options, tracer)

    return with_tracing(args, go)
