"""``agent``: a small coding agent in the current directory, on the Anthropic API."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry import trace

from pipeline._cli.common import EXIT_FAILED, EXIT_OK, CliError, ReplayOptions, load, with_tracing
from pipeline.context import SessionContext
from pipeline.policies import ToolPolicies
from pipeline.storage import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.transcript import TranscriptWriter

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


def cmd_agent(args: argparse.Namespace) -> int:
    if not args.model:
        raise CliError("no model: pass --model or set ANTHROPIC_MODEL")
    if args.prompt is None and args.resume is None:
        raise CliError("nothing to do: give a PROMPT, or --resume TRANSCRIPT")
    options = ReplayOptions.from_args(args)

    def go(tracer: trace.Tracer | None, provider: TracerProvider | None) -> int:
        return run_agent(args, options, tracer, provider)

    return with_tracing(args, go)


def run_agent(
    args: argparse.Namespace,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
) -> int:
    """The ``agent`` command: a coding agent in the current directory."""
    import uuid

    import anthropic

    from pipeline._cli.coding_tools import bash_tool, read_file_tool
    from pipeline.agent import Agent, AgentAPIError, TurnLog

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
