"""Compare pipelines on one recorded session under a prefix-cache cost model.

Each pipeline replays the session (fresh state and store each); every request is measured:

- **tokens** of a wire message: its visible characters (text, thinking, tool input and output)
  over ``chars_per_token`` — the same yardstick for every pipeline — plus, per request, the
  fixed overhead of the system prompt and tools (read off the session's first call).
- **prefix cache**: a request re-uses the longest run of leading messages it shares with the
  previous request, if that came within ``ttl_seconds`` (by the session's timestamps); the rest
  is written to the cache (the breakpoint sits on the last message, as agents place it). A
  request under ``min_cacheable_tokens`` is not cached at all.
- **price**: per model family from an editable table; cache writes 1.25× input, reads 0.1×.
- **prefix break**: a request that does not start with the whole previous request.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pipeline._cli.safe_text import terminal_safe
from pipeline.context import SessionContext
from pipeline.core import Pipeline
from pipeline.messages import Message
from pipeline.transcript.replay import replay_messages, request_chars

__all__ = [
    "PRICES",
    "CacheModel",
    "Price",
    "RunStats",
    "compare_pipelines",
    "format_table",
    "load_prices",
    "plot_formats",
    "plot_sizes",
    "price_for",
]


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    cache_write_factor: float = 1.25
    cache_read_factor: float = 0.1


PRICES: dict[str, Price] = {
    "opus-4-5": Price(5.0, 25.0),
    "opus-4-6": Price(5.0, 25.0),
    "opus-4-7": Price(5.0, 25.0),
    "opus-4": Price(15.0, 75.0),
    "sonnet": Price(3.0, 15.0),
    "haiku-4": Price(1.0, 5.0),
    "haiku": Price(0.8, 4.0),
    "": Price(3.0, 15.0),
}
"""Model-name fragment → price; the longest fragment found in the model name wins. Edit, or
load another table with :func:`load_prices` (``replay --prices FILE.json``)."""


def price_for(model: str | None, prices: Mapping[str, Price] = PRICES) -> Price:
    """The price of the longest table key contained in ``model``."""
    name = (model or "").lower()
    key = max((k for k in prices if k in name), key=len, default="")
    return prices.get(key) or Price(3.0, 15.0)


_PRICE_FIELDS = ("input", "output", "cache_write_factor", "cache_read_factor")


def _price_value(path: str | Path, key: str, field_name: str, value: object) -> float:
    """A finite, non-negative number, or ``ValueError`` naming the entry (a NaN or infinite
    price would make every cost, and the ``--json`` output, meaningless)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{path}: {key!r} {field_name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise ValueError(
            f"{path}: {key!r} {field_name} must be a finite number >= 0, got {value!r}"
        )
    return number


def load_prices(path: str | Path) -> dict[str, Price]:
    """A price table from JSON: ``{"sonnet": {"input": 3, "output": 15}, ...}``.

    Each entry needs ``input`` and ``output`` (USD per million tokens) and may set
    ``cache_write_factor`` and ``cache_read_factor``; every value a finite number >= 0.
    ``ValueError`` names the bad entry.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a price table") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a price table is a JSON object of model fragment → prices")
    table: dict[str, Price] = {}
    for key, value in raw.items():
        if not isinstance(value, dict) or not {"input", "output"} <= value.keys():
            raise ValueError(f"{path}: {key!r} needs 'input' and 'output' (USD per million)")
        unknown = sorted(set(value) - set(_PRICE_FIELDS))
        if unknown:
            raise ValueError(
                f"{path}: {key!r} has unknown field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(_PRICE_FIELDS)}"
            )
        table[str(key)] = Price(**{k: _price_value(path, str(key), k, v) for k, v in value.items()})
    return table


@dataclass(frozen=True, slots=True)
class CacheModel:
    """How the prompt cache is modelled."""

    ttl_seconds: float = 300.0
    min_cacheable_tokens: int = 1_024
    chars_per_token: float = 3.0
    context_window: int = 200_000


@dataclass(slots=True)
class RunStats:
    """One pipeline's totals over the session."""

    name: str
    calls: int = 0
    tokens_sent: int = 0
    cache_read: int = 0
    cache_write: int = 0
    uncached: int = 0
    output: int = 0
    prefix_breaks: int = 0
    peak_tokens: int = 0
    over_window: int = 0
    cost_usd: float = 0.0
    sizes: list[int] = field(default_factory=list)
    """Request tokens per call, for plots."""

    def row(self) -> dict[str, Any]:
        """The table row as a mapping (also the ``--json`` form)."""
        return {
            "pipeline": self.name,
            "calls": self.calls,
            "tokens_sent": self.tokens_sent,
            "cache_read": self.cache_read,
            "cache_write": self.cache_write,
            "uncached": self.uncached,
            "prefix_breaks": self.prefix_breaks,
            "peak_tokens": self.peak_tokens,
            "calls_over_window": self.over_window,
            # JSON has no NaN or Infinity: an overflowing cost is null, never invalid output
            "cost_usd": round(self.cost_usd, 4) if math.isfinite(self.cost_usd) else None,
        }


def _message_tokens(param: Mapping[str, Any], chars_per_token: float) -> int:
    return math.ceil(request_chars([param]) / chars_per_token)  # type: ignore[list-item]


def _seconds(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


async def _run_one(
    name: str,
    messages: Sequence[Message],
    pipeline: Pipeline,
    ctx: SessionContext,
    model: CacheModel,
    prices: Mapping[str, Price],
) -> RunStats:
    stats = RunStats(name)
    previous: list[Any] = []
    previous_time: float | None = None
    overhead: int | None = None
    async for result in replay_messages(messages, pipeline, ctx):
        request = [dict(p) for p in result.request]
        per_message = [_message_tokens(p, model.chars_per_token) for p in request]
        usage = result.call.usage
        if overhead is None:
            # system prompt and tool definitions: what the first call's usage holds beyond its
            # messages; the same for every pipeline
            overhead = max(0, (usage.input_side if usage else 0) - sum(per_message))
        total = overhead + sum(per_message)
        shared = 0
        while shared < min(len(previous), len(request)) and previous[shared] == request[shared]:
            shared += 1
        if previous and shared < len(previous):
            stats.prefix_breaks += 1
        now = _seconds(messages[result.call.index].timestamp)
        warm = bool(previous) and (
            now is None or previous_time is None or now - previous_time <= model.ttl_seconds
        )
        if total < model.min_cacheable_tokens:
            read, write, uncached = 0, 0, total
        else:
            read = overhead + sum(per_message[:shared]) if warm else 0
            write, uncached = total - read, 0
        output = usage.output_tokens if usage else 0
        price = price_for(messages[result.call.index].model, prices)
        stats.cost_usd += (
            uncached * price.input
            + write * price.input * price.cache_write_factor
            + read * price.input * price.cache_read_factor
            + output * price.output
        ) / 1e6
        stats.calls += 1
        stats.tokens_sent += total
        stats.cache_read += read
        stats.cache_write += write
        stats.uncached += uncached
        stats.output += output
        stats.peak_tokens = max(stats.peak_tokens, total)
        stats.over_window += total > model.context_window
        stats.sizes.append(total)
        previous, previous_time = request, now
    return stats


async def compare_pipelines(
    messages: Sequence[Message],
    pipelines: Mapping[str, Pipeline],
    make_context: Callable[[str], SessionContext],
    *,
    model: CacheModel | None = None,
    prices: Mapping[str, Price] = PRICES,
) -> list[RunStats]:
    """Replay ``messages`` under each pipeline (a fresh context each) and measure it."""
    cache = model or CacheModel()
    return [
        await _run_one(name, messages, pipe, make_context(name), cache, prices)
        for name, pipe in pipelines.items()
    ]


def format_table(runs: Sequence[RunStats]) -> str:
    """An aligned text table, one row per pipeline."""
    headers = (
        "pipeline",
        "tokens sent",
        "cache read",
        "cache write",
        "uncached",
        "prefix breaks",
        "peak request",
        "over window",
        "cost $",
    )
    rows = [
        (
            terminal_safe(r.name),
            f"{r.tokens_sent:,}",
            f"{r.cache_read:,}",
            f"{r.cache_write:,}",
            f"{r.uncached:,}",
            str(r.prefix_breaks),
            f"{r.peak_tokens:,}",
            str(r.over_window),
            f"{r.cost_usd:.2f}" if math.isfinite(r.cost_usd) else "-",
        )
        for r in runs
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = []
    for cells in (headers, *rows):
        parts = [cells[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(parts))
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'sluicegate[plot]'") from exc
    return plt


def plot_formats() -> frozenset[str]:
    """The file extensions :func:`plot_sizes` can write (``RuntimeError`` without matplotlib)."""
    plt = _pyplot()
    fig = plt.figure()
    try:
        return frozenset(fig.canvas.get_supported_filetypes())
    finally:
        plt.close(fig)


def plot_sizes(runs: Sequence[RunStats], path: str | Path, *, title: str = "") -> None:
    """Draw request size per call per pipeline to ``path`` (needs the ``plot`` extra).

    The format is ``path``'s extension (see :func:`plot_formats`). The image is written to a
    temporary file beside ``path`` and renamed into place, so a failed write leaves no partial
    image; ``OSError`` or ``ValueError`` (an unknown format) when it cannot be written.
    """
    plt = _pyplot()
    target = Path(path)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        ax.plot(range(len(r.sizes)), r.sizes, label=r.name, linewidth=1.4)
    ax.set_xlabel("API call")
    ax.set_ylabel("request tokens (estimated)")
    if title:
        ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    # a name of our own rather than mkstemp's: the image gets the usual permissions
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format=target.suffix[1:].lower() or None)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
