"""``demo``: the embedded default -- the agent loop against a scripted local server, or
(``--replay``) the same generated session replayed from its transcript."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry import trace

import pipeline._cli.demo_session as demo
from pipeline._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    ReplayOptions,
    StoreDir,
    load,
    store_root,
    with_tracing,
    writable_dir,
    writable_file,
)
from pipeline._cli.dumps import is_dump_name
from pipeline._cli.replay_cmd import Run, deferred_from, run_replay
from pipeline._cli.safe_text import terminal_safe
from pipeline.transcript.read import TranscriptWriter
from pipeline.transcript.replay import CallResult

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def cmd_demo(args: argparse.Namespace) -> int:
    # every path is checked before the session is generated or the server started
    if args.store is not None:
        writable_dir(args.store, "--store")
    options = ReplayOptions.from_args(args)
    # without --store: a temporary directory (the transcript too, unless --out), removed on
    # every way out of the command (an option refused below included) unless --keep-store
    with store_root(options, prefix="sluicegate-demo-") as store:
        return _demo_in(args, dataclasses.replace(options, store=store.path), store)


_TRANSCRIPT_REMOVED = (
    "temporary: removed at the end; keep it with --keep-store, --store DIR or --out FILE"
)


def _transcript_note(path: Path, store: StoreDir, out: Path | None) -> str:
    """The transcript's path as shown, saying it goes at the end when its temporary store
    does: the user is never pointed at a file that will not be there."""
    shown = terminal_safe(str(path))
    if out is not None or store.kept:
        return shown
    return f"{shown}; {_TRANSCRIPT_REMOVED}"


def _demo_in(args: argparse.Namespace, options: ReplayOptions, store: StoreDir) -> int:
    path: Path = args.out or store.path / "demo-session.jsonl"
    writable_file(path, "--out" if args.out is not None else "--store")
    options.pipeline()  # a bad --stage: exit 2 now
    options.dumper()  # an unwritable or used --dump-requests directory: exit 2 now
    dumps = options.dump_requests
    if dumps is not None and is_dump_name(path.name) and path.parent.resolve() == dumps.resolve():
        raise CliError(f"--out {path}: a request dump of --dump-requests would replace it")

    def go(tracer: trace.Tracer | None, provider: TracerProvider | None) -> int:
        if args.replay:
            try:
                demo.write_session(path, seed=args.seed)
            except OSError as exc:
                raise CliError(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED) from None
            if not options.json:
                shown = _transcript_note(path, store, args.out)
                print(f"generated a Claude Code session (seed {args.seed}): {shown}")
            transcript = load(path, lenient=False, defer_texts=deferred_from(options))
            return run_replay(transcript, options, tracer, store)
        return run_live_demo(
            demo.generate_session(args.seed),
            path,
            options,
            tracer,
            provider,
            store,
            transcript_shown=_transcript_note(path, store, args.out),
        )

    return with_tracing(args, go)


def run_live_demo(
    session: demo.DemoSession,
    transcript_path: Path,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
    store: StoreDir,
    *,
    transcript_shown: str | None = None,
) -> int:
    """Run the demo session live: agent loop, real SDK, scripted local server.

    ``store``: where results are persisted (the caller removes it if it is temporary);
    ``transcript_shown``: how the transcript is named in the first line (default: its path).
    """
    import anthropic  # heavy: only the live commands need the SDK at run time

    from pipeline._cli.demo_agent import LiveDemo

    try:
        transcript_path.unlink(missing_ok=True)
    except OSError as exc:
        raise CliError(f"cannot replace {transcript_path}: {exc.strerror or exc}") from None
    writer = TranscriptWriter(transcript_path, session.session_id)
    run = Run.open(session.session_id, store, options, tracer, writer)
    ctx, summary = run.ctx, run.summary
    pipe = options.pipeline()
    if not options.json:
        shown = transcript_shown or terminal_safe(str(transcript_path))
        print(f"live agent session {session.session_id} (transcript: {shown})")

    def on_call(result: CallResult) -> None:
        result.request_tokens = ctx.token_tracker.request_tokens  # the agent's system + tools
        run.output.call(result, run.counted(result))

    def client(base_url: str) -> anthropic.AsyncAnthropic:
        telemetry: Any = {"tracer_provider": provider} if provider is not None else None
        return anthropic.AsyncAnthropic(
            base_url=base_url, api_key="sluicegate-demo", max_retries=0, open_telemetry=telemetry
        )

    try:
        with run.calls("demo"):
            anyio.run(LiveDemo(session, pipe, ctx, on_call).run, client)
    except OSError as exc:  # the transcript (or the store) failed mid-run: a full disk, say
        where = f"{exc.filename}: " if exc.filename else ""
        raise CliError(
            f"demo: call {summary.calls}: {where}{exc.strerror or exc}", EXIT_FAILED
        ) from None
    run.output.summary(summary)
    return EXIT_OK
