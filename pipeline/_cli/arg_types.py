"""Argument types of the command line: each parses one option's text or raises
``argparse.ArgumentTypeError`` naming what is wrong (argparse then exits 2 with it)."""

from __future__ import annotations

import argparse
import math
from datetime import timedelta
from pathlib import Path

from pipeline._cli.store_cmd import parse_duration, parse_size

__all__ = [
    "duration",
    "log_flush_seconds",
    "nonempty_path",
    "pipelines",
    "port",
    "positive_int",
    "seconds",
    "size",
    "store_cool_down",
    "store_location",
    "store_retries",
    "store_timeout",
    "two_or_more",
    "upstream_seconds",
]


def positive_int(text: str) -> int:
    return _int_from(text, 1)


def two_or_more(text: str) -> int:
    """A whole number of at least 2 (a family's first conversation and one more)."""
    return _int_from(text, 2)


def _int_from(text: str, least: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _seconds_up_to(text: str, most: int, *, zero: bool = False) -> float:
    """Seconds above 0 (``zero``: from 0) up to ``most``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not math.isfinite(value) or not (value >= 0 if zero else value > 0) or value > most:
        low = "0" if zero else "0 (exclusive)"
        raise argparse.ArgumentTypeError(f"must be from {low} to {most} s, got {text[:40]!r}")
    return value


def _whole_number(text: str, low: int, high: int, what: str = "a whole number") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text[:40]!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
    return value


def seconds(text: str) -> float:
    return _seconds_up_to(text, 3_600)


def log_flush_seconds(text: str) -> float:
    """``--log-flush``: 0 (each line at once) to 60 seconds."""
    return _seconds_up_to(text, 60, zero=True)


def upstream_seconds(text: str) -> float:
    return _seconds_up_to(text, 86_400)


def nonempty_path(text: str) -> Path:
    # Path("") is ".": an empty value (an unset shell variable) would write into the
    # current directory
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty value")
    return Path(text)


def port(text: str) -> int:
    return _whole_number(text, 0, 65_535, "a port number")


def store_location(text: str) -> Path | str:
    # a URL stays text: Path("s3://b/x") would fold the "//" and name a local directory
    if "://" in text:
        return text
    return nonempty_path(text)


def store_timeout(text: str) -> float:
    return _seconds_up_to(text, 600)


def store_cool_down(text: str) -> float:
    return _seconds_up_to(text, 3_600, zero=True)


def store_retries(text: str) -> int:
    return _whole_number(text, 0, 10)


def duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pipelines(text: str) -> str:
    if not any(name.strip() for name in text.split(",")):
        raise argparse.ArgumentTypeError(f"name at least one pipeline, got {text!r}")
    return text
