"""The ``sluicegate`` / ``python -m pipeline`` argument parser."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from pathlib import Path
from typing import Any

import pipeline._cli.demo_session as demo
from pipeline._cli.agent_cmd import cmd_agent
from pipeline._cli.arg_types import (
    duration,
    log_flush_seconds,
    nonempty_path,
    pipelines,
    port,
    positive_int,
    seconds,
    size,
    two_or_more,
    upstream_seconds,
)
from pipeline._cli.batched_lines import FLUSH_EVERY as LOG_FLUSH
from pipeline._cli.demo_cmd import cmd_demo
from pipeline._cli.options import (
    AGENT_STORE_HELP,
    PROXY_STORE_HELP,
    TRACING_EPILOG,
    add_object_store_options,
    add_replay_options,
    para,
)
from pipeline._cli.replay_cmd import cmd_replay
from pipeline._cli.store_cmd import cmd_store_prune
from pipeline.dropin.conversations import MAX_HELD, MAX_HELD_BYTES
from pipeline.dropin.held_families import MAX_BRANCHES
from pipeline.dropin.limits import (
    BODY_TIMEOUT,
    EVENT_LOOPS,
    HEADER_TIMEOUT,
    HTTP_PARSERS,
    UPSTREAM_CLIENTS,
    UPSTREAM_TIMEOUT,
)
from stages import registry as stage_registry


def _version() -> str:
    try:
        return importlib.metadata.version("sluicegate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``sluicegate`` / ``python -m pipeline`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="sluicegate",
        description="Replay agent sessions through sluicegate's context-budget pipeline "
        "(tool_result_budget -> history_snip -> microcompact -> context_collapse -> autocompact).",
        epilog="Run 'sluicegate COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"sluicegate {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    replay = sub.add_parser(
        "replay",
        help="replay a recorded Claude Code session (JSONL), call by call",
        description=para(
            "Replay a Claude Code transcript through the default pipeline exactly as a "
            "live loop would have run it: for each API call (each distinct assistant message.id, "
            "in order) the conversation as it stood just before that call goes through the "
            "pipeline, with one session context carried across calls, and is normalised to wire "
            "form. The main thread is replayed (sub-agent records interleaved in older files are "
            "left out). The replay starts from an empty ledger and never writes to the transcript."
        ),
        epilog=TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument(
        "transcript",
        type=Path,
        metavar="TRANSCRIPT.jsonl",
        help="a session transcript (Claude Code's JSONL, or one sluicegate wrote)",
    )
    replay.add_argument(
        "--lenient",
        action="store_true",
        help="skip malformed lines (listed on stderr) instead of failing on the first",
    )
    add_replay_options(replay, temporary_store=True)
    compare = replay.add_argument_group("comparing pipelines")
    compare.add_argument(
        "--compare",
        type=pipelines,
        metavar="A,B,...",
        help="replay under several pipelines and print a cost table instead: built-in "
        f"{', '.join(stage_registry.COMPARISON_POINTS)}, or SLOT=STRATEGY[:k=v] for the "
        "default pipeline with that change",
    )
    compare.add_argument(
        "--plot",
        type=nonempty_path,
        metavar="FILE.png",
        help="with --compare: draw request size per call (the extension names the format)",
    )
    compare.add_argument(
        "--prices",
        type=nonempty_path,
        metavar="FILE.json",
        help='with --compare: price table {"sonnet": {"input": 3, "output": 15}, ...}',
    )
    replay.set_defaults(handler=cmd_replay)

    demo_p = sub.add_parser(
        "demo",
        help="run the agent loop against a scripted local server (no API key, no network)",
        description=para(
            "Run the agent loop on the real anthropic SDK against a scripted Messages server on "
            "127.0.0.1 (random port) that asks for what a real coding session asked for: ten "
            "parallel ~40K-char job logs in one turn, a ~56K Read, a single ~80K Bash output, "
            "small results. Every request goes through the default pipeline; each tool result "
            "passes the per-tool gate as it is produced; the transcript is written as the loop "
            "goes. Shows per call what the budget persisted and re-applied. With --replay, the "
            "same session is written as a transcript and replayed instead."
        ),
        epilog=TRACING_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_p.add_argument(
        "--out",
        type=nonempty_path,
        metavar="FILE",
        help="the session's transcript (replaced if it exists); default: "
        "demo-session.jsonl in the store directory (removed with a temporary one)",
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
    add_replay_options(demo_p, temporary_store=True)
    demo_p.set_defaults(handler=cmd_demo)
    _add_agent_parser(sub)
    _add_proxy_parser(sub)
    _add_store_parser(sub)
    return parser


def _add_proxy_parser(sub: Any) -> None:
    from pipeline._cli.proxy_cmd import cmd_proxy

    proxy_p = sub.add_parser(
        "proxy",
        help="a Messages API reverse proxy: point ANTHROPIC_BASE_URL at it",
        description="POST /v1/messages goes through the pipeline, everything else passes "
        "through; persisted outputs and decisions go under --store (default .sluicegate), "
        "shared by a fleet of proxies when it is s3://BUCKET/PREFIX or az://CONTAINER/PREFIX.",
    )
    proxy_p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default %(default)s: this machine only)",
    )
    proxy_p.add_argument(
        "--port",
        type=port,
        default=8787,
        help="port to listen on; 0: one the system picks, printed at start (default %(default)s)",
    )
    proxy_p.add_argument(
        "--upstream",
        default="https://api.anthropic.com",
        metavar="URL",
        help="where requests go on to (default %(default)s)",
    )
    proxy_p.add_argument(
        "--single-tenant",
        action="store_true",
        help="one set of conversations for every API key (default: each key's conversations, "
        "records and persisted results are its own, under a digest of the key)",
    )
    proxy_p.add_argument(
        "--cache-breakpoint",
        action="store_true",
        help="for clients that set no cache_control, mark the last block so the API caches "
        "the prefix (a client's own breakpoints are left alone)",
    )
    limits = proxy_p.add_argument_group(
        "limits",
        "What a client can hold: each bound is the proxy's own, a client past it is answered "
        "as the API would answer (413, 504) or closed.",
    )
    limits.add_argument(
        "--max-body",
        type=size,
        default="32MB",
        metavar="SIZE",
        help="largest request body read (e.g. 32MB, the API's own limit; default %(default)s); "
        "a larger one is refused with 413",
    )
    limits.add_argument(
        "--upstream-timeout",
        type=upstream_seconds,
        default=UPSTREAM_TIMEOUT,
        metavar="SECONDS",
        help="how long an upstream call may take to answer, then 504 timeout_error "
        "(default %(default)s; a non-streamed answer takes the whole generation)",
    )
    limits.add_argument(
        "--http",
        choices=HTTP_PARSERS,
        default="auto",
        help="the HTTP/1.1 parser requests are read with: httptools (C, the faster) or h11 "
        "(pure Python); auto is httptools where it is installed (default %(default)s)",
    )
    limits.add_argument(
        "--loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the event loop the proxy runs on: uvloop (libuv, the faster) or asyncio's own; "
        "auto is uvloop where it is installed (default %(default)s)",
    )
    limits.add_argument(
        "--upstream-client",
        choices=UPSTREAM_CLIENTS,
        default="auto",
        help="the HTTP client upstream calls go out with: httptools (asyncio's connections, "
        "answers read by llhttp: the least CPU a call), aiohttp or httpx2; auto is the first "
        "of httptools and aiohttp that is installed, where no proxy is named by HTTP_PROXY, "
        "HTTPS_PROXY or ALL_PROXY (default %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        help="client connections served at once, past it 503 (default: half the open-file "
        "limit, which is raised to its hard limit at start, less a reserve); also the "
        "upstream calls run at once",
    )
    limits.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEADER_TIMEOUT,
        metavar="SECONDS",
        help="how long a client has to send a request head, from connecting or from the last "
        "response, before its connection is closed (default %(default)s)",
    )
    limits.add_argument(
        "--body-timeout",
        type=seconds,
        default=BODY_TIMEOUT,
        metavar="SECONDS",
        help="how long a client has to send a request's whole body after its head, then 408 "
        "and its connection closed (default %(default)s)",
    )
    limits.add_argument(
        "--max-conversations",
        type=positive_int,
        default=MAX_HELD,
        metavar="N",
        help="conversations held in memory; past it the least recently used are let go and "
        "load from the store when they come back (default %(default)s)",
    )
    limits.add_argument(
        "--max-held-size",
        type=size,
        default=MAX_HELD_BYTES,
        metavar="SIZE",
        help="what the last requests of the conversations held may come to, each counted as "
        "its body's bytes and 2 KiB a message (e.g. 512M; the proxy's memory grows by "
        "~0.7-1.5 times it); past it the least recently used are "
        f"let go as past --max-conversations (default {MAX_HELD_BYTES >> 20}M)",
    )
    limits.add_argument(
        "--max-branches",
        type=two_or_more,
        default=MAX_BRANCHES,
        metavar="N",
        help="conversations held of one family (forks, edits, rewinds of one conversation; "
        "no more than --max-conversations); past it its least recently used are let go, "
        "never its first (default %(default)s)",
    )
    limits.add_argument(
        "--fsync-each",
        action="store_true",
        help="make each record of a local --store durable (fsync) before going on; by "
        "default records are written at once and made durable after the call's response, "
        "with those of the calls that end within 0.1 s of it (a power loss in that moment "
        "may lose those calls' records)",
    )
    limits.add_argument(
        "--log-flush",
        type=log_flush_seconds,
        default=LOG_FLUSH,
        metavar="SECONDS",
        help="how long an info line (a request's wire.request) may wait to be written with "
        "the others of that moment, in one write to stderr; a warning or error is written at "
        "once, after them; 0 writes each line as it comes (default %(default)s; a proxy "
        "killed outright loses the info lines of that moment)",
    )
    limits.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave the C allocator as glibc sets it; by default, on glibc, blocks up to "
        "32 MiB (request bodies) come from its heap and up to 32 MiB freed is kept there, in "
        "at most two heaps, so that a growing conversation's bodies do not come as fresh "
        "pages each call (left alone too where GLIBC_TUNABLES or MALLOC_* set them)",
    )
    retention = proxy_p.add_argument_group(
        "retention",
        "The store lives as long as the proxy: prune it at start-up, then every hour. A "
        "conversation still going on may read back a result that is removed (the read then "
        "fails): choose limits past the sessions you use. A local --store only: for "
        "s3://, expire objects with the bucket's lifecycle rules.",
    )
    retention.add_argument(
        "--retain",
        type=duration,
        metavar="AGE",
        help="remove persisted results last modified more than AGE ago (e.g. 12h, 7d, 2w)",
    )
    retention.add_argument(
        "--max-store-size",
        type=size,
        metavar="SIZE",
        help="then remove the oldest persisted results until they total at most SIZE (e.g. "
        "500M, 2G; powers of 1024)",
    )
    add_replay_options(
        proxy_p, temporary_store=False, store_help=PROXY_STORE_HELP, per_call_output=False
    )
    add_object_store_options(proxy_p)
    proxy_p.set_defaults(handler=cmd_proxy, store=None)


def _add_store_parser(sub: Any) -> None:
    store_p = sub.add_parser(
        "store",
        help="look after a store directory (prune old persisted results)",
        description="Look after a long-lived store directory (<DIR>/<session>/tool-results/).",
    )
    actions = store_p.add_subparsers(dest="store_action", metavar="ACTION", required=True)
    prune = actions.add_parser(
        "prune",
        help="remove persisted results by age and/or total size",
        description=para(
            "Remove persisted tool results from a store: those last modified more than "
            "--older-than ago, then the oldest until the rest total at most --max-size; then "
            "the tool-results and session directories this empties. Only files named as the "
            "store names persisted results are touched: temp files being written, transcripts, "
            "other files and symlinks (and what they point at) never are. A result a "
            "conversation still going on refers to may be removed, and the model's read of it "
            "then fails: which age is safe is your call."
        ),
        epilog="exit codes: 0 done, 1 some files could not be removed (listed on stderr), "
        "2 bad usage.",
    )
    prune.add_argument(
        "--store", type=nonempty_path, required=True, metavar="DIR", help="the store"
    )
    prune.add_argument(
        "--older-than",
        type=duration,
        metavar="AGE",
        help="remove results last modified more than AGE ago: a number, then s, m, h, d or w "
        "(30m, 12h, 7d)",
    )
    prune.add_argument(
        "--max-size",
        type=size,
        metavar="SIZE",
        help="then remove the oldest until the results total at most SIZE: bytes, or a number "
        "then K, M, G or T (200K, 500M, 2G; powers of 1024)",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="remove nothing; list what would be removed"
    )
    prune.add_argument("--json", action="store_true", help="print the report as one JSON object")
    prune.set_defaults(handler=cmd_store_prune)


def _add_agent_parser(sub: Any) -> None:
    agent_p = sub.add_parser(
        "agent",
        help="run a small coding agent in the current directory (needs an API key)",
        description=para(
            "Run a small coding agent in the current directory on the Anthropic API, every "
            "request going through the default pipeline. Tools: read_file (files under the "
            "current directory and persisted outputs; never persisted itself) and, only with "
            "--allow-bash, bash. Key and base URL come from the SDK's usual environment "
            "variables (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL). The session (transcript and "
            "persisted outputs) goes under --store (default .sluicegate)."
        ),
        epilog=TRACING_EPILOG,
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
    agent_p.add_argument(
        "--max-turns",
        type=positive_int,
        default=25,
        metavar="N",
        help="model calls at most before the loop stops (default %(default)s)",
    )
    agent_p.add_argument(
        "--max-retries",
        type=int,
        default=2,
        metavar="N",
        help="retries of a failed call, 0-10; retry-after honoured up to 60 s "
        "(default %(default)s)",
    )
    agent_p.add_argument(
        "--timeout",
        type=seconds,
        default=600.0,
        metavar="SECONDS",
        help="how long one API call may take before it fails (default %(default)s)",
    )
    agent_p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=8_192,
        metavar="N",
        help="max_tokens of each model call (default %(default)s)",
    )
    agent_p.add_argument(
        "--resume", type=Path, metavar="TRANSCRIPT", help="continue the session of this transcript"
    )
    agent_p.add_argument("--session-id", help="id of a new session (default: random)")
    # the agent prints its answer: no per-call table, JSON lines, dumps or progress bar
    add_replay_options(
        agent_p, temporary_store=False, store_help=AGENT_STORE_HELP, per_call_output=False
    )
    add_object_store_options(agent_p)
    agent_p.set_defaults(handler=cmd_agent, store=None)
