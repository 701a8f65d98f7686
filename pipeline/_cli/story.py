"""The plain-words story of a replay: one sentence per call that persisted results, and what
the later requests re-applied."""

from __future__ import annotations

from pipeline._cli.safe_text import terminal_safe
from pipeline.transcript.replay import CallResult

__all__ = ["Story"]

_STORY_LINES = 12


def _n(chars: int | None) -> str:
    # exact: a rounded size beside a rounded limit can read "30K, over its limit (30K)"
    return f"{chars or 0:,}"


class Story:
    """What the stages did, in plain words: one line per call that persisted something."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._more = 0
        self._reapplied = 0

    def add(self, result: CallResult) -> None:
        """Tell one call."""
        self._reapplied += result.reapplied
        said = _tell(result)
        if not said:
            return
        if len(self._lines) < _STORY_LINES:
            self._lines.append(f"  call {result.call.number}: {said}")
        else:
            self._more += 1

    def lines(self) -> list[str]:
        """The story's lines (none when nothing was persisted or re-applied)."""
        if not self._lines:
            return []
        out = ["what happened:", *self._lines]
        if self._more:
            out.append(f"  ... and {self._more} more calls that persisted results")
        if self._reapplied:
            out.append(
                f"  each later request re-applied the earlier replacements byte for byte "
                f"({self._reapplied:,} in all), so the cached prompt prefix never changed"
            )
        return out


def _tell(result: CallResult) -> str:
    """One call's persisted results in a sentence (empty when it persisted none)."""
    parts: list[str] = []
    groups: dict[tuple[int | None, int | None, int | None], int] = {}
    for p in result.persisted:
        if p.reason == "per_message":  # one clause per API-level user message
            key = (p.group_results, p.group_chars, p.limit)
            groups[key] = groups.get(key, 0) + 1
    for (results, chars, limit), count in groups.items():
        together = f"{results} results, {_n(chars)} chars together"
        parts.append(
            f"{together}, over the per-message budget of {_n(limit)}: the {count} largest "
            f"{'was' if count == 1 else 'were'} saved to disk"
        )
    for p in result.persisted:
        if p.reason == "per_message":
            continue
        tool = terminal_safe(p.tool_name or "tool")
        shown = f" of {_n(p.limit)}" if p.limit is not None else ""
        parts.append(
            f"a {tool} result of {_n(p.chars)} chars, over its per-tool limit{shown}: saved to "
            "disk as it arrived"
        )
    if not parts:
        return ""
    each = "each" if len(result.persisted) > 1 else "it"
    return "; ".join(parts) + f"; the model sees a ~2K preview of {each} and the file's path"
