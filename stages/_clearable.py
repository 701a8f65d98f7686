"""What clearing old tool results could free -- the whole-history scan behind ``Microcompact``.

A pass reads the whole history only when a trigger fires (or when it cannot extend its last
output); this module is that read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.messages import Message
from pipeline.results.keys import is_replacement_text
from pipeline.results.reading import content_is_empty
from pipeline.tokens import find_anchor, rough_tokens_for_block, rough_tokens_for_messages
from pipeline.wire.harness import split_tail
from stages._shared import CLEARED_PLACEHOLDER, ContentFor, result_ids, tool_results

__all__ = [
    "ClearableResult",
    "ClearableScan",
    "Gains",
    "HistoryAt",
    "block_gain",
    "clears",
    "is_preview",
    "is_protected_content",
    "newest_turn_ids",
    "response_times",
    "rough_tokens_priced",
    "scan_clearable",
]


def is_preview(content: Any) -> bool:
    """A persisted-output preview: already small, and it points at the full output."""
    return is_replacement_text(content)


def is_protected_content(content: Any) -> bool:
    """Content microcompact never touches: empty, already cleared, or a persisted-output preview
    (replacing a preview would lose the path to the full output); a harness tail
    (:mod:`pipeline.wire.harness`) aside."""
    content = split_tail(content)[0]
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


_PLACEHOLDER_TOKENS = rough_tokens_for_block(
    {"type": "tool_result", "tool_use_id": "", "content": CLEARED_PLACEHOLDER}
)

Gains = dict[int, tuple[Mapping[str, Any], int]]
"""The rough tokens of tool_result blocks priced so far, by block identity (blocks are never
mutated); each entry holds its block, which keeps the id unique."""


def block_gain(block: Mapping[str, Any], gains: Gains, *, keep: bool = True) -> int:
    """The tokens clearing ``block`` would free (the block priced once while ``gains`` keeps
    its price; ``keep=False``: the caller keeps the gain, and the price is let go)."""
    known = gains.get(id(block)) if keep else gains.pop(id(block), None)
    if known is not None and known[0] is block:
        return max(0, known[1] - _PLACEHOLDER_TOKENS)
    tokens = rough_tokens_for_block(block)
    if keep:
        gains[id(block)] = (block, tokens)
    return max(0, tokens - _PLACEHOLDER_TOKENS)


def rough_tokens_priced(messages: Sequence[Message], gains: Gains) -> int:
    """``rough_tokens_for_messages(messages)``, with the blocks in ``gains`` not priced again
    (a clear prices what follows it: mostly results a scan has priced already)."""
    total = 0
    for m in messages:
        content = m.content
        if m.type != "user" or not isinstance(content, list):
            total += rough_tokens_for_messages((m,))
            continue
        for b in content:
            if (
                type(b) is dict
                and b.get("content") is CLEARED_PLACEHOLDER
                and b.get("type") == "tool_result"
            ):  # what a clear just wrote: a result with string content costs its text alone
                total += _PLACEHOLDER_TOKENS
                continue
            if isinstance(b, Mapping):
                known = gains.get(id(b))
                total += (
                    known[1] if known is not None and known[0] is b else rough_tokens_for_block(b)
                )
    return total


@dataclass(slots=True)
class ClearableResult:
    """Every occurrence of one compactable tool_use_id's result (ids should be unique)."""

    tool_use_id: str
    first_position: int = 0
    """The position (among tool_results with an id, from the thread start) of its first
    occurrence."""
    positions: tuple[int, ...] = ()
    """The message index of each occurrence, in order (a tuple: most results occur once, and
    a long session holds thousands)."""
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

    def __contains__(self, tid: object) -> bool:
        return tid in self.results

    def get(self, tid: str) -> ClearableResult | None:
        """Every occurrence of ``tid``."""
        return self.results.get(tid)

    def newest_ids(self, keep: int) -> set[str]:
        """The ``keep`` most recent compactable results, by their latest occurrence."""
        if keep == 0:
            return set()
        ordered = sorted(self.results.values(), key=lambda r: r.last_position)
        return {r.tool_use_id for r in ordered[-keep:]}

    def candidates(self, cleared: Mapping[str, str]) -> list[ClearableResult]:
        """Every result not cleared, in order of first occurrence."""
        return [r for tid, r in self.results.items() if tid not in cleared]

    def kept(self, cleared: Mapping[str, str]) -> int:
        """How many results are not cleared."""
        return sum(1 for tid in self.results if tid not in cleared)


def clears(texts: Mapping[str, str]) -> ContentFor:
    """The cleared text of each result ``texts`` names -- never over a persisted-output preview,
    which points at the full output (not even by id)."""

    def content_for(block: Mapping[str, Any]) -> str | None:
        tid = block.get("tool_use_id")
        text = texts.get(tid) if isinstance(tid, str) else None
        # (the text first: an output held out of memory is read only for a result cleared)
        if text is None or is_preview(block.get("content")):
            return None
        return text

    return content_for


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


@dataclass(slots=True)
class HistoryAt:
    """A history as a clearing pass reads it: ``messages`` from ``start`` (where the live
    thread starts), the newest turn from ``turn_start`` (the first fragment of the last
    response), tool ``names`` by tool_use id, the clearable ``tools``."""

    messages: list[Message]
    start: int
    turn_start: int
    names: Mapping[str, str]
    tools: frozenset[str]


def scan_clearable(
    messages: Sequence[Message],
    start: int,
    turn_start: int,
    names: Mapping[str, str],
    tools: frozenset[str],
    gains: Gains | None = None,
    position: int = 0,
) -> ClearableScan:
    """Every compactable result from ``start`` on: what clearing it would free, whether it may
    be cleared. ``turn_start``: first fragment of the last response (the newest turn follows).

    ``gains`` keeps each block's rough tokens (see :func:`block_gain`), so a later
    scan prices only blocks it has not seen. ``position``: how many results with an id come
    before ``start`` (positions count on from there)."""
    if gains is None:
        gains = {}
    anchor = find_anchor(messages)
    anchor_index = anchor[0] if anchor is not None else -1
    results: dict[str, ClearableResult] = {}
    newest: set[str] = set()
    for i in range(start, len(messages)):
        for _, b in tool_results(messages[i]):
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
            r = results.get(tid)
            if r is None:
                r = results[tid] = ClearableResult(tid, first_position=position)
            r.positions += (i,)
            r.last_position = position
            if in_newest_turn or is_protected_content(b.get("content")):
                r.protected = True
                continue
            gain = block_gain(b, gains)
            r.reclaim += gain
            if i < anchor_index:
                r.tokens_before_anchor += gain
    return ClearableScan(results, newest)
