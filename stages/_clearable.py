"""What clearing old tool results could free -- the whole-history scan behind ``Microcompact`` --
and the per-session state that stage keeps.

A pass reads the whole history only when a trigger fires (or when it cannot extend its last
output); this module is that read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pipeline.incremental import AppendWatch
from pipeline.messages import Message
from pipeline.replacement import PERSISTED_OUTPUT_TAG, content_is_empty
from pipeline.tokens import find_anchor, rough_tokens_for_messages
from stages._shared import CLEARED_PLACEHOLDER, result_ids, tool_results

__all__ = [
    "ClearState",
    "ClearableResult",
    "ClearableScan",
    "LastPass",
    "Reapplied",
    "is_preview",
    "newest_turn_ids",
    "response_times",
    "scan_clearable",
]


def is_preview(content: Any) -> bool:
    """A persisted-output preview: already small, and it points at the full output."""
    return isinstance(content, str) and content.startswith(PERSISTED_OUTPUT_TAG)


def _is_protected_content(content: Any) -> bool:
    """Content microcompact never touches: empty, already cleared, or a persisted-output preview
    (replacing a preview would lose the path to the full output)."""
    if content_is_empty(content):
        return True
    if isinstance(content, str):
        return content == CLEARED_PLACEHOLDER or is_preview(content)
    if isinstance(content, list):
        texts = [
            b.get("text") for b in content if isinstance(b, Mapping) and b.get("type") == "text"
        ]
        return any(
            isinstance(t, str) and (t == CLEARED_PLACEHOLDER or is_preview(t)) for t in texts
        )
    return True  # unknown shape: leave it alone rather than guess


def _block_tokens(block: Mapping[str, Any]) -> int:
    # the tracker's own estimate rules (images a fixed 2,000, JSON 2 chars/token, ...)
    return rough_tokens_for_messages((Message(type="user", content=[dict(block)], uuid=""),))


_PLACEHOLDER_TOKENS = _block_tokens(
    {"type": "tool_result", "tool_use_id": "", "content": CLEARED_PLACEHOLDER}
)


@dataclass(slots=True)
class ClearableResult:
    """Every occurrence of one compactable tool_use_id's result (ids should be unique)."""

    tool_use_id: str
    positions: list[tuple[int, int]] = field(default_factory=list)
    """(message index, block index) of each occurrence, in order."""
    last_position: int = -1
    protected: bool = False
    """In the newest turn, or with content microcompact never touches."""
    tokens_before_anchor: int = 0
    """Reclaimable tokens of occurrences the last response's usage counted."""
    reclaim: int = 0
    """Estimated tokens freed by clearing every occurrence."""


@dataclass(slots=True)
class ClearableScan:
    """The compactable results of a history."""

    results: dict[str, ClearableResult]
    """Compactable results by id, in order of first occurrence."""
    newest_turn_ids: set[str]
    """Every tool_use_id answered in the newest turn (compactable or not)."""

    def newest_ids(self, keep: int) -> set[str]:
        """The ``keep`` most recent compactable results, by their latest occurrence."""
        if keep == 0:
            return set()
        ordered = sorted(self.results.values(), key=lambda r: r.last_position)
        return {r.tool_use_id for r in ordered[-keep:]}


def newest_turn_ids(messages: Sequence[Message], turn_start: int) -> set[str]:
    """tool_use_ids answered after the newest turn began (never cleared, never re-applied)."""
    return set(result_ids(messages[turn_start + 1 :]))


def _parse_time(ts: str | None) -> datetime | None:
    if not ts:
        return None
    try:
        dt = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def response_times(
    messages: Sequence[Message], response: tuple[int, int] | None
) -> tuple[datetime | None, datetime | None]:
    """When the last response was recorded, and the latest timestamp recorded after it."""
    if response is None:
        return None, None
    stamps = [_parse_time(m.timestamp) for m in messages[response[1] + 1 :]]
    known = [t for t in stamps if t is not None]
    return _parse_time(messages[response[1]].timestamp), max(known) if known else None


def scan_clearable(
    messages: Sequence[Message],
    start: int,
    turn_start: int,
    names: Mapping[str, str],
    tools: frozenset[str],
    gains: dict[int, tuple[Mapping[str, Any], int]] | None = None,
) -> ClearableScan:
    """Every compactable result from ``start`` on: what clearing it would free, whether it may
    be cleared. ``turn_start``: first fragment of the last response (the newest turn follows).

    ``gains`` keeps what clearing each block would free, by block identity (blocks are never
    mutated), so a later scan prices only blocks it has not seen."""
    if gains is None:
        gains = {}
    anchor = find_anchor(messages)
    anchor_index = anchor[0] if anchor is not None else -1
    results: dict[str, ClearableResult] = {}
    newest: set[str] = set()
    position = 0
    for i in range(start, len(messages)):
        for j, b in tool_results(messages[i]):
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                continue
            position += 1
            in_newest_turn = i > turn_start
            if in_newest_turn:
                newest.add(tid)
            # an excluded tool is never touched, not even to re-apply an earlier decision; a
            # result whose tool_use is unknown counts as not compactable
            if names.get(tid) not in tools:
                continue
            r = results.setdefault(tid, ClearableResult(tid))
            r.positions.append((i, j))
            r.last_position = position
            if in_newest_turn or _is_protected_content(b.get("content")):
                r.protected = True
                continue
            known = gains.get(id(b))
            if known is not None and known[0] is b:
                gain = known[1]
            else:
                gain = max(0, _block_tokens(b) - _PLACEHOLDER_TOKENS)
                gains[id(b)] = (b, gain)  # holding the block keeps its id unique
            r.reclaim += gain
            if i < anchor_index:
                r.tokens_before_anchor += gain
    return ClearableScan(results, newest)


@dataclass(frozen=True, slots=True)
class LastPass:
    """What the previous pass sent, kept so the next pass can extend it."""

    cleared: int
    """``len(cleared)`` it was made with (clears are only ever added)."""
    turn_start: int
    """Where its newest turn began: from there on, what it sent may change with the next turn."""
    newest_cleared: bool
    """Some cleared id was held back only because it was in that newest turn."""
    out: list[Message]
    """What it sent, when that differs from its input (a private copy: callers may mutate the
    list they were given; this one is never mutated)."""
    first_patch: int
    """First position where ``out`` differs from the pass's input (its length if none)."""
    held: int
    """Cleared ids present in the history and sent cleared (from the next pass on)."""
    tools: frozenset[str]
    """The compactable tools it applied clears to (a stage swapped in may differ)."""


@dataclass(frozen=True, slots=True)
class Reapplied:
    """Earlier clears applied to a history: the output, where it first differs from the
    input, how many clears it holds, and whether one waited in the newest turn."""

    out: list[Message]
    first_patch: int
    held: int
    newest_cleared: bool


@dataclass(slots=True)
class ClearState:
    """One session's clears: tool_use_id → the exact text sent instead, re-applied verbatim.

    The text is stored (not rebuilt) so a later change of placeholder can never shift the
    cached prefix of a resumed session.
    """

    cleared: dict[str, str] = field(default_factory=dict)
    since: dict[str, list[str]] = field(default_factory=dict)
    """Usage-anchor uuid -> ids cleared while it was the anchor: a pass that still anchors
    there (a retried call) frees them again against that usage, which counted them."""
    watch: AppendWatch = field(default_factory=AppendWatch)
    last: LastPass | None = None
    gains: dict[int, tuple[Mapping[str, Any], int]] = field(default_factory=dict)
    """What clearing each block would free, by block identity (see ``scan_clearable``)."""
    """The previous pass's re-application, while it can be extended."""
    bad_records: int = 0
    """Damaged records found on restore (not yet logged)."""

    @classmethod
    def restore(cls, records: list[Mapping[str, Any]], strategy: str) -> ClearState:
        """A resumed session's clears; a damaged record is counted, and its results are
        simply sent whole (it must not fail the turn)."""
        state = cls()
        for data in records:
            if data.get("strategy", strategy) != strategy:
                continue  # another strategy used this slot earlier; its records are not ours
            ids, text = data.get("cleared"), data.get("placeholder", CLEARED_PLACEHOLDER)
            if not isinstance(ids, list) or not isinstance(text, str):
                state.bad_records += 1
                continue
            anchor = data.get("anchor")
            for tid in ids:
                if isinstance(tid, str):
                    state.cleared.setdefault(tid, text)
                    if isinstance(anchor, str):
                        state.since.setdefault(anchor, []).append(tid)
                else:
                    state.bad_records += 1
        return state
