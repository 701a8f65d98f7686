"""API rounds: where a history may be cut without splitting a response or a tool pair.

A round is one response (all records sharing its id) plus everything up to the next response.
The stages that remove or summarise old history (history snip, context collapse) cut only
between rounds, and never drop the rounds a request depends on.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from functools import cached_property

from pipeline.messages import Message, block_type, first_fragment, live_start
from pipeline.tokens import find_anchor

__all__ = [
    "Price",
    "RoundView",
    "anchor_uuid",
    "api_rounds",
    "cut_indices",
    "freed_before_anchor",
    "is_prompt",
    "last_response",
    "priced_before",
    "protected_rounds",
    "safe_cuts",
]

Price = Callable[[Sequence[Message]], int]
"""Tokens of a message list (``TokenTracker.tokens_for_messages``)."""


def safe_cuts(messages: Sequence[Message]) -> list[bool]:
    """``ok[p]``: a cut between ``messages[p-1]`` and ``messages[p]`` splits no response (id)
    and no tool_use/tool_result pair; ``ok`` has ``len(messages) + 1`` entries."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, m in enumerate(messages):
        # a tool block without a string id pairs with nothing: it ties no two records together
        kind = m.type
        if kind == "assistant":
            if m.message_id is not None:
                k = "r:" + m.message_id
                first.setdefault(k, i)
                last[k] = i
            field, block = "id", "tool_use"
        elif kind == "user":
            field, block = "tool_use_id", "tool_result"
        else:
            continue
        content = m.content
        if isinstance(content, str):  # no tool blocks
            continue
        for b in content:
            if (
                isinstance(b, dict)
                and isinstance(tid := b.get(field), str)
                and b.get("type") == block
            ):
                k = "t:" + tid
                first.setdefault(k, i)
                last[k] = i
    diff = [0] * (len(messages) + 2)
    for k, a in first.items():
        z = last[k]
        if z > a:
            diff[a + 1] += 1
            diff[z + 1] -= 1
    ok, cover = [], 0
    for p in range(len(messages) + 1):
        cover += diff[p]
        ok.append(cover == 0)
    return ok


def cut_indices(messages: Sequence[Message], start: int) -> list[int]:
    """Indices ``i`` in ``(start, len)`` where ``messages[start:i]`` / ``messages[i:]`` splits no
    response and no tool pair, and ``messages[i]`` is a user or assistant record."""
    ok = safe_cuts(messages[start:])
    return [
        i
        for i in range(start + 1, len(messages))
        if ok[i - start] and messages[i].type in ("user", "assistant")
    ]


def last_response(messages: Sequence[Message], start: int = 0) -> tuple[int, int] | None:
    """(first fragment, last record) of the last real response at or after ``start``.

    tool_results can sit between fragments of one streamed response, so the newest turn begins
    right after its FIRST fragment. Synthetic assistant records (errors, interruptions) are not
    responses: the newest turn is measured from the last real one.
    """
    for i in range(len(messages) - 1, start - 1, -1):
        m = messages[i]
        if m.type == "assistant" and not m.is_synthetic:
            return first_fragment(messages, i, start), i
    return None


def api_rounds(
    messages: Sequence[Message], ok: Sequence[bool], start: int | None = None
) -> list[tuple[int, int]]:
    """``[start, end)`` of every round after the prefix (the records before the first response
    after the last compact boundary or server compaction block: what precedes one is not read
    by the API, and the block stays). ``start``: ``live_start(messages)``, when the caller has
    it."""
    n = len(messages)
    live = live_start(messages) if start is None else start
    cuts = [p for p in range(live, n) if ok[p] and messages[p].type == "assistant"]
    bounds = [*cuts, n]
    return [(bounds[i], bounds[i + 1]) for i in range(len(cuts))]


def is_prompt(m: Message) -> bool:
    """A human turn: a user record with something besides tool_results (injected ones excluded)."""
    return (
        m.type == "user" and not m.is_meta and any(block_type(b) != "tool_result" for b in m.blocks)
    )


def protected_rounds(
    messages: Sequence[Message],
    rounds: Sequence[tuple[int, int]],
    keep_recent: int,
    start: int | None = None,
) -> set[int]:
    """Rounds that must stay: the latest ones, and those holding the first user message, the
    latest prompt and the usage anchor (removing the anchor would move the estimate's base).
    ``rounds``: in order and apart, as :func:`api_rounds` gives them. ``start``:
    ``live_start(messages)``, when the caller has it."""
    keep = set(range(max(0, len(rounds) - keep_recent), len(rounds)))
    start = live_start(messages) if start is None else start
    first_user = next((i for i in range(start, len(messages)) if messages[i].type == "user"), None)
    prompt = next(
        (i for i in range(len(messages) - 1, start - 1, -1) if is_prompt(messages[i])), None
    )
    anchor = find_anchor(messages)
    # rounds are in order and apart: the one that holds an index, if any, is the last that
    # starts at or before it
    starts = [s for s, _e in rounds]
    for idx in (first_user, prompt, anchor[0] if anchor else None):
        if idx is not None:
            r = bisect_right(starts, idx) - 1
            if r >= 0 and idx < rounds[r][1]:
                keep.add(r)
    return keep


def anchor_uuid(messages: Sequence[Message]) -> str | None:
    """The uuid of the usage anchor's first record (see :func:`pipeline.tokens.find_anchor`)."""
    anchor = find_anchor(messages)
    return messages[anchor[0]].uuid if anchor else None


def priced_before(price: Price, messages: Sequence[Message], anchor: str | None) -> int:
    """Tokens of what precedes the anchor: the part the anchor's usage counted."""
    if anchor is None:
        return 0
    end = next((i for i, m in enumerate(messages) if m.uuid == anchor), len(messages))
    return price(messages[:end])


def freed_before_anchor(
    price: Price, kept: Sequence[Message], out: Sequence[Message], anchor: str | None
) -> int:
    """Tokens the anchor's usage counted that ``out`` no longer sends: ``kept`` is the projection
    as that request had it (``out`` itself when no decision was made since)."""
    if kept is out:
        return 0
    return priced_before(price, kept, anchor) - priced_before(price, out, anchor)


class RoundView:
    """One pass's view of a history for a stage that cuts it between rounds (history snip,
    context collapse): the usage anchor, prices, and the cut points -- computed on first use
    only, since a steady pass needs none of them."""

    def __init__(self, messages: Sequence[Message], price: Price) -> None:
        self.messages = messages
        self.price = price
        self.anchor = anchor_uuid(messages)
        """The uuid of the usage anchor's first record (None without one)."""

    @cached_property
    def ok(self) -> list[bool]:
        """:func:`safe_cuts` of the history."""
        return safe_cuts(self.messages)

    @cached_property
    def live(self) -> int:
        """:func:`~pipeline.messages.live_start` of the history."""
        return live_start(self.messages)

    def rounds(self, keep_recent: int) -> list[tuple[int, int, bool]]:
        """``(start, end, protected)`` of every round, oldest first (see
        :func:`protected_rounds` for which must stay)."""
        rounds = api_rounds(self.messages, self.ok, self.live)
        keep = protected_rounds(self.messages, rounds, keep_recent, self.live)
        return [(s, e, i in keep) for i, (s, e) in enumerate(rounds)]

    def freed(self, kept: Sequence[Message], out: Sequence[Message]) -> int:
        """:func:`freed_before_anchor` against this history's anchor."""
        return freed_before_anchor(self.price, kept, out, self.anchor)
