"""``replay``: a recorded session through a pipeline, call by call (``--compare``: several)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
from typing import TYPE_CHECKING

import anyio
from opentelemetry import trace

from pipeline._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    ReplayOptions,
    dump_request,
    load,
    session_id_for,
    store_root,
    with_tracing,
)
from pipeline._cli.dumps import RequestDumper
from pipeline._cli.report import JsonOutput, Output, Progress, ReplaySummary, TableOutput
from pipeline.context import SessionContext
from pipeline.core import Pipeline, StageError
from pipeline.policies import ToolPolicies
from pipeline.replay import find_calls, replay_messages
from pipeline.storage import TOOL_RESULTS_SUBDIR
from pipeline.tracing import ATTR, SPAN_REPLAY, get_logger
from pipeline.transcript import Transcript
from stages import registry as stage_registry

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


async def _replay_calls(
    transcript: Transcript,
    pipe: Pipeline,
    ctx: SessionContext,
    dumper: RequestDumper | None,
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
            dump_request(dumper, result)
            progress.clear()
            output.call(result, chars)
            progress.advance()
    progress.clear()
    output.summary(summary)


def run_replay(transcript: Transcript, options: ReplayOptions, tracer: trace.Tracer | None) -> int:
    """Replay ``transcript`` through the default pipeline and write the results to stdout."""
    session_id = session_id_for(transcript)
    store = store_root(options)
    dumper = options.dumper()  # a directory that cannot be made fails before the replay starts
    ctx = SessionContext(
        session_id,
        root=store,
        tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
        tracer=tracer,
    )
    pipe = options.pipeline()
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
        anyio.run(_replay_calls, transcript, pipe, ctx, dumper, output, summary, progress)
    except StageError as exc:
        progress.clear()
        raise CliError(f"{transcript.path}: call {summary.calls}: {exc}", EXIT_FAILED) from None
    log.info("replay.done", calls=summary.calls, persisted=summary.persisted)
    return EXIT_OK


def run_compare(
    transcript: Transcript,
    args: argparse.Namespace,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
) -> int:
    """``replay --compare``: one table row per pipeline."""
    import pipeline._cli.compare as compare

    pipelines: dict[str, Pipeline] = {}
    for name in (n.strip() for n in args.compare.split(",") if n.strip()):
        try:
            if "=" in name:
                with_change = dataclasses.replace(options, stage_specs=(name,))
                pipelines[name] = with_change.pipeline()
            else:
                pipelines[name] = stage_registry.comparison_pipeline(
                    name, per_message_chars=options.per_message_chars
                )
        except ValueError as exc:
            raise CliError(f"--compare: {exc}") from None
    try:
        prices = compare.load_prices(args.prices) if args.prices else compare.PRICES
    except (OSError, ValueError) as exc:
        raise CliError(f"--prices: {exc}") from None
    store = store_root(options)
    session_id = session_id_for(transcript)
    policies = ToolPolicies.claude_code(cap=options.per_tool_chars)

    def context(name: str) -> SessionContext:
        root = store / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        return SessionContext(session_id, root, tool_policies=policies, tracer=tracer)

    runs = anyio.run(
        lambda: compare.compare_pipelines(transcript.messages, pipelines, context, prices=prices)
    )
    if options.json:
        for run in runs:
            print(json.dumps({"compare": run.row()}))
    else:
        print(f"{transcript.path.name}: {runs[0].calls if runs else 0} calls")
        print(compare.format_table(runs))
    if args.plot is not None:
        try:
            compare.plot_sizes(runs, args.plot, title=transcript.path.name)
        except RuntimeError as exc:
            raise CliError(str(exc)) from None
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    options = ReplayOptions.from_args(args)

    def go(tracer: trace.Tracer | None, _provider: TracerProvider | None) -> int:
        transcript = load(args.transcript, lenient=args.lenient)
        # the loaded session lives until the end and never forms cycles to collect: keep the
        # collector from walking it again and again (an application's choice, not the library's)
        gc.freeze()
        if args.compare:
            return run_compare(transcript, args, options, tracer)
        return run_replay(transcript, options, tracer)

    return with_tracing(args, go)
