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
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from opentelemetry import trace

from pipeline import demo
from pipeline.context import SessionContext
from pipeline.core import Pipeline, StageError
from pipeline.policies import (
    DEFAULT_MAX_RESULT_SIZE_CHARS,
    MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
    ToolPolicies,
)
from pipeline.replay import CallResult, find_calls, replay_messages
from pipeline.report import JsonOutput, Output, Progress, ReplaySummary, TableOutput
from pipeline.storage import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.telemetry import TelemetrySetupError, configure_logging, setup_tracing
from pipeline.tracing import ATTR, SPAN_REPLAY, get_logger, get_tracer
from pipeline.transcript import Transcript, TranscriptError, TranscriptWriter, load_transcript
from stages import registry as stage_registry

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["CliError", "ReplayOptions", "ReplaySummary", "build_parser", "main"]

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
    """Everything a replay honours (the DESIGN.md CLI contract)."""

    per_message_chars: int = MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
    per_tool_chars: int = DEFAULT_MAX_RESULT_SIZE_CHARS
    store: Path | None = None
    json: bool = False
    dump_requests: Path | None = None
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
            stage_specs=tuple(getattr(args, "stage", None) or ()),
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
    budget.add_argument(
        "--stage",
        action="append",
        metavar="SLOT=STRATEGY[:k=v...]",
        help="choose a strategy for a stage slot, e.g. microcompact=clear-oldest:keep=5 or "
        "history_snip=off (repeatable)",
    )

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
    compare = replay.add_argument_group("comparing pipelines")
    compare.add_argument(
        "--compare",
        metavar="A,B,...",
        help="replay under several pipelines and print a cost table instead: built-in "
        f"{', '.join(stage_registry.COMPARISON_POINTS)}, or SLOT=STRATEGY[:k=v] for the "
        "default pipeline with that change",
    )
    compare.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="with --compare: draw request size per call"
    )
    compare.add_argument(
        "--prices",
        type=Path,
        metavar="FILE.json",
        help='with --compare: price table {"sonnet": {"input": 3, "output": 15}, ...}',
    )
    replay.set_defaults(handler=_cmd_replay)

    demo_p = sub.add_parser(
        "demo",
        help="run the agent loop against a scripted local server (no API key, no network)",
        description=_para(
            "Run the agent loop on the real anthropic SDK against a scripted Messages server on "
            "127.0.0.1 (random port) that asks for what a real coding session asked for: ten "
            "parallel ~40K-char job logs in one turn, a ~56K Read, a single ~80K Bash output, "
            "small results. Every request goes through the default pipeline; each tool result "
            "passes the per-tool gate as it is produced; the transcript is written as the loop "
            "goes. Shows per call what the budget persisted and re-applied. With --replay, the "
            "same session is written as a transcript and replayed instead."
        ),
        epilog=_TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_p.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="the session's transcript (replaced if it exists); default: "
        "demo-session.jsonl in the store directory",
    )
    demo_p.add_argument(
        "--replay",
        action="store_true",
        help="write the session as a Claude Code transcript and replay it (no live loop)",
    )
    demo_p.add_argument(
        "--seed",
        type=int,
        default=demo.DEFAULT_SEED,
        help="generator seed (default %(default)s); the same seed gives the same file",
    )
    _add_replay_options(demo_p)
    demo_p.set_defaults(handler=_cmd_demo)
    _add_agent_parser(sub)
    return parser


def _add_agent_parser(sub: Any) -> None:
    agent_p = sub.add_parser(
        "agent",
        help="run a small coding agent in the current directory (needs an API key)",
        description=_para(
            "Run a small coding agent in the current directory on the Anthropic API, every "
            "request going through the default pipeline. Tools: read_file (files under the "
            "current directory and persisted outputs; never persisted itself) and, only with "
            "--allow-bash, bash. Key and base URL come from the SDK's usual environment "
            "variables (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL). The session (transcript and "
            "persisted outputs) goes under --store (default .sluicegate)."
        ),
        epilog=_TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    agent_p.add_argument("prompt", nargs="?", help="what to do (optional with --resume)")
    agent_p.add_argument(
        "--model",
        default=os.environ.get("ANTHROPIC_MODEL"),
        help="model name (default: $ANTHROPIC_MODEL)",
    )
    agent_p.add_argument(
        "--allow-bash", action="store_true", help="offer the bash tool (runs what the model writes)"
    )
    agent_p.add_argument("--max-turns", type=_positive_int, default=25, metavar="N")
    agent_p.add_argument(
        "--max-retries",
        type=int,
        default=2,
        metavar="N",
        help="the SDK's retries of a failed call (default %(default)s)",
    )
    agent_p.add_argument("--max-tokens", type=_positive_int, default=8_192, metavar="N")
    agent_p.add_argument(
        "--resume", type=Path, metavar="TRANSCRIPT", help="continue the session of this transcript"
    )
    agent_p.add_argument("--session-id", help="id of a new session (default: random)")
    _add_replay_options(agent_p)
    agent_p.set_defaults(handler=_cmd_agent, store=None)


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
        anyio.run(_replay_calls, transcript, pipe, ctx, options, output, summary, progress)
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
    from pipeline import compare

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
    store = _store_root(options)
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


def _with_tracing(
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


def _cmd_replay(args: argparse.Namespace) -> int:
    options = ReplayOptions.from_args(args)

    def go(tracer: trace.Tracer | None, _provider: TracerProvider | None) -> int:
        transcript = load(args.transcript, lenient=args.lenient)
        if args.compare:
            return run_compare(transcript, args, options, tracer)
        return run_replay(transcript, options, tracer)

    return _with_tracing(args, go)


def _cmd_demo(args: argparse.Namespace) -> int:
    store = args.store or Path(tempfile.mkdtemp(prefix="sluicegate-demo-"))
    options = dataclasses.replace(ReplayOptions.from_args(args), store=store)
    path: Path = args.out or store / "demo-session.jsonl"

    def go(tracer: trace.Tracer | None, provider: TracerProvider | None) -> int:
        if args.replay:
            try:
                demo.write_session(path, seed=args.seed)
            except OSError as exc:
                raise CliError(f"cannot write {path}: {exc.strerror or exc}", EXIT_FAILED) from None
            if not options.json:
                print(f"generated a Claude Code session (seed {args.seed}): {path}")
            return run_replay(load(path, lenient=False), options, tracer)
        return run_live_demo(demo.generate_session(args.seed), path, options, tracer, provider)

    return _with_tracing(args, go)


def run_live_demo(
    session: demo.DemoSession,
    transcript_path: Path,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
) -> int:
    """Run the demo session live: agent loop, real SDK, scripted local server."""
    import anthropic  # heavy: only the live commands need the SDK at run time

    from pipeline.demo_agent import LiveDemo

    transcript_path.unlink(missing_ok=True)
    ctx = SessionContext(
        session.session_id,
        root=options.store or _store_root(options),
        tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
        tracer=tracer,
        transcript=TranscriptWriter(transcript_path, session.session_id),
    )
    pipe = options.pipeline()
    summary = ReplaySummary(
        session.session_id, ctx.root, options.per_message_chars, options.per_tool_chars
    )
    output: Output = (
        JsonOutput(sys.stdout)
        if options.json
        else TableOutput(sys.stdout, ctx.root / session.session_id / TOOL_RESULTS_SUBDIR)
    )
    if not options.json:
        print(f"live agent session {session.session_id} (transcript: {transcript_path})")

    def on_call(result: CallResult) -> None:
        chars = result.request_chars
        summary.add(result, chars)
        if options.dump_requests is not None:
            options.dump_requests.mkdir(parents=True, exist_ok=True)
            _dump_request(options.dump_requests, result)
        output.call(result, chars)

    def client(base_url: str) -> anthropic.AsyncAnthropic:
        telemetry: Any = {"tracer_provider": provider} if provider is not None else None
        return anthropic.AsyncAnthropic(
            base_url=base_url, api_key="sluicegate-demo", max_retries=0, open_telemetry=telemetry
        )

    try:
        anyio.run(LiveDemo(session, pipe, ctx, on_call).run, client)
    except StageError as exc:
        raise CliError(f"demo: call {summary.calls}: {exc}", EXIT_FAILED) from None
    output.summary(summary)
    return EXIT_OK


def _cmd_agent(args: argparse.Namespace) -> int:
    if not args.model:
        raise CliError("no model: pass --model or set ANTHROPIC_MODEL")
    if args.prompt is None and args.resume is None:
        raise CliError("nothing to do: give a PROMPT, or --resume TRANSCRIPT")
    options = ReplayOptions.from_args(args)

    def go(tracer: trace.Tracer | None, provider: TracerProvider | None) -> int:
        return run_agent(args, options, tracer, provider)

    return _with_tracing(args, go)


def run_agent(
    args: argparse.Namespace,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
) -> int:
    """The ``agent`` command: a coding agent in the current directory."""
    import uuid

    import anthropic

    from pipeline.agent import Agent, AgentAPIError, TurnLog
    from pipeline.coding_tools import bash_tool, read_file_tool

    root = options.store or Path(".sluicegate")
    cwd = Path.cwd()
    telemetry: Any = {"tracer_provider": provider} if provider is not None else None
    try:
        client = anthropic.AsyncAnthropic(open_telemetry=telemetry, max_retries=args.max_retries)
    except anthropic.AnthropicError as exc:
        raise CliError(f"cannot create the API client: {exc}") from None
    pipe = options.pipeline()
    policies = ToolPolicies(cap=options.per_tool_chars)

    def report(log: TurnLog) -> None:
        done = [g for g in log.gated if g.decision == "persist"]
        print(
            f"[call {log.number}] {log.usage.input_side:,} input tokens "
            f"(estimated {log.estimated_tokens:,}); persisted {len(log.report.persisted)} by "
            f"the budget, {len(done)} by the gate; re-applied {log.report.reapplied}",
            file=sys.stderr,
        )

    if args.resume is not None:
        agent = Agent.resume(
            load(args.resume, lenient=True).path,
            client,
            model=args.model,
            pipeline=pipe,
            root=root,
            readback=False,
            max_tokens=args.max_tokens,
            max_turns=args.max_turns,
            on_turn=report,
        )
        agent.ctx.tool_policies = policies
        if tracer is not None:
            agent.ctx.tracer = tracer
        transcript = args.resume
    else:
        try:
            session_id = validate_session_id(args.session_id or str(uuid.uuid4()))
        except ValueError as exc:
            raise CliError(f"--session-id: {exc}") from None
        transcript = root / session_id / "transcript.jsonl"
        ctx = SessionContext(
            session_id,
            root,
            tool_policies=policies,
            tracer=tracer,
            transcript=TranscriptWriter(transcript, session_id),
        )
        agent = Agent(
            client,
            model=args.model,
            pipeline=pipe,
            ctx=ctx,
            readback=False,
            max_tokens=args.max_tokens,
            max_turns=args.max_turns,
            on_turn=report,
        )
    store_dir = root / agent.ctx.session_id / TOOL_RESULTS_SUBDIR
    agent.add_tool(read_file_tool(cwd, store_dir))
    if args.allow_bash:
        agent.add_tool(bash_tool(cwd))
    print(f"session {agent.ctx.session_id}: transcript {transcript}", file=sys.stderr)
    try:
        result = anyio.run(agent.run, args.prompt)
    except AgentAPIError as exc:
        raise CliError(f"API error: {exc}", EXIT_FAILED) from None
    print(result.text)
    print(f"[{result.stop_reason} after {result.turns} calls]", file=sys.stderr)
    return EXIT_OK


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
