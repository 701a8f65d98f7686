"""What a replay reports: totals and estimate error, a progress bar, a table or JSON lines."""

from __future__ import annotations

import dataclasses
import json
import statistics
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from pipeline._cli.safe_text import terminal_safe
from pipeline._cli.story import Story
from pipeline.tokens.stats import UNDERCOUNT_TOLERANCE, ErrorStats, nearest_rank, rounded
from pipeline.transcript.read import Transcript
from pipeline.transcript.replay import CallResult

__all__ = [
    "ESTIMATORS",
    "REMOVED_WITH_TEMPORARY_STORE",
    "JsonOutput",
    "Output",
    "Progress",
    "ReplaySummary",
    "Story",
    "TableOutput",
    "transcript_info",
]

REMOVED_WITH_TEMPORARY_STORE = (
    "removed with the temporary store (use --keep-store or --store DIR to keep them)"
)
"""What the table says of persisted results whose temporary store the command removes."""

ESTIMATORS = ("default", "reference")
"""The estimators a replay measures side by side (keys of ``CallResult.observations``)."""


@dataclasses.dataclass(slots=True)
class ReplaySummary:
    """Totals over a replay, and how far the token estimate was from the API's count."""

    session_id: str
    store: Path
    per_message_chars: int
    per_tool_chars: int
    calls: int = 0
    persisted: int = 0
    persisted_chars: int = 0
    reapplied: int = 0
    persist_failed: int = 0
    peak_request_chars: int = 0
    pairing_problems: int = 0
    """Broken tool pairings over all requests (a problem still there next call counts again)."""
    calls_with_pairing_problems: int = 0
    """Requests the Messages API would reject for their tool pairing."""
    calls_with_actual_tokens: int = 0
    relative_errors: array[float] = dataclasses.field(default_factory=lambda: array("d"))
    """(estimated − actual) / actual, for calls whose actual count is known and > 0 (an
    array: a long session's replay has thousands)."""
    part_pairs: dict[str, array[int]] = dataclasses.field(
        default_factory=lambda: {name: array("q") for name in ESTIMATORS}
    )
    """Per estimator: estimated part, then real growth since the anchor, of each call where
    the growth is measurable (an anchor, no compaction since it, known usage), one after the
    other."""

    request_tokens: int | None = None
    """Tokens of the system prompt and tools the last call's estimate counted (None: the
    transcript does not record them)."""
    transcript: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the loader read besides the messages (see :func:`transcript_info`)."""
    store_kept: bool = True
    """Whether ``store`` is still there after the command: False for a temporary store
    removed at the end (no ``--keep-store``), whose persisted paths then no longer exist."""

    story: Story = dataclasses.field(default_factory=lambda: Story())
    """The decisions in plain words, for the table's end."""

    def add(self, result: CallResult, request_chars: int) -> None:
        """Count one call."""
        self.story.add(result)
        self.calls += 1
        if result.request_tokens is not None:
            self.request_tokens = result.request_tokens
        self.persisted += len(result.persisted)
        self.persisted_chars += sum(p.chars for p in result.persisted)
        self.reapplied += result.reapplied
        self.persist_failed += len(result.persist_failed)
        self.peak_request_chars = max(self.peak_request_chars, request_chars)
        actual = result.actual_tokens
        if actual is not None:
            self.calls_with_actual_tokens += 1
            if actual > 0:
                self.relative_errors.append((result.estimated_tokens - actual) / actual)
        for name, obs in result.observations.items():
            if obs.real_growth is not None:
                pairs = self.part_pairs.setdefault(name, array("q"))
                pairs.append(obs.estimated_part)
                pairs.append(obs.real_growth)

    def add_pairing(self, problems: int) -> None:
        """Count the pairing problems of the call just added."""
        self.pairing_problems += problems
        self.calls_with_pairing_problems += problems > 0

    def part_errors(self, estimator: str) -> ErrorStats:
        """Error of ``estimator``'s estimated part against the real growth since the anchor
        (relative figures on calls that grew by >= 2,000 tokens)."""
        flat = self.part_pairs.get(estimator, array("q"))
        return ErrorStats.from_pairs(zip(flat[::2], flat[1::2], strict=True))

    @property
    def median_abs_error(self) -> float | None:
        """Median of |estimated − actual| / actual."""
        errors = [abs(e) for e in self.relative_errors]
        return statistics.median(errors) if errors else None

    @property
    def p95_abs_error(self) -> float | None:
        """95th percentile (nearest rank) of |estimated − actual| / actual."""
        errors = sorted(abs(e) for e in self.relative_errors)
        return nearest_rank(errors, 0.95) if errors else None

    @property
    def undercount_share(self) -> float | None:
        """Share of calls whose estimate was more than 10% below the actual count."""
        if not self.relative_errors:
            return None
        under = sum(1 for e in self.relative_errors if e < -UNDERCOUNT_TOLERANCE)
        return under / len(self.relative_errors)

    def to_json(self) -> dict[str, Any]:
        """The ``summary`` object of the final ``--json`` line."""
        return {
            "session_id": self.session_id,
            "calls": self.calls,
            "persisted": self.persisted,
            "persisted_chars": self.persisted_chars,
            "reapplied": self.reapplied,
            "persist_failed": self.persist_failed,
            "peak_request_chars": self.peak_request_chars,
            "pairing_problems": self.pairing_problems,
            "calls_with_pairing_problems": self.calls_with_pairing_problems,
            "calls_with_actual_tokens": self.calls_with_actual_tokens,
            "abs_rel_error_median": rounded(self.median_abs_error),
            "abs_rel_error_p95": rounded(self.p95_abs_error),
            "undercount_gt_10pct_share": rounded(self.undercount_share),
            "estimated_part": {name: self.part_errors(name).to_json() for name in ESTIMATORS},
            "request_tokens": self.request_tokens,
            "transcript": self.transcript,
            "per_message_chars": self.per_message_chars,
            "per_tool_chars": self.per_tool_chars,
            "store": str(self.store),
            "store_kept": self.store_kept,
        }


# ---------------------------------------------------------------------------------------------
# Output: progress on stderr; a table or JSON lines on stdout
# ---------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr, redrawn in place; inert when disabled."""

    WIDTH = 30

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled and total > 0
        self.done = 0
        self._drawn = False

    def advance(self) -> None:
        """One more call replayed."""
        self.done += 1
        self.draw()

    def draw(self) -> None:
        """(Re)draw the bar."""
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\rreplaying [{bar}] {self.done}/{self.total} calls")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the bar so other output does not land on its line."""
        if self._drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 40) + "\r")
            self.stream.flush()
            self._drawn = False


class Output(Protocol):
    """Where per-call results and the summary go."""

    def call(self, result: CallResult, request_chars: int) -> None:
        """Report one call."""

    def summary(self, summary: ReplaySummary) -> None:
        """Report the totals."""


class JsonOutput:
    """The ``--json`` contract: one object per call, then ``{"summary": {...}}``."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def call(self, result: CallResult, request_chars: int) -> None:
        """Write ``CallResult.to_json()`` as one line."""
        self._line(result.to_json())

    def summary(self, summary: ReplaySummary) -> None:
        """Write the summary line."""
        self._line({"summary": summary.to_json()})

    def _line(self, obj: dict[str, Any]) -> None:
        self.stream.write(json.dumps(obj) + "\n")
        self.stream.flush()


def _fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


class TableOutput:
    """An aligned table: a row per call, a line per newly persisted result, then totals."""

    COLUMNS = (
        ("call", 5),
        ("message_id", 30),
        ("est.tokens", 11),
        ("act.tokens", 11),
        ("error", 8),
        ("persisted", 10),
        ("reapplied", 10),
        ("req.chars", 12),
    )

    def __init__(self, stream: IO[str], results_dir: Path) -> None:
        self.stream = stream
        self.results_dir = results_dir.absolute()
        self._header_written = False

    def _row(self, cells: Sequence[str]) -> str:
        parts = []
        for (name, width), cell in zip(self.COLUMNS, cells, strict=True):
            parts.append(cell.ljust(width) if name == "message_id" else cell.rjust(width))
        return " ".join(parts).rstrip()

    def _show_path(self, path: str) -> str:
        # the directory is printed once in the summary; rows show file names only
        try:
            return str(Path(path).relative_to(self.results_dir))
        except ValueError:
            return path

    def call(self, result: CallResult, request_chars: int) -> None:
        """Write the call's row and its persisted results."""
        lines = []
        if not self._header_written:
            lines.append(self._row([name for name, _ in self.COLUMNS]))
            self._header_written = True
        actual = result.actual_tokens
        error = (result.estimated_tokens - actual) / actual if actual else None
        lines.append(
            self._row(
                [
                    str(result.call.number),
                    terminal_safe(result.call.message_id),
                    _fmt_int(result.estimated_tokens),
                    _fmt_int(actual),
                    "-" if error is None else f"{error * 100:+.1f}%",
                    str(len(result.persisted)),
                    str(result.reapplied),
                    _fmt_int(request_chars),
                ]
            )
        )
        for p in result.persisted:
            lines.append(
                f"      + persisted {terminal_safe(self._show_path(p.path))}  "
                f"{terminal_safe(p.tool_name or '?')}, {p.chars:,} chars, {terminal_safe(p.reason)}"
            )
        for tool_use_id in result.persist_failed:
            lines.append(
                f"      ! persist failed for {terminal_safe(tool_use_id)}: original content sent"
            )
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

    def summary(self, s: ReplaySummary) -> None:
        """Write the totals."""
        lines = [""] if self._header_written else []
        lines += [
            f"session {terminal_safe(s.session_id)}: {s.calls} calls, {s.persisted} persisted "
            f"({s.persisted_chars:,} chars), {s.reapplied} re-applied, "
            f"{s.persist_failed} persist failures, peak request {s.peak_request_chars:,} chars",
        ]
        if s.calls_with_pairing_problems:
            lines.append(
                f"broken tool pairing (the API would reject the request) in "
                f"{s.calls_with_pairing_problems} of {s.calls} calls"
            )
        if s.relative_errors:
            under = s.undercount_share or 0.0
            lines.append(
                f"token estimate vs API usage ({s.calls_with_actual_tokens}/{s.calls} calls "
                f"known): median |error| {_fmt_pct(s.median_abs_error)}, "
                f"p95 {_fmt_pct(s.p95_abs_error)}, under-counted by >10% in "
                f"{round(under * len(s.relative_errors))} ({_fmt_pct(under)})"
            )
        else:
            lines.append("token estimate vs API usage: no call with known usage")
        lines += _part_lines(s)
        if s.request_tokens is not None:
            lines.append(
                f"system prompt + tools: ~{s.request_tokens:,} tokens per call (the last call's), "
                "counted in the estimates"
            )
        lines += _transcript_lines(s.transcript)
        lines += s.story.lines()
        lines.append(
            f"limits: {s.per_message_chars:,} chars per message, {s.per_tool_chars:,} per tool"
        )
        if s.store_kept:
            lines.append(f"persisted results: {terminal_safe(str(self.results_dir))}")
        else:  # the directory is gone by the time this is read: do not point at it
            lines.append(f"persisted results: {REMOVED_WITH_TEMPORARY_STORE}")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def transcript_info(transcript: Transcript) -> dict[str, Any]:
    """What a replay reports about the transcript besides its calls: the Claude Code version
    that wrote it, the calls it recorded (2.1), how the recorded wire compared with the
    records, and record types the loader does not know."""
    check = transcript.wire_check
    return {
        "version": transcript.version,
        "recorded_requests": len(transcript.requests),
        "wire_replaced": check.replaced,
        "wire_left_out": check.left_out,
        "wire_unverified": check.unverified,
        "unknown_record_types": dict(sorted(transcript.unknown_types.items())),
    }


def _transcript_lines(info: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    if info.get("recorded_requests"):
        lines.append(
            f"transcript: Claude Code {terminal_safe(str(info.get('version')))}, "
            f"{info['recorded_requests']} recorded requests; recorded messages used where the "
            f"records render otherwise: {info['wire_replaced']}, records left out as never sent: "
            f"{info['wire_left_out']}, calls not verifiable: {info['wire_unverified']}"
        )
    unknown = info.get("unknown_record_types")
    if unknown:
        shown = ", ".join(f"{terminal_safe(t)} ×{n}" for t, n in list(unknown.items())[:10])
        lines.append(f"record types not understood (skipped): {shown}")
    return lines


def _part_lines(s: ReplaySummary) -> list[str]:
    """The estimated part (growth since the last response), default and reference side by side."""
    stats = {name: s.part_errors(name) for name in ESTIMATORS}
    first = stats[ESTIMATORS[0]]
    if not first.calls:
        return ["estimated part vs real growth since the last response: no call measured"]
    lines = [
        f"estimated part vs real growth since the last response ({first.calls} calls measured, "
        f"{first.big_calls} grew by >= {first.min_growth:,} tokens):"
    ]
    width = max(len(name) for name in ESTIMATORS)
    for name, st in stats.items():
        if not st.calls:  # e.g. a live session measures only its own tracker
            continue
        tokens = (
            f"all calls: median {_fmt_tokens(st.median_abs_tokens)}, "
            f"p95 {_fmt_tokens(st.p95_abs_tokens)} tokens off"
        )
        if st.big_calls:
            lines.append(
                f"  {name.ljust(width)}: median |error| {_fmt_pct(st.median_abs)}, "
                f"p95 {_fmt_pct(st.p95_abs)}, under-counted by >10% in {st.undercounted} "
                f"({_fmt_pct(st.undercount_share)}); {tokens}"
            )
        else:
            lines.append(f"  {name.ljust(width)}: {tokens}")
    return lines


def _fmt_tokens(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"
