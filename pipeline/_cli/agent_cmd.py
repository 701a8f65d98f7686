"""``agent``: a small coding agent in the current directory, on the Anthropic API."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
from opentelemetry import trace

from pipeline._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    ReplayOptions,
    load,
    object_store_states,
    with_tracing,
)
from pipeline._cli.safe_text import readable_safe, terminal_safe
from pipeline.context import SessionContext
from pipeline.policies import ToolPolicies
from pipeline.store.files import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.store.sessions import SessionStorage
from pipeline.transcript.read import TranscriptWriter
from pipeline.wire.encoding import encodable

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


_MAX_RETRIES = 10
_MAX_RETRY_WAIT = 60.0


def _check_environment(args: argparse.Namespace) -> None:
    """What the API client needs, checked before anything is written."""
    if not 0 <= args.max_retries <= _MAX_RETRIES:
        raise CliError(f"--max-retries must be from 0 to {_MAX_RETRIES}, got {args.max_retries}")
    if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
        raise CliError("no API key: set ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN)")
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL"):
        value = os.environ.get(name) or ""
        if not (value.isascii() and value.isprintable()) or " " in value:
            # a header or URL cannot carry it: the client would fail on every call
            raise CliError(f"{name} holds characters a request cannot carry")
    if not (args.model.isascii() and args.model.isprintable()):
        raise CliError("--model holds characters a request cannot carry")
    base_url = os.environ.get("ANTHROPIC_BASE_URL")
    if base_url:
        try:
            parts = urlsplit(base_url)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise CliError(f"ANTHROPIC_BASE_URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CliError("ANTHROPIC_BASE_URL must be an http(s) URL with a host")


def run_agent(
    args: argparse.Namespace,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
) -> int:
    """The ``agent`` command: a coding agent in the current directory."""
    from pipeline.agent import SessionBusyError, session_lock, store_root_of

    _check_environment(args)
    store = options.store  # a local --store; None with an s3:// one
    shared = object_store_states(args)
    if store is not None and store.exists() and not store.is_dir():
        raise CliError(f"--store: {store} is not a directory")
    if args.resume is not None:
        loaded = load(args.resume, lenient=True)
        if loaded.session_id is None:
            raise CliError(f"cannot resume {args.resume}: no session id in the transcript")
        try:
            session_id = validate_session_id(loaded.session_id)
        except ValueError as exc:
            raise CliError(f"cannot resume {args.resume}: {exc}") from None
        root = store if store is not None else store_root_of(loaded.path, session_id)
        transcript = loaded.path
    else:
        try:
            if args.session_id == "":
                raise CliError("--session-id: give a non-empty id (or none: a random one)")
            session_id = validate_session_id(args.session_id or str(uuid.uuid4()))
        except ValueError as exc:
            raise CliError(f"--session-id: {exc}") from None
        root = store if store is not None else Path(".sluicegate")
        transcript = root / session_id / "transcript.jsonl"
        if transcript.is_symlink() or (transcript.exists() and transcript.stat().st_size):
            raise CliError(
                f"session {session_id!r} already exists ({transcript}): continue it with "
                "--resume, or choose another --session-id"
            )
    try:
        # the lock is the transcript's, wherever the store root is
        with session_lock(transcript):
            storage = shared.open(session_id) if shared is not None else None
            return _run_locked(args, options, tracer, provider, root, session_id, storage)
    except SessionBusyError as exc:
        raise CliError(str(exc), EXIT_FAILED) from None
    except OSError as exc:
        raise CliError(f"cannot use the session directory: {exc}", EXIT_FAILED) from None


def _run_locked(
    args: argparse.Namespace,
    options: ReplayOptions,
    tracer: trace.Tracer | None,
    provider: TracerProvider | None,
    root: Path,
    session_id: str,
    storage: SessionStorage | None,
) -> int:
    """The session under its lock. ``storage``: the persisted results on an object store
    (``--store s3://``); the transcript and the calibration stay local under ``root``."""
    import anthropic

    from pipeline._cli.coding_tools import bash_tool, read_file_tool
    from pipeline.agent import Agent, AgentAPIError, AgentResult, RetryPolicy, TurnLog

    cwd = Path.cwd()
    telemetry: Any = {"tracer_provider": provider} if provider is not None else None
    try:
        # the agent retries, bounded; the SDK would wait as long as retry-after says
        client = anthropic.AsyncAnthropic(
            open_telemetry=telemetry, max_retries=0, timeout=args.timeout
        )
    except (anthropic.AnthropicError, ValueError, TypeError) as exc:
        raise CliError(f"cannot create the API client: {exc}") from None
    pipe = options.pipeline()
    policies = ToolPolicies(cap=options.per_tool_chars)
    retry = RetryPolicy(retries=args.max_retries, max_wait=_MAX_RETRY_WAIT)

    def report(log: TurnLog) -> None:
        done = [g for g in log.gated if g.decision == "persist"]
        print(
            f"[call {log.number}] {log.usage.input_side:,} input tokens "
            f"(estimated {log.estimated_tokens:,}); persisted {len(log.report.persisted)} by "
            f"the budget, {len(done)} by the gate; re-applied {log.report.reapplied}",
            file=sys.stderr,
        )

    settings: dict[str, Any] = {
        "model": args.model,
        "pipeline": pipe,
        "readback": False,  # read_file below reads the store too
        "max_tokens": args.max_tokens,
        "max_turns": args.max_turns,
        "on_turn": report,
        "retry": retry,
    }
    if args.resume is not None:
        try:
            agent = Agent.resume(args.resume, client, root=root, **settings)
        except ValueError as exc:  # PairingError included: the API would refuse the history
            raise CliError(f"cannot resume {args.resume}: {exc}") from None
        agent.ctx.tool_policies = policies
        if tracer is not None:
            agent.ctx.tracer = tracer
        if storage is not None:
            agent.ctx.store = storage.store  # the replacements recorded name its objects
        transcript = args.resume
    else:
        transcript = root / session_id / "transcript.jsonl"
        ctx = SessionContext(
            session_id,
            root,
            store=storage.store if storage is not None else None,
            tool_policies=policies,
            tracer=tracer,
            transcript=TranscriptWriter(transcript, session_id),
        )
        agent = Agent(client, ctx=ctx, **settings)
    if storage is not None:
        agent.add_tool(read_file_tool(cwd, store_reader=storage.reader))
        where = f"; results on {terminal_safe(storage.location)}"
    else:
        agent.add_tool(read_file_tool(cwd, root / agent.ctx.session_id / TOOL_RESULTS_SUBDIR))
        where = ""
    if args.allow_bash:
        agent.add_tool(bash_tool(cwd))
    print(f"session {agent.ctx.session_id}: transcript {transcript}{where}", file=sys.stderr)

    async def run() -> AgentResult:
        async with client:  # its connections close in the loop that opened them
            return await agent.run(args.prompt)

    try:
        result = anyio.run(run)
    except AgentAPIError as exc:
        raise CliError(f"API error: {exc}", EXIT_FAILED) from None
    answer = encodable(result.text)  # a lone surrogate in the answer cannot be printed
    # on a terminal, an escape sequence in the answer must not act on it (piped: as it came)
    print(readable_safe(answer) if sys.stdout.isatty() else answer)
    print(f"[{result.stop_reason} after {result.turns} calls]", file=sys.stderr)
    return EXIT_OK
