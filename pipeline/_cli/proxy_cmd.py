"""``proxy``: the Messages API reverse proxy (see :mod:`pipeline.proxy`), served by uvicorn."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline._cli.common import EXIT_OK, CliError, ReplayOptions
from pipeline._cli.safe_text import terminal_safe
from pipeline._cli.store_cmd import describe, warn_errors
from pipeline.policies import ToolPolicies
from pipeline.retention import PruneReport, prune_periodically, prune_store

PRUNE_INTERVAL = 3_600.0
"""Seconds between two prunes of the store while the proxy runs (``--retain``,
``--max-store-size``)."""

_PREFIX = "sluicegate proxy"


def cmd_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted (SIGINT/SIGTERM: a graceful shutdown)."""
    try:
        import uvicorn

        from pipeline.proxy import build_app
    except ImportError:
        raise CliError("the proxy needs its extra: pip install 'sluicegate[proxy]'") from None
    parts = urlsplit(args.upstream)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--upstream must be an http(s) URL, got {args.upstream[:80]!r}")
    options = ReplayOptions.from_args(args)
    options.pipeline()  # a bad --stage is refused before the server starts
    root = options.store or Path(".sluicegate")
    app = build_app(
        pipeline=options.pipeline,
        root=root,
        upstream=args.upstream,
        tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
        cache_breakpoint=args.cache_breakpoint,
        background=retention(args, root),
    )
    print(
        f"sluicegate proxy on http://{args.host}:{args.port} -> {args.upstream} "
        f"(ANTHROPIC_BASE_URL=http://{args.host}:{args.port})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return EXIT_OK


def retention(
    args: argparse.Namespace, root: Path
) -> list[Callable[[], Coroutine[Any, Any, object]]]:
    """With ``--retain`` or ``--max-store-size``: prune the store now (before the server
    starts, reported on stderr), and return the task that prunes it every
    :data:`PRUNE_INTERVAL` seconds while the proxy runs. Without them: nothing, no task."""
    max_age, max_bytes = args.retain, args.max_store_size
    if max_age is None and max_bytes is None:
        return []
    if root.exists() and not root.is_dir():
        raise CliError(f"--store {root}: not a directory")
    try:
        report = prune_store(root, max_age=max_age, max_bytes=max_bytes)
    except OSError as exc:
        raise CliError(f"--store {root}: cannot prune: {exc.strerror or exc}") from None
    _report(report, always=True)
    periodic = functools.partial(
        prune_periodically,
        root,
        interval=PRUNE_INTERVAL,
        max_age=max_age,
        max_bytes=max_bytes,
        on_report=_report,
        on_error=_prune_failed,
    )
    return [periodic]


def _report(report: PruneReport, *, always: bool = False) -> None:
    # the periodic prunes speak only when they did something
    if always or report.removed or report.errors:
        where = terminal_safe(str(report.root))
        print(f"{_PREFIX}: store {where}: {describe(report)}", file=sys.stderr)
    warn_errors(report, _PREFIX)


def _prune_failed(exc: Exception) -> None:
    shown = terminal_safe(str(exc), limit=500)
    print(f"{_PREFIX}: warning: store prune failed: {shown}", file=sys.stderr)
