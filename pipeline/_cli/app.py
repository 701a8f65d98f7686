"""The command line, ``python -m pipeline`` (console script ``sluicegate``).

This package is the composition root: the only place that names the concrete ``stages``. The
library (everything else under ``pipeline``) never imports it.

Exit codes: 0 done; 1 the command failed part-way (a stage error, an unwritable dump directory,
an API error); 2 bad usage or bad input (a missing file, a malformed transcript line, a missing
OTel SDK).
"""

from __future__ import annotations

import os
import sys

from pipeline._cli.common import EXIT_FAILED, CliError
from pipeline._cli.parser import build_parser

__all__ = ["build_parser", "main"]


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
