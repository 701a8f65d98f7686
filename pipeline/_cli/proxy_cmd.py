"""``proxy``: the Messages API reverse proxy (see :mod:`pipeline.proxy`), served by uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import urlsplit

from pipeline._cli.common import EXIT_OK, CliError, ReplayOptions
from pipeline.policies import ToolPolicies


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
    app = build_app(
        pipeline=options.pipeline,
        root=options.store or Path(".sluicegate"),
        upstream=args.upstream,
        tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
        cache_breakpoint=args.cache_breakpoint,
    )
    print(
        f"sluicegate proxy on http://{args.host}:{args.port} -> {args.upstream} "
        f"(ANTHROPIC_BASE_URL=http://{args.host}:{args.port})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return EXIT_OK
