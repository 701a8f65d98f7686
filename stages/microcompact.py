"""The ``microcompact`` stage: clears old tool_result content of compactable tools.

Two strategies fill the slot; both are named ``microcompact`` so either can replace the other::

    Microcompact()            # strategy "clear-oldest" (here): clears locally, by tool_use_id
    ServerSideMicrocompact()  # strategy "server-clear" (server_microcompact.py): the API clears

Every pass emits exactly one decision span, ``microcompact.<decision>`` (``microcompact.clear``,
``microcompact.skip``...; no content, ever):

=========  ======================  ===========================================================
decision   reason                  meaning
=========  ======================  ===========================================================
clear      ``idle_gap``            the cache is cold (idle gap ≥ ``idle_minutes``): cleared now
clear      ``over_trigger``        context ≥ ``trigger_tokens`` and ≥ ``min_reclaim_tokens``
                                   reclaimable: cleared now
reapply    any "not now" reason    nothing new cleared; earlier clears re-applied verbatim
skip       ``cache_warm``          only the idle trigger is on and the last response is recent
skip       ``below_trigger``       no trigger fired (context below ``trigger_tokens``; and, if
                                   the idle trigger is on, the cache is still warm)
skip       ``below_min_reclaim``   the size trigger fired but clearing would free too little to
                                   be worth rewriting the cached prefix
skip       ``nothing_eligible``    a trigger fired but no result is old enough / clearable
=========  ======================  ===========================================================

Its attributes (:class:`pipeline.tracing.ATTR`): ``cleared`` (ids newly cleared), ``kept``
(compactable results left whole), ``reapplied``, ``eligible``, ``reclaimable_tokens``,
``tokens.freed``, ``cache_rewrite_tokens`` (estimated tokens from the first newly cleared result
to the end: the part of the prompt whose cache this pass invalidates), ``trigger`` and
``idle_gap_minutes``; ``ctx.report.decisions["microcompact"]`` holds the same, so a replay can
tell a real cache break (``cleared > 0``) from a byte-identical re-application.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from pipeline import Message, SessionContext
from pipeline.kept_list import KeptList, first_difference
from pipeline.tracing import ATTR, AttributeValue, Decision, Reason
from stages._clear_state import ClearPass, ClearState, LastPass, Reapplied
from stages._clearable import (
    ClearableResult,
    clears,
    newest_turn_ids,
    response_times,
    rough_tokens_priced,
)
from stages._shared import (
    CLEARED_PLACEHOLDER,
    anchor_uuid,
    last_response,
    patch_results,
    record_decision,
    replace_results,
    result_ids,
    session_state,
)
from stages._shared.args import check_bool, check_int, check_minutes, check_names

__all__ = ["DEFAULT_COMPACTABLE_TOOLS", "Microcompact"]

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


def _first_difference(a: Sequence[Message], b: Sequence[Message], offset: int = 0) -> int:
    """``offset`` + the first index where ``a`` and ``b`` hold different objects, else + len."""
    first = first_difference(a, b)
    return offset + (len(a) if first is None else first)


class Microcompact:
    """Stage (strategy ``"clear-oldest"``): clear old results of compactable tools locally.

    The content of an old tool_result of a compactable tool becomes
    ``[Old tool result content cleared]``; the newest ``keep`` compactable results stay whole.

    **When it fires**

    - *Idle gap* (``idle_minutes``, default 60): the last response is at least that old, so the
      server's prompt cache (1-hour TTL at most) is cold and the next request rewrites the whole
      prefix anyway — clearing costs nothing extra, so any gain is taken.
    - *Context size* (``trigger_tokens``, default 150,000): the estimated context (after what
      earlier stages freed) reaches the trigger. This breaks a warm cache, so it clears only if
      at least ``min_reclaim_tokens`` (default 20,000) can be freed, and then clears ALL
      eligible results at once: it does not fire again until another floor's worth of old
      results has accumulated (clearing one result per turn would rewrite the whole cached
      suffix every turn for a few hundred tokens). ``0`` disables a trigger; at least one must
      be on.

    **Defaults, for a demanding user**: the idle trigger is free. The size trigger sits just
    under a 200K-window autocompact threshold (about 167K): clearing stale tool output the model
    can fetch again is far cheaper and less lossy than a summary, and it happens rarely thanks
    to the floor. On 1M-context models raise ``trigger_tokens`` (or set 0) if you would rather
    keep everything until the window is really at stake.

    **What it never touches**: the newest turn (results after the last response's first
    fragment, whatever ``keep`` says), results of ``exclude_tools`` (always wins, also over
    earlier decisions), tools not in ``tools``, empty results, persisted-output previews and
    results already cleared. ``keep`` counts compactable results, newest first, the newest turn
    included — as the server-side ``keep`` does.

    ``clock``: where "now" comes from when nothing after the last response says (default: the
    wall clock). ``incremental=False`` re-derives everything from the whole history on every
    pass (same results, the cost of a full rescan: a baseline for benchmarks).

    **Cache stability**: the cleared ids live in ``ctx.stage_state`` and are re-applied byte for
    byte on every later pass; they are recorded when they grow and restored from the records on
    first use in a session, so a resumed session sends the same bytes. ``tokens_freed`` grows
    only by what THIS pass cleared from content the last response's usage counted (anything
    after it is already in the estimate of the output).
    """

    name = "microcompact"
    strategy = "clear-oldest"
    may_break_cache = True
    readonly_input = True

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
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.keep = check_int("keep", keep)
        self.incremental = check_bool("incremental", incremental)
        self.idle_minutes = check_minutes("idle_minutes", idle_minutes)
        self.trigger_tokens = check_int("trigger_tokens", trigger_tokens)
        self.min_reclaim_tokens = check_int("min_reclaim_tokens", min_reclaim_tokens)
        self.tools = check_names("tools", tools, allow_empty=False)
        self.exclude_tools = check_names("exclude_tools", exclude_tools, allow_empty=True)
        if self.idle_minutes == 0 and self.trigger_tokens == 0:
            raise ValueError(
                "idle_minutes and trigger_tokens are both 0: at least one trigger must be on"
            )
        self._tools = frozenset(self.tools) - frozenset(self.exclude_tools)
        self.clock = clock or (lambda: datetime.now(UTC))
        """Wall-clock time, read only when no record after the last response has a timestamp
        (tests pass a fixed one)."""

    @property
    def rereads_outputs(self) -> bool:
        """Whether a later pass may read again a tool output (or another long text) it has met
        (:func:`~pipeline.core.rereading_stages`): only when it rescans every pass
        (``incremental=False``); an output it cleared is re-applied from its own state (a result
        with a harness tail is never let go: the tail is read again)."""
        return not self.incremental

    def __repr__(self) -> str:
        return (
            f"Microcompact(keep={self.keep}, idle_minutes={self.idle_minutes:g}, "
            f"trigger_tokens={self.trigger_tokens}, min_reclaim_tokens={self.min_reclaim_tokens}, "
            f"tools={self.tools!r}, exclude_tools={self.exclude_tools!r})"
        )

    def _state(self, ctx: SessionContext) -> ClearState:
        state = session_state(
            ctx, self.name, ClearState, lambda records: ClearState.restore(records, self.strategy)
        )
        if state.bad_records:
            ctx.logger.warning("microcompact.bad_records", stage=self.name, count=state.bad_records)
            state.bad_records = 0
        return state

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        state = self._state(ctx)
        if not state.cleared and self._quiet(messages, ctx, state):
            return messages
        state.last, last = None, state.last  # a pass that fails midway leaves nothing to reuse
        grown = state.watch.advance(messages, reuse=self.incremental)
        start = state.watch.start
        response = last_response(messages, start)
        turn_start = response[0] if response is not None else start - 1
        if grown is None:
            grown = state.edited_from(last, messages, turn_start)
        if grown is None:
            state.index.valid = False  # anything but growth: fold the history in afresh
        names = state.watch.tool_names
        p = ClearPass(
            messages, start, turn_start, names, self._tools, response, state, self.incremental
        )

        # earlier decisions, byte for byte (never in the newest turn, never an excluded tool)
        held = self._reapply(p, state, last, grown)
        anchor_id = anchor_uuid(messages)
        self._free_again(ctx, p, state, anchor_id)
        tokens_before = ctx.size_of(held.out)

        gap = self._idle_gap(p.messages, p.response)
        idle_fired = self.idle_minutes > 0 and gap is not None and gap >= self.idle_minutes
        size_fired = self.trigger_tokens > 0 and tokens_before >= self.trigger_tokens
        facts: dict[str, AttributeValue] = {ATTR.STRATEGY: self.strategy, ATTR.REAPPLIED: held.held}
        out, cleared = held.out, 0
        if idle_fired or size_fired:
            facts[ATTR.TRIGGER] = "idle_gap" if idle_fired else "context_size"
            reason, eligible = self._choose(p, state, idle_fired, facts)
            if eligible:
                out, changed = await self._clear(
                    ctx, p, state, held.out, eligible, reason, anchor_id, facts
                )
                cleared = len(eligible)
        else:
            if self.incremental:  # the pass that clears then finds the history folded in
                state.index.fold(p, state.cleared, state.gains, afresh=False)
            reason = self._not_now(facts)
        first_patch = held.first_patch
        if cleared:
            first_patch = min(first_patch, changed)
        state.last = LastPass(
            cleared=len(state.cleared),
            turn_start=max(turn_start, start),
            newest_cleared=held.newest_cleared,
            out=out if first_patch < len(out) else [],  # its own list: extended in place next
            first_patch=first_patch,
            held=held.held + cleared,
            tools=self._tools,
        )
        decision = Decision.CLEAR if cleared else Decision.REAPPLY if held.held else Decision.SKIP
        self._tell(ctx, decision, reason, tokens_before, out, gap, facts)
        return out

    def _not_now(self, facts: dict[str, AttributeValue]) -> Reason:
        """No trigger fired: the facts of a pass that clears nothing now, and why not."""
        facts[ATTR.TRIGGER] = "none"
        facts.update({ATTR.CLEARED: 0, ATTR.TOKENS_FREED: 0, ATTR.CACHE_REWRITE_TOKENS: 0})
        return Reason.BELOW_TRIGGER if self.trigger_tokens > 0 else Reason.CACHE_WARM

    def _tell(
        self,
        ctx: SessionContext,
        decision: Decision,
        reason: Reason,
        tokens_before: int,
        out: list[Message],
        gap: float | None,
        facts: dict[str, AttributeValue],
    ) -> None:
        if gap is not None:
            facts[ATTR.IDLE_GAP_MINUTES] = round(gap, 3)
        ctx.decide(
            self.name,
            decision,
            reason,
            tokens_before=tokens_before,
            tokens_after=ctx.size_of(out),
            facts=facts,
        )

    def _free_again(
        self, ctx: SessionContext, p: ClearPass, state: ClearState, anchor_id: str | None
    ) -> None:
        """Results cleared since the anchor's response (a retried call): its usage still counts
        them, so they are freed against it again."""
        again = state.since.get(anchor_id, ()) if anchor_id is not None else ()
        if again:
            known = p.scan()
            ctx.report.tokens_freed += sum(
                r.tokens_before_anchor for t in again if (r := known.get(t)) is not None
            )

    def _quiet(self, messages: list[Message], ctx: SessionContext, state: ClearState) -> bool:
        """A pass of a session that has cleared nothing yet, when no trigger fires: told as
        the full pass tells it, the input sent as it came, and no view of the history kept for
        it (a pass that clears later catches up from where its view was, or builds it afresh:
        the same output as if it had followed every pass). False when a trigger may fire."""
        tokens = ctx.size_of(messages)
        if self.trigger_tokens > 0 and tokens >= self.trigger_tokens:
            return False
        response = last_response(messages)
        if response is not None and any(m.restarts_thread for m in messages[response[1] :]):
            return False  # the live thread starts after it: the full pass reads where
        gap = self._idle_gap(messages, response)
        if self.idle_minutes > 0 and gap is not None and gap >= self.idle_minutes:
            return False
        state.last = None  # nothing to extend: the view it was made on is left behind
        facts: dict[str, AttributeValue] = {ATTR.STRATEGY: self.strategy, ATTR.REAPPLIED: 0}
        reason = self._not_now(facts)
        self._tell(ctx, Decision.SKIP, reason, tokens, messages, gap, facts)
        return True

    def _idle_gap(
        self, messages: Sequence[Message], response: tuple[int, int] | None
    ) -> float | None:
        """Minutes since the last response, or None when that response has no timestamp.

        "Now" is the newest timestamp recorded after that response (a replay then sees the gap
        the session really had), else the wall clock. A response without a timestamp counts as
        warm: never break a cache on a guess.
        """
        last_time, now = response_times(messages, response)
        if last_time is None:
            return None
        return max(0.0, ((now or self.clock()) - last_time).total_seconds() / 60)

    def _choose(
        self, p: ClearPass, state: ClearState, idle_fired: bool, facts: dict[str, AttributeValue]
    ) -> tuple[Reason, list[ClearableResult]]:
        """What to clear now (all of it, or nothing), and why. Reads the whole history."""
        found = p.scan()
        newest = found.newest_ids(self.keep)
        live = state.watch.live  # before a server compaction block: not read, not freed
        eligible = [
            r
            for r in found.candidates(state.cleared)
            if r.tool_use_id not in newest
            and not r.protected
            and r.reclaim > 0
            and all(at >= live for at in r.positions)
        ]
        reclaimable = sum(r.reclaim for r in eligible)
        facts[ATTR.KEPT] = found.kept(state.cleared)
        facts[ATTR.ELIGIBLE] = len(eligible)
        facts[ATTR.RECLAIMABLE_TOKENS] = reclaimable
        facts.update({ATTR.CLEARED: 0, ATTR.TOKENS_FREED: 0, ATTR.CACHE_REWRITE_TOKENS: 0})
        if not eligible:
            return Reason.NOTHING_ELIGIBLE, []
        if idle_fired:  # the cache is cold: no prefix to protect, any gain is a gain
            return Reason.IDLE_GAP, eligible
        if reclaimable < self.min_reclaim_tokens:
            return Reason.BELOW_MIN_RECLAIM, []
        return Reason.OVER_TRIGGER, eligible

    async def _clear(
        self,
        ctx: SessionContext,
        p: ClearPass,
        state: ClearState,
        current: list[Message],
        eligible: list[ClearableResult],
        reason: Reason,
        anchor_id: str | None,
        facts: dict[str, AttributeValue],
    ) -> tuple[list[Message], int]:
        """Clear everything eligible at once (batching), remember it, write it down. Returns
        the output and the first position where it differs from ``current``."""
        new = {r.tool_use_id: CLEARED_PLACEHOLDER for r in eligible}
        state.cleared.update(new)
        state.index.note_cleared(new)
        if anchor_id is not None:
            state.since.setdefault(anchor_id, []).extend(new)
        at = sorted({i for r in eligible for i in r.positions})
        if current is not p.messages:  # its own list, kept from the last pass: patched in place
            out, changed = current, patch_results(current, clears(new), at)
        else:
            out = replace_results(current, clears(new), at)
            changed = next((i for i in at if out[i] is not current[i]), len(out))
        freed = sum(r.tokens_before_anchor for r in eligible)
        ctx.report.tokens_freed += freed
        first = at[0]
        facts[ATTR.KEPT] = p.scan().kept(state.cleared)
        facts[ATTR.CLEARED] = len(eligible)
        facts[ATTR.TOKENS_FREED] = freed
        facts[ATTR.CACHE_REWRITE_TOKENS] = (
            state.index.rough_tokens_after(out, p.messages, first, state.gains)
            if self.incremental  # the scan just brought the index up to date
            else rough_tokens_priced(out[first:], state.gains)
        )
        data = {
            "strategy": self.strategy,
            "placeholder": CLEARED_PLACEHOLDER,
            "cleared": list(new),
            "reason": str(reason),
            "anchor": anchor_id,
        }
        await record_decision(ctx, self.name, data)
        ctx.logger.info(
            "microcompact.cleared",
            reason=reason,
            cleared=len(eligible),
            tokens_freed=freed,
            cache_rewrite_tokens=facts[ATTR.CACHE_REWRITE_TOKENS],
        )
        return out, changed

    def _reapply(
        self, p: ClearPass, state: ClearState, last: LastPass | None, grown: int | None
    ) -> Reapplied:
        """Earlier clears applied to the history.

        When the history only grew by records that reach nothing older (``grown``), nothing was
        cleared since and no cleared id waited in the last newest turn, everything before that
        turn is sent as the last pass sent it: only the records from there on are redone.
        """
        messages = p.messages
        n = len(messages)
        if not state.cleared:
            return Reapplied(messages, n, 0, False)
        newest = newest_turn_ids(messages, p.turn_start)
        newest_cleared = not state.cleared.keys().isdisjoint(newest)  # iterates the smaller
        if (
            grown is not None
            and last is not None
            and last.cleared == len(state.cleared)
            and last.tools == self._tools
            and not last.newest_cleared
        ):
            k = min(last.turn_start, grown)
            region = messages[k:]
            texts = {
                tid: state.cleared[tid]
                for tid in result_ids(region)
                if tid in state.cleared and tid not in newest and p.names.get(tid) in self._tools
            }
            redone = replace_results(region, clears(texts))
            held = last.held + len(texts)
            if last.first_patch >= k:
                if redone is region:
                    return Reapplied(messages, n, held, newest_cleared)
                first = _first_difference(redone, region, k)
                kept: list[Message] = KeptList(messages[:k])  # its readers ask what changed
                kept += redone
                return Reapplied(kept, first, held, newest_cleared)
            out = last.out  # the last output, brought up to date in place (a copy costs O(n))
            del out[k:]
            out += redone
            return Reapplied(out, last.first_patch, held, newest_cleared)
        found = p.scan()
        texts = {
            tid: text
            for tid, text in state.cleared.items()
            if tid in found and tid not in found.newest_turn_ids
        }
        # only what the API sees (from the thread start), as a clear pass patches
        out = replace_results(messages, clears(texts), range(p.start, n))
        first = n if out is messages else _first_difference(out, messages)
        return Reapplied(out, first, len(texts), newest_cleared)
