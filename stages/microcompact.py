"""The ``microcompact`` stage: clears old tool_result content of compactable tools (SPEC §5).

Two strategies fill the slot; both are named ``microcompact`` so either can replace the other::

    Microcompact()            # strategy "clear-oldest": clears locally, by tool_use_id
    ServerSideMicrocompact()  # strategy "server-clear": asks the API to clear (context editing)

Every pass emits exactly one decision span, ``microcompact.decision`` (no content, ever), with
``sluicegate.decision`` and ``sluicegate.reason``:

=========  ========================  ==============================================================
decision   reason                    meaning
=========  ========================  ==============================================================
clear      ``cleared_idle_gap``      the cache is cold (idle gap ≥ ``idle_minutes``): cleared now
clear      ``cleared_context_size``  context ≥ ``trigger_tokens`` and ≥ ``min_reclaim_tokens``
                                     reclaimable: cleared now
reapply    any "not now" reason      nothing new cleared; earlier clears were re-applied verbatim
skip       ``cache_warm``            only the idle trigger is on and the last response is recent
skip       ``below_trigger``         no trigger fired (context below ``trigger_tokens``; and, if
                                     the idle trigger is on, the cache is still warm)
skip       ``below_min_reclaim``     the size trigger fired but clearing would free too little to
                                     be worth rewriting the cached prefix
skip       ``nothing_eligible``      a trigger fired but no result is old enough / clearable
delegate   ``delegated``             server-side strategy: the API decides (config sent)
=========  ========================  ==============================================================

Attributes under ``sluicegate.``: ``cleared`` (ids newly cleared), ``kept`` (compactable results
left whole), ``reapplied``, ``eligible``, ``reclaimable_tokens``, ``freed_tokens``,
``cache_rewrite_tokens`` (estimated tokens from the first newly cleared result to the end: the
part of the prompt whose cache this pass invalidates), ``trigger`` and ``idle_gap_minutes``.
The same facts go to ``ctx.report.notes["microcompact"]`` so a replay can tell a real cache break
(``cleared > 0``) from a byte-identical re-application.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import compress, count
from typing import Any

import anyio.to_thread

from pipeline import Message, SessionContext
from pipeline.incremental import AppendWatch
from pipeline.messages import Block
from pipeline.replacement import PERSISTED_OUTPUT_TAG, content_is_empty
from pipeline.tokens import find_anchor, rough_tokens_for_messages
from pipeline.tracing import emit_decision
from stages._shared.args import check_bool, check_int

__all__ = [
    "CLEARED_PLACEHOLDER",
    "CLEAR_TOOL_USES_EDIT",
    "CONTEXT_MANAGEMENT_BETA",
    "DEFAULT_COMPACTABLE_TOOLS",
    "Decision",
    "Microcompact",
    "Reason",
    "ServerSideMicrocompact",
]

CLEARED_PLACEHOLDER = "[Old tool result content cleared]"
"""What a cleared tool_result's content becomes (the reference text, byte for byte)."""

DEFAULT_COMPACTABLE_TOOLS: tuple[str, ...] = (
    "Read",
    "Bash",
    "Grep",
    "Glob",
    "WebFetch",
    "WebSearch",
    "Edit",
    "Write",
    "MultiEdit",
    "NotebookEdit",
    "read_file",
    "bash",
)
"""Tools whose old output the model can get again (re-read, re-run): safe to clear."""

CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"
"""The ``anthropic-beta`` value that enables server-side context editing."""

CLEAR_TOOL_USES_EDIT = "clear_tool_uses_20250919"
"""The server-side context-editing strategy that clears old tool results."""


class Decision:
    """Values of ``sluicegate.decision`` on ``microcompact.decision`` spans."""

    CLEAR = "clear"
    REAPPLY = "reapply"
    SKIP = "skip"
    DELEGATE = "delegate"


class Reason:
    """Values of ``sluicegate.reason`` on ``microcompact.decision`` spans (see module doc)."""

    CLEARED_IDLE_GAP = "cleared_idle_gap"
    CLEARED_CONTEXT_SIZE = "cleared_context_size"
    CACHE_WARM = "cache_warm"
    BELOW_TRIGGER = "below_trigger"
    BELOW_MIN_RECLAIM = "below_min_reclaim"
    NOTHING_ELIGIBLE = "nothing_eligible"
    DELEGATED = "delegated"


# --------------------------------------------------------------------------------------------
# Argument checks: constructors take only simple values, so a registry can build them from
# strings like ``microcompact=clear-oldest:keep=5``; a bad value names the argument.
# --------------------------------------------------------------------------------------------


def _check_minutes(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number of minutes >= 0, got {value!r}")
    return float(value)


def _check_names(name: str, value: object, *, allow_empty: bool) -> tuple[str, ...]:
    # A lone string is one tool name (a config string ``exclude_tools=Read`` arrives as one),
    # never iterated character by character.
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a tuple of tool names, got {value!r}")
    names = tuple(value)
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"{name} must hold non-empty strings, got {n!r}")
    if not names and not allow_empty:
        raise ValueError(f"{name} must name at least one tool")
    return tuple(dict.fromkeys(names))  # dedupe, keep order (stable repr and request bytes)


# --------------------------------------------------------------------------------------------
# Reading the conversation
# --------------------------------------------------------------------------------------------


def _last_response(messages: Sequence[Message], start: int) -> tuple[int, int] | None:
    """(first fragment, last record) indexes of the last real response at or after ``start``.

    tool_results can sit between fragments of one streamed response, so the newest turn begins
    right after its FIRST fragment. Synthetic assistant records (errors, interruptions) are not
    responses: the newest turn is measured from the last real one, which protects more.
    """
    last = None
    for i in range(len(messages) - 1, start - 1, -1):
        m = messages[i]
        if m.type == "assistant" and not m.is_synthetic:
            last = i
            break
    if last is None:
        return None
    first = last
    mid = messages[last].message_id
    if mid is not None:
        for j in range(last - 1, start - 1, -1):
            prior = messages[j]
            prior_id = prior.message_id if prior.type == "assistant" else None
            if prior_id == mid:
                first = j
            elif prior_id is not None:
                break
    return first, last


def _parse_time(ts: str | None) -> datetime | None:
    if not ts:
        return None
    try:
        dt = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def _is_protected_content(content: Any) -> bool:
    """Content microcompact never touches: empty, already cleared, or a persisted-output preview.

    A preview is already small and points at the full output; replacing it would lose the path.
    """
    if content_is_empty(content):
        return True
    if isinstance(content, str):
        return content == CLEARED_PLACEHOLDER or content.startswith(PERSISTED_OUTPUT_TAG)
    if isinstance(content, list):
        texts = [
            b.get("text") for b in content if isinstance(b, Mapping) and b.get("type") == "text"
        ]
        return any(
            isinstance(t, str) and (t == CLEARED_PLACEHOLDER or t.startswith(PERSISTED_OUTPUT_TAG))
            for t in texts
        )
    return True  # unknown shape: leave it alone rather than guess


def _block_tokens(block: Mapping[str, Any]) -> int:
    # the tracker's own estimate rules (images a fixed 2,000, JSON 2 chars/token, ...)
    return rough_tokens_for_messages((Message(type="user", content=[dict(block)], uuid=""),))


_PLACEHOLDER_TOKENS = _block_tokens(
    {"type": "tool_result", "tool_use_id": "", "content": CLEARED_PLACEHOLDER}
)


@dataclass(slots=True)
class _Result:
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
class _Scan:
    results: dict[str, _Result]
    """Compactable results by id, in order of first occurrence."""
    newest_turn_ids: set[str]

    def newest_ids(self, keep: int) -> set[str]:
        """The ``keep`` most recent compactable results, by their latest occurrence."""
        if keep == 0:
            return set()
        ordered = sorted(self.results.values(), key=lambda r: r.last_position)
        return {r.tool_use_id for r in ordered[-keep:]}


def _newest_turn_ids(messages: Sequence[Message], turn_start: int) -> set[str]:
    """tool_use_ids answered after the newest turn began (never cleared, never re-applied)."""
    return {
        b["tool_use_id"]
        for m in messages[turn_start + 1 :]
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if isinstance(b, Mapping)
        and b.get("type") == "tool_result"
        and isinstance(b.get("tool_use_id"), str)
    }


def _response_times(
    messages: Sequence[Message], response: tuple[int, int] | None
) -> tuple[datetime | None, datetime | None]:
    """When the last response was recorded, and the latest timestamp recorded after it."""
    if response is None:
        return None, None
    stamps = [_parse_time(m.timestamp) for m in messages[response[1] + 1 :]]
    known = [t for t in stamps if t is not None]
    return _parse_time(messages[response[1]].timestamp), max(known) if known else None


def _scan(
    messages: Sequence[Message],
    start: int,
    turn_start: int,
    names: Mapping[str, str],
    tools: frozenset[str],
) -> _Scan:
    """Every compactable result from ``start`` on: what clearing it would free, whether it may
    be cleared. ``turn_start``: first fragment of the last response (the newest turn follows)."""
    anchor = find_anchor(messages)
    anchor_index = anchor[0] if anchor is not None else -1
    results: dict[str, _Result] = {}
    newest: set[str] = set()
    position = 0
    for i in range(start, len(messages)):
        m = messages[i]
        if m.type != "user" or not isinstance(m.content, list):
            continue
        for j, b in enumerate(m.content):
            if not isinstance(b, Mapping) or b.get("type") != "tool_result":
                continue
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
            r = results.setdefault(tid, _Result(tid))
            r.positions.append((i, j))
            r.last_position = position
            content = b.get("content")
            if in_newest_turn or _is_protected_content(content):
                r.protected = True
                continue
            gain = max(0, _block_tokens(b) - _PLACEHOLDER_TOKENS)
            r.reclaim += gain
            if i < anchor_index:
                r.tokens_before_anchor += gain
    return _Scan(results, newest)


def _apply(messages: list[Message], texts: Mapping[str, str]) -> list[Message]:
    """A new list where the results named in ``texts`` carry the given text as content.

    Every other block field (``tool_use_id``, ``is_error``, ``cache_control``) is kept; messages
    that need no change are the same objects; if nothing changes, the input list itself.
    """
    if not texts:
        return messages
    out: list[Message] | None = None
    for i, m in enumerate(messages):
        if m.type != "user" or not isinstance(m.content, list):
            continue
        blocks: list[Block] | None = None
        for j, b in enumerate(m.content):
            if not isinstance(b, Mapping) or b.get("type") != "tool_result":
                continue
            tid = b.get("tool_use_id")
            text = texts.get(tid) if isinstance(tid, str) else None
            content = b.get("content")
            if text is None or content == text:
                continue
            if isinstance(content, str) and content.startswith(PERSISTED_OUTPUT_TAG):
                continue  # a preview points at the full output: never replaced, not even by id
            if blocks is None:
                blocks = list(m.content)
            blocks[j] = {**b, "content": text}
        if blocks is not None:
            if out is None:
                out = list(messages)
            out[i] = m.with_content(blocks)
    return messages if out is None else out


# --------------------------------------------------------------------------------------------
# Per-session state and resume
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _ClearState:
    """One session's clears: tool_use_id → the exact text sent instead, re-applied verbatim.

    The text is stored (not rebuilt) so a later change of placeholder can never shift the
    cached prefix of a resumed session.
    """

    cleared: dict[str, str] = field(default_factory=dict)
    since: dict[str, list[str]] = field(default_factory=dict)
    """Usage-anchor uuid -> ids cleared while it was the anchor: a pass that still anchors
    there (a retried call) frees them again against that usage, which counted them."""
    watch: AppendWatch = field(default_factory=AppendWatch)
    last: _LastPass | None = None
    """The previous pass's re-application, while it can be extended (``Microcompact._reapply``)."""


@dataclass(frozen=True, slots=True)
class _LastPass:
    cleared: int
    """``len(cleared)`` it was made with (clears are only ever added)."""
    turn_start: int
    """Where its newest turn began: from there on, what it sent may change with the next turn."""
    newest_cleared: bool
    """Some cleared id was held back only because it was in that newest turn."""
    out: tuple[Message, ...]
    """What it sent, when that differs from its input (a copy: callers may mutate lists)."""
    first_patch: int
    """First position where ``out`` differs from the pass's input (its length if none)."""
    held: int
    """Cleared ids present in the history and sent cleared (from the next pass on)."""
    tools: frozenset[str]
    """The compactable tools it applied clears to (a stage swapped in may differ)."""


@dataclass(frozen=True, slots=True)
class _Reapplied:
    out: list[Message]
    first_patch: int
    held: int
    newest_cleared: bool


def _result_ids(messages: Sequence[Message]) -> list[str]:
    return [
        b["tool_use_id"]
        for m in messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if isinstance(b, Mapping)
        and b.get("type") == "tool_result"
        and isinstance(b.get("tool_use_id"), str)
    ]


def _first_difference(a: Sequence[Message], b: Sequence[Message], offset: int = 0) -> int:
    """``offset`` + the first index where ``a`` and ``b`` hold different objects, else + len."""
    return offset + next(compress(count(), map(operator.is_not, a, b)), len(a))


def _restore(ctx: SessionContext, stage: str, strategy: str) -> _ClearState:
    state = _ClearState()
    bad = 0
    for data in ctx.records_for(stage):
        if data.get("strategy", strategy) != strategy:
            continue  # another strategy used this slot earlier; its records are not ours
        ids, text = data.get("cleared"), data.get("placeholder", CLEARED_PLACEHOLDER)
        if not isinstance(ids, list) or not isinstance(text, str):
            bad += 1
            continue
        anchor = data.get("anchor")
        for tid in ids:
            if isinstance(tid, str):
                state.cleared.setdefault(tid, text)
                if isinstance(anchor, str):
                    state.since.setdefault(anchor, []).append(tid)
            else:
                bad += 1
    if bad:
        # a damaged record must not fail the turn; those results are simply sent whole
        ctx.logger.warning("microcompact.bad_records", stage=stage, count=bad)
    return state


def _session_state(ctx: SessionContext, stage: str, strategy: str) -> _ClearState:
    state = ctx.stage_state.get(stage)
    if not isinstance(state, _ClearState):
        state = _restore(ctx, stage, strategy)
        ctx.stage_state[stage] = state
    return state


# --------------------------------------------------------------------------------------------
# Strategy "clear-oldest"
# --------------------------------------------------------------------------------------------


class Microcompact:
    """Stage (strategy ``"clear-oldest"``): clear old results of compactable tools locally.

    The content of an old tool_result of a compactable tool becomes
    ``[Old tool result content cleared]``; the newest ``keep`` compactable results stay whole.

    **When it fires**

    - *Idle gap* (``idle_minutes``, default 60): the last response is at least that old, so the
      server's prompt cache (1-hour TTL at most) is cold and the next request rewrites the whole
      prefix anyway — clearing costs nothing extra, so any gain is taken.
    - *Context size* (``trigger_tokens``, default 150,000): the estimated context
      (``token_tracker.estimate - tokens_freed`` of earlier stages) reaches the trigger. This
      breaks a warm cache, so it clears only if at least ``min_reclaim_tokens`` (default 20,000)
      can be freed, and then clears ALL eligible results at once: it does not fire again until
      another floor's worth of old results has accumulated. (Clearing one result per turn would
      rewrite the whole cached suffix every turn for a few hundred tokens — langchain#37815.)
      ``0`` disables a trigger; at least one must be on.

    **Defaults, for a demanding user**: the idle trigger is the reference behaviour and free.
    The size trigger sits just under a 200K-window autocompact threshold (about 167K): clearing
    stale tool output the model can fetch again is far cheaper and less lossy than a summary,
    and it happens rarely thanks to the floor. On 1M-context models raise ``trigger_tokens`` (or
    set 0) if you would rather keep everything until the window is really at stake.

    **What it never touches**: the newest turn (results after the last response's first
    fragment, whatever ``keep`` says), results of ``exclude_tools`` (always wins, also over
    earlier decisions), tools not in ``tools``, empty results, persisted-output previews and
    results already cleared. ``keep`` counts compactable results, newest first, the newest turn
    included — as the server-side ``keep`` does.

    ``incremental=False`` re-derives everything from the whole history on every pass (same
    results, the cost of a full rescan: a baseline for benchmarks).

    **Cache stability**: the set of cleared ids lives in ``ctx.stage_state`` and is re-applied
    byte for byte on every later pass; it is written with ``ctx.record`` when it grows and
    restored from ``ctx.records_for`` on first use in a session, so a resumed session sends the
    same bytes. ``ctx.report.tokens_freed`` grows only by what THIS pass cleared from content the
    last response's usage counted (anything after it is already in the estimate of the output).
    """

    name = "microcompact"
    strategy = "clear-oldest"
    may_break_cache = True
    implemented = True

    def __init__(
        self,
        *,
        keep: int = 5,
        idle_minutes: float = 60.0,
        trigger_tokens: int = 150_000,
        min_reclaim_tokens: int = 20_000,
        tools: tuple[str, ...] | str = DEFAULT_COMPACTABLE_TOOLS,
        exclude_tools: tuple[str, ...] | str = (),
        incremental: bool = True,
    ) -> None:
        self.keep = check_int("keep", keep)
        self.incremental = check_bool("incremental", incremental)
        self.idle_minutes = _check_minutes("idle_minutes", idle_minutes)
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens)
        self.min_reclaim_tokens = check_int("min_reclaim_tokens", min_reclaim_tokens)
        self.tools = _check_names("tools", tools, allow_empty=False)
        self.exclude_tools = _check_names("exclude_tools", exclude_tools, allow_empty=True)
        if self.idle_minutes == 0 and self.trigger_tokens == 0:
            raise ValueError(
                "idle_minutes and trigger_tokens are both 0: at least one trigger must be on"
            )
        self._exclude = frozenset(self.exclude_tools)
        self._tools = frozenset(self.tools) - self._exclude

    def __repr__(self) -> str:
        return (
            f"Microcompact(keep={self.keep}, idle_minutes={self.idle_minutes:g}, "
            f"trigger_tokens={self.trigger_tokens}, min_reclaim_tokens={self.min_reclaim_tokens}, "
            f"tools={self.tools!r}, exclude_tools={self.exclude_tools!r})"
        )

    def _now(self) -> datetime:
        """Wall-clock time, used only when no record after the last response has a timestamp."""
        return datetime.now(UTC)

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        state = _session_state(ctx, self.name, self.strategy)
        state.last, last = None, state.last  # a pass that fails midway leaves nothing to reuse
        grown = state.watch.advance(messages, reuse=self.incremental)
        start = state.watch.start
        response = _last_response(messages, start)
        turn_start = response[0] if response is not None else start - 1
        scans: list[_Scan] = []

        def scan() -> _Scan:  # the whole history, only when a pass needs it
            if not scans:
                names = state.watch.tool_names
                scans.append(_scan(messages, start, turn_start, names, self._tools))
            return scans[0]

        # 1. earlier decisions, byte for byte (never in the newest turn, never an excluded tool)
        held = self._reapply(messages, state, last, grown, turn_start, scan)
        current = held.out
        anchor = find_anchor(messages)
        anchor_id = messages[anchor[0]].uuid if anchor is not None else None
        again = state.since.get(anchor_id, ()) if anchor_id is not None else ()
        if again:  # cleared since the anchor's response: its usage still counts them
            known = scan().results
            refreed = sum(known[t].tokens_before_anchor for t in again if t in known)
            ctx.report.tokens_freed += refreed
        tokens_before = ctx.token_tracker.estimate(current) - ctx.report.tokens_freed

        # 2. the trigger
        last_time, now = _response_times(messages, response)
        gap = None if last_time is None else self._idle_gap_minutes(last_time, now)
        idle_fired = self.idle_minutes > 0 and gap is not None and gap >= self.idle_minutes
        size_fired = self.trigger_tokens > 0 and tokens_before >= self.trigger_tokens
        facts: dict[str, str | int | float | bool] = {"reapplied": held.held}
        out, fire = current, False
        if idle_fired or size_fired:
            # 3. what could be cleared now (the whole history is read only when a trigger fires)
            trigger = "idle_gap" if idle_fired else "context_size"
            found = scan()
            newest = found.newest_ids(self.keep)
            eligible = [
                r
                for r in found.results.values()
                if r.tool_use_id not in state.cleared
                and r.tool_use_id not in newest
                and not r.protected
                and r.reclaim > 0
            ]
            reclaimable = sum(r.reclaim for r in eligible)
            if not eligible:
                reason = Reason.NOTHING_ELIGIBLE
            elif idle_fired:  # the cache is cold: no prefix to protect, any gain is a gain
                reason, fire = Reason.CLEARED_IDLE_GAP, True
            elif reclaimable < self.min_reclaim_tokens:
                reason = Reason.BELOW_MIN_RECLAIM
            else:
                reason, fire = Reason.CLEARED_CONTEXT_SIZE, True
            freed = rewrite = 0
            if fire:
                # 4. clear everything eligible at once (batching), remember it, write it down
                new = {r.tool_use_id: CLEARED_PLACEHOLDER for r in eligible}
                state.cleared.update(new)
                if anchor_id is not None:
                    state.since.setdefault(anchor_id, []).extend(new)
                out = _apply(current, new)
                freed = sum(r.tokens_before_anchor for r in eligible)
                ctx.report.tokens_freed += freed
                first = min(pos for r in eligible for pos, _ in r.positions)
                rewrite = rough_tokens_for_messages(out[first:])
                await self._record(ctx, list(new), reason, anchor_id)
            facts.update(
                cleared=len(eligible) if fire else 0,
                kept=sum(1 for tid in found.results if tid not in state.cleared),
                eligible=len(eligible),
                reclaimable_tokens=reclaimable,
                freed_tokens=freed,
                cache_rewrite_tokens=rewrite,
            )
        else:
            trigger = "none"
            reason = Reason.BELOW_TRIGGER if self.trigger_tokens > 0 else Reason.CACHE_WARM
            facts.update(cleared=0, freed_tokens=0, cache_rewrite_tokens=0)
        facts["trigger"] = trigger
        tokens_after = ctx.token_tracker.estimate(out) - ctx.report.tokens_freed
        first_patch = held.first_patch
        if fire:
            first_patch = min(first_patch, _first_difference(out, messages))
        state.last = _LastPass(
            cleared=len(state.cleared),
            turn_start=max(turn_start, start),
            newest_cleared=held.newest_cleared,
            out=tuple(out) if first_patch < len(out) else (),
            first_patch=first_patch,
            held=held.held + (int(facts["cleared"]) if fire else 0),
            tools=self._tools,
        )

        decision = (
            Decision.CLEAR if fire else Decision.REAPPLY if facts["reapplied"] else Decision.SKIP
        )
        if gap is not None:
            facts["idle_gap_minutes"] = round(gap, 3)
        emit_decision(
            ctx.tracer,
            self.name,
            conversation_id=ctx.session_id,
            decision=decision,
            reason=reason,
            tokens_before=tokens_before,
            tokens_after=tokens_after,
            **facts,
        )
        ctx.report.notes[self.name] = {
            "strategy": self.strategy,
            "decision": decision,
            "reason": reason,
            **facts,
        }
        if fire:
            ctx.logger.info(
                "microcompact.cleared",
                reason=reason,
                cleared=facts["cleared"],
                freed_tokens=facts["freed_tokens"],
                cache_rewrite_tokens=facts["cache_rewrite_tokens"],
            )
        return out

    def _reapply(
        self,
        messages: list[Message],
        state: _ClearState,
        last: _LastPass | None,
        grown: int | None,
        turn_start: int,
        scan: Callable[[], _Scan],
    ) -> _Reapplied:
        """Earlier clears applied to ``messages``.

        When the history only grew by records that reach nothing older (``grown``), nothing was
        cleared since and no cleared id waited in the last newest turn, everything before that
        turn is sent as the last pass sent it: only the records from there on are redone.
        """
        n = len(messages)
        if not state.cleared:
            return _Reapplied(messages, n, 0, False)
        newest = _newest_turn_ids(messages, turn_start)
        newest_cleared = not newest.isdisjoint(state.cleared)
        if (
            grown is not None
            and last is not None
            and last.cleared == len(state.cleared)
            and last.tools == self._tools
            and not last.newest_cleared
        ):
            k = min(last.turn_start, grown)
            names = state.watch.tool_names
            region = messages[k:]
            texts = {
                tid: state.cleared[tid]
                for tid in _result_ids(region)
                if tid in state.cleared and tid not in newest and names.get(tid) in self._tools
            }
            redone = _apply(region, texts)
            held = last.held + len(texts)
            if last.first_patch >= k:
                if redone is region:
                    return _Reapplied(messages, n, held, newest_cleared)
                first = _first_difference(redone, region, k)
                return _Reapplied(messages[:k] + redone, first, held, newest_cleared)
            return _Reapplied([*last.out[:k], *redone], last.first_patch, held, newest_cleared)
        found = scan()
        texts = {
            tid: text
            for tid, text in state.cleared.items()
            if tid in found.results and tid not in found.newest_turn_ids
        }
        out = _apply(messages, texts)
        first = n if out is messages else _first_difference(out, messages)
        return _Reapplied(out, first, len(texts), newest_cleared)

    def _idle_gap_minutes(self, last_time: datetime, now: datetime | None) -> float:
        """Minutes since the last response (recorded at ``last_time``).

        "Now" is the newest timestamp recorded after that response (a replay then sees the gap
        the session really had), else the wall clock. A response without a timestamp counts
        as warm: never break a cache on a guess.
        """
        return max(0.0, ((now or self._now()) - last_time).total_seconds() / 60)

    async def _record(
        self, ctx: SessionContext, ids: list[str], reason: str, anchor: str | None
    ) -> None:
        data = {
            "strategy": self.strategy,
            "placeholder": CLEARED_PLACEHOLDER,
            "cleared": ids,
            "reason": reason,
            "anchor": anchor,
        }
        try:
            if ctx.transcript is None:
                ctx.record(self.name, data)
            else:  # an fsync'd append: keep it off the event loop
                await anyio.to_thread.run_sync(ctx.record, self.name, data)
        except OSError as exc:
            # the decision stands (it is in the state); only a resume would lose it
            ctx.logger.error("microcompact.record_write_failed", error=type(exc).__name__)


# --------------------------------------------------------------------------------------------
# Strategy "server-clear"
# --------------------------------------------------------------------------------------------


class ServerSideMicrocompact:
    """Stage (strategy ``"server-clear"``): let the API clear old tool results (context editing).

    Edits nothing locally. Each pass asks for Anthropic's ``clear_tool_uses_20250919`` edit in
    ``ctx.report.request_extras["context_management"]`` and adds the
    ``context-management-2025-06-27`` beta; the agent sends both with the request. When the
    request's input passes ``trigger_tokens``, the server replaces the oldest tool results
    (all tools but ``exclude_tools``; also their inputs if ``clear_tool_inputs``) with a
    placeholder, keeping the newest ``keep`` tool uses, and only if it can clear at least
    ``clear_at_least`` tokens (``0`` omits that floor).

    ``may_break_cache = False`` is a statement about THIS stage: the messages it returns are its
    input, byte for byte, so the local invariant "content once sent never changes" holds. The
    server may still invalidate its cached prefix when it clears; ``clear_at_least`` is the lever
    that keeps such breaks worth their cost. Defaults: the API's trigger (100,000 input tokens),
    the reference ``keep`` of 5 and the same 20,000-token floor as :class:`Microcompact`.
    """

    name = "microcompact"
    strategy = "server-clear"
    may_break_cache = False
    implemented = True

    def __init__(
        self,
        *,
        trigger_tokens: int = 100_000,
        keep: int = 5,
        clear_at_least: int = 20_000,
        exclude_tools: tuple[str, ...] | str = (),
        clear_tool_inputs: bool = False,
    ) -> None:
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens, minimum=1)
        self.keep = check_int("keep", keep)
        self.clear_at_least = check_int("clear_at_least", clear_at_least)
        self.exclude_tools = _check_names("exclude_tools", exclude_tools, allow_empty=True)
        self.clear_tool_inputs = check_bool("clear_tool_inputs", clear_tool_inputs)

    def __repr__(self) -> str:
        return (
            f"ServerSideMicrocompact(trigger_tokens={self.trigger_tokens}, keep={self.keep}, "
            f"clear_at_least={self.clear_at_least}, exclude_tools={self.exclude_tools!r}, "
            f"clear_tool_inputs={self.clear_tool_inputs})"
        )

    def edit(self) -> dict[str, Any]:
        """The ``clear_tool_uses_20250919`` edit (``BetaClearToolUses20250919EditParam``).

        ``clear_at_least`` is left out when 0 and ``exclude_tools`` when empty, so the API's own
        defaults apply rather than an explicit "none"."""
        edit: dict[str, Any] = {
            "type": CLEAR_TOOL_USES_EDIT,
            "trigger": {"type": "input_tokens", "value": self.trigger_tokens},
            "keep": {"type": "tool_uses", "value": self.keep},
        }
        if self.clear_at_least:
            edit["clear_at_least"] = {"type": "input_tokens", "value": self.clear_at_least}
        if self.exclude_tools:
            edit["exclude_tools"] = list(self.exclude_tools)
        edit["clear_tool_inputs"] = self.clear_tool_inputs
        return edit

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        report = ctx.report
        existing = report.request_extras.get("context_management")
        config: dict[str, Any] = dict(existing) if isinstance(existing, Mapping) else {}
        earlier = config.get("edits")
        # keep edits another stage asked for; ours replaces an earlier edit of the same type
        edits = [
            e
            for e in (earlier if isinstance(earlier, list) else [])
            if not (isinstance(e, Mapping) and e.get("type") == CLEAR_TOOL_USES_EDIT)
        ]
        config["edits"] = [*edits, self.edit()]
        report.request_extras["context_management"] = config
        if CONTEXT_MANAGEMENT_BETA not in report.betas:
            report.betas.append(CONTEXT_MANAGEMENT_BETA)

        tokens = ctx.token_tracker.estimate(messages) - report.tokens_freed
        results = sum(
            1
            for m in messages
            if m.type == "user" and isinstance(m.content, list)
            for b in m.content
            if isinstance(b, Mapping) and b.get("type") == "tool_result"
        )
        facts: dict[str, str | int | float | bool] = {
            "cleared": 0,
            "kept": results,
            "trigger_tokens": self.trigger_tokens,
            "keep": self.keep,
            "clear_at_least": self.clear_at_least,
            "estimated_over_trigger": tokens >= self.trigger_tokens,
        }
        emit_decision(
            ctx.tracer,
            self.name,
            conversation_id=ctx.session_id,
            decision=Decision.DELEGATE,
            reason=Reason.DELEGATED,
            tokens_before=tokens,
            tokens_after=tokens,
            **facts,
        )
        report.notes[self.name] = {
            "strategy": self.strategy,
            "decision": Decision.DELEGATE,
            "reason": Reason.DELEGATED,
            **facts,
        }
        return messages
