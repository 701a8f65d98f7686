"""``store prune``: retention for a long-lived store (see :mod:`pipeline.store.retention`), and the
duration and size values its options (and the proxy's) take."""

from __future__ import annotations

import argparse
import decimal
import json
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

from pipeline._cli.common import EXIT_FAILED, EXIT_OK, CliError
from pipeline._cli.safe_text import terminal_safe
from pipeline.store.retention import PruneReport, prune_store

_MAX_TEXT = 32
"""Longer values are refused before they are parsed (and shown cut in the error)."""

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhdw])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400, "w": 7 * 86_400}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_duration(text: str) -> timedelta:
    """``30m``, ``12h``, ``7d``, ``2w``, ``90s`` (a number, then one unit) → a positive
    ``timedelta``; ``ValueError`` saying what is expected."""
    match = _DURATION.fullmatch(text.strip()) if len(text) <= _MAX_TEXT else None
    if match is None:
        raise ValueError(
            f"expected a duration such as 30m, 12h or 7d (a number, then one of s, m, h, d, "
            f"w), got {text[:40]!r}"
        )
    seconds = float(match[1]) * _DURATION_UNITS[match[2]]
    if seconds <= 0:
        raise ValueError(f"must be longer than 0, got {text!r}")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"too long: {text!r}") from None


def parse_size(text: str) -> int:
    """``200K``, ``500M``, ``2G``, ``1T`` (powers of 1024; ``KB``/``KiB`` and so on alike, any
    case) or a number of bytes → a positive number of bytes; ``ValueError`` saying what is
    expected."""
    match = _SIZE.fullmatch(text.strip()) if len(text) <= _MAX_TEXT else None
    if match is None:
        raise ValueError(
            f"expected a size such as 200K, 500M or 2G (bytes, or a number then K, M, G or T: "
            f"powers of 1024), got {text[:40]!r}"
        )
    # exact decimal arithmetic: 1.5G is 1610612736 bytes, not a float's approximation
    size = int(decimal.Decimal(match[1]) * _SIZE_UNITS[(match[2] or "").lower()])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return size


def format_bytes(n: int) -> str:
    """``1,234,567 bytes (1.2 MiB)``; below 1 KiB just the bytes."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    power = min(len(units) - 1, max(0, n.bit_length() - 1) // 10)
    if power == 0:
        return f"{n:,} bytes"
    return f"{n:,} bytes ({n / (1 << 10 * power):.1f} {units[power]})"


def describe(report: PruneReport) -> str:
    """One line: what a prune removed (or would), and what it kept."""
    verb = "would remove" if report.dry_run else "removed"
    by_age = sum(1 for f in report.removed if f.reason == "age")
    by_size = report.removed_count - by_age
    why = f" ({by_age} by age, {by_size} by size)" if report.removed else ""
    line = (
        f"{verb} {report.removed_count} persisted result(s), "
        f"{format_bytes(report.removed_bytes)}{why}; kept {report.kept_files}, "
        f"{format_bytes(report.kept_bytes)}"
    )
    if report.removed_conversations:
        line += f"; {verb} {len(report.removed_conversations)} idle conversation(s) whole"
    if report.removed_dirs:
        line += f"; {verb} {len(report.removed_dirs)} emptied director(ies)"
    if report.vanished:
        line += f"; {report.vanished} already gone"
    return line


def warn_errors(report: PruneReport, prefix: str = "sluicegate") -> None:
    """Each file or directory a prune could not handle, one warning line each on stderr."""
    for path, error in report.errors:
        shown = terminal_safe(f"{path}: {error}", limit=500)
        print(f"{prefix}: warning: not pruned: {shown}", file=sys.stderr)


def cmd_store_prune(args: argparse.Namespace) -> int:
    """``store prune``: remove persisted results by age and/or total size."""
    root: Path = args.store
    if args.older_than is None and args.max_size is None:
        raise CliError("store prune: nothing to prune by: give --older-than AGE and/or --max-size")
    if not root.exists():
        raise CliError(f"--store {root}: no such directory")
    if not root.is_dir():
        raise CliError(f"--store {root}: not a directory")
    try:
        report = prune_store(
            root, max_age=args.older_than, max_bytes=args.max_size, dry_run=args.dry_run
        )
    except OSError as exc:  # the root itself cannot be read
        raise CliError(f"--store {root}: cannot read: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"store {terminal_safe(str(root))}: {describe(report)}")
        if report.dry_run:
            now = time.time()
            for f in report.removed:
                age = timedelta(seconds=max(0, round(now - f.mtime)))
                print(
                    f"  {terminal_safe(str(f.path))}  {format_bytes(f.size)}, "
                    f"modified {age} ago, by {f.reason}"
                )
    warn_errors(report)
    return EXIT_FAILED if report.errors else EXIT_OK
