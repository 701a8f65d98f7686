"""The clearable results of a growing history, kept across passes.

A microcompact pass that fires needs every compactable result of the history (which to keep,
which to clear, how much each frees). Most of that history is *settled*: records before the
newest turn and before the usage anchor. There nothing the scan derives can change while the
history only grows -- no record is in the newest turn, every one counts against the anchor --
so :class:`ClearIndex` folds settled records in once and keeps the totals; a pass then scans
only the unsettled tail and merges (:class:`ClearView`). Passes that do not clear fold in what
settled since (a few records), so the pass that clears does not pay for the turns before it;
the index also keeps each settled record's rough tokens, what a clear counts as the prompt
cache it rewrites. Any other change (an edit, a compact boundary, a resumed session)
invalidates the index, and the next scan folds the history in afresh.
:func:`~stages._clearable.scan_clearable` over the whole history stays the reference: a view
answers every question exactly as that scan would.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from pipeline.messages import Message
from pipeline.tokens import find_anchor
from stages._clearable import (
    ClearableResult,
    ClearableScan,
    Gains,
    HistoryAt,
    block_gain,
    is_protected_content,
    rough_tokens_priced,
    scan_clearable,
)
from stages._shared import tool_results

__all__ = ["ClearIndex", "ClearView"]


class ClearIndex:
    """The compactable results of the settled records ``[start, settled)`` of one session."""

    def __init__(self) -> None:
        self.reset(0, frozenset())
        self.valid = False

    def reset(self, start: int, tools: frozenset[str]) -> None:
        """Forget everything; fold in from ``start`` next, for the compactable ``tools``."""
        self.valid = True
        """Whether the records folded in are still the history's (unset on any change but
        growth)."""
        self.start = start
        self.settled = start
        """Records before this index (from ``start``) are folded in."""
        self.tools = tools
        self.count = 0
        """tool_results with a string id folded in: the position the next one gets is + 1."""
        self.results: dict[str, ClearableResult] = {}
        """Settled totals by id, in order of first occurrence."""
        self.by_last: dict[str, None] = {}
        """The same ids, ordered by their latest occurrence."""
        self.pending: dict[str, None] = {}
        """Ids that may be eligible: unprotected, something to reclaim, not cleared."""
        self.cleared_count = 0
        """How many ids in ``results`` are cleared."""
        self.tokens = array("q")
        """The rough tokens of each settled record, -1 where not counted (see
        :meth:`rough_tokens_after`)."""

    def settle(
        self,
        messages: Sequence[Message],
        upto: int,
        names: Mapping[str, str],
        cleared: Mapping[str, str],
        gains: Gains,
        *,
        price: bool = True,
    ) -> None:
        """Fold in the records from ``settled`` to ``upto`` (all before the newest turn and
        before the usage anchor). ``price``: count each record's rough tokens now (a few new
        records); else they are counted when asked for (a whole history folded in afresh)."""
        results, by_last, pending, tools = self.results, self.by_last, self.pending, self.tools
        self.valid = False  # until the fold completes: a failure midway leaves nothing to trust
        for i in range(self.settled, upto):
            # counted while ``gains`` still holds its results' prices, which the index then
            # keeps as gains (a settled block is not scanned again: its price is let go)
            tokens = _rough_or_unknown(messages[i], gains) if price else -1
            for _, b in tool_results(messages[i]):
                tid = b.get("tool_use_id")
                if not isinstance(tid, str):
                    continue
                self.count += 1
                if names.get(tid) not in tools:
                    continue
                r = results.get(tid)
                if r is None:
                    r = results[tid] = ClearableResult(tid, first_position=self.count)
                    self.cleared_count += tid in cleared
                r.positions += (i,)
                r.last_position = self.count
                by_last.pop(tid, None)
                by_last[tid] = None
                if is_protected_content(b.get("content")):
                    r.protected = True
                    pending.pop(tid, None)
                    continue
                gain = block_gain(b, gains, keep=False)
                r.reclaim += gain
                r.tokens_before_anchor += gain
                if not r.protected and r.reclaim > 0 and tid not in cleared:
                    pending[tid] = None
            self.tokens.append(tokens)
        self.settled = max(self.settled, upto)
        self.valid = True

    def fold(
        self, at: HistoryAt, cleared: Mapping[str, str], gains: Gains, *, afresh: bool = True
    ) -> bool:
        """Fold in what has settled in the history ``at`` since the last fold (the arguments
        of :meth:`view`).

        A pass that does not clear folds in its few newly settled records (``afresh=False``),
        so the pass that clears finds nearly all of them folded in already; it never folds in
        the whole history (after an edit), which is left to a pass that reads it, and never
        raises for content it cannot measure. Returns whether the index is now up to date."""
        start = at.start
        anchor = find_anchor(at.messages)
        settled = max(start, min(at.turn_start + 1, anchor[0] if anchor is not None else start))
        price = True
        stale = not self.valid or self.start != start or self.tools != at.tools
        if stale or settled < self.settled:
            if not afresh:
                return False
            self.reset(start, at.tools)
            price = False
        try:
            self.settle(at.messages, settled, at.names, cleared, gains, price=price)
        except ValueError:  # a result that cannot be measured (its content refers to itself)
            if afresh:
                raise
            return False  # left unset: a pass that reads the history says so, as before
        return True

    def rough_tokens_after(
        self, out: Sequence[Message], messages: Sequence[Message], first: int, gains: Gains
    ) -> int:
        """``rough_tokens_for_messages(out[first:])`` for an output of ``messages`` (the input
        this index is up to date with): a settled record the output still holds is not priced
        again."""
        start, settled, tokens = self.start, self.settled, self.tokens
        total = 0
        for i in range(first, min(len(out), len(messages), settled)):
            m = out[i]
            known = tokens[i - start] if i >= start and m is messages[i] else -1
            total += known if known >= 0 else rough_tokens_priced((m,), gains)
        rest = max(first, min(len(out), settled))
        return total + rough_tokens_priced(out[rest:], gains)

    def view(self, at: HistoryAt, cleared: Mapping[str, str], gains: Gains) -> ClearView:
        """The compactable results of the history ``at`` (as
        :func:`~stages._clearable.scan_clearable` finds them; ``cleared``: the session's
        cleared ids).

        Folds in what has settled since the last view and scans the rest. Only valid while the
        history has only grown since the index was last reset (the caller unsets ``valid``
        otherwise)."""
        self.fold(at, cleared, gains)
        tail = scan_clearable(
            at.messages, self.settled, at.turn_start, at.names, at.tools, gains, self.count
        )
        return ClearView(self, tail)

    def note_cleared(self, ids: Iterable[str]) -> None:
        """Ids just added to the session's cleared map (none of them was there before)."""
        for tid in ids:
            self.pending.pop(tid, None)
            self.cleared_count += tid in self.results


def _rough_or_unknown(m: Message, gains: Gains) -> int:
    """A settled record's rough tokens, or -1 for one that cannot be measured (a tool input
    that refers to itself): only a clear that counts it needs it, and fails there as before."""
    try:
        return rough_tokens_priced((m,), gains)
    except ValueError:
        return -1


class ClearView:
    """A history's compactable results: the settled ones of an index merged with a scan of
    the rest. Answers as :class:`~stages._clearable.ClearableScan` over the whole history."""

    def __init__(self, index: ClearIndex, tail: ClearableScan) -> None:
        self.index = index
        self.tail = tail
        self.newest_turn_ids = tail.newest_turn_ids

    def __contains__(self, tid: object) -> bool:
        return tid in self.index.results or tid in self.tail.results

    def get(self, tid: str) -> ClearableResult | None:
        """Every occurrence of ``tid``, settled and not."""
        settled, late = self.index.results.get(tid), self.tail.results.get(tid)
        if settled is None or late is None:
            return settled or late
        return replace(
            settled,
            positions=settled.positions + late.positions,
            last_position=late.last_position,
            protected=settled.protected or late.protected,
            tokens_before_anchor=settled.tokens_before_anchor + late.tokens_before_anchor,
            reclaim=settled.reclaim + late.reclaim,
        )

    def newest_ids(self, keep: int) -> set[str]:
        """The ``keep`` most recent compactable results, by their latest occurrence."""
        newest = self.tail.newest_ids(keep)  # the tail's occurrences are the latest ones
        for tid in reversed(self.index.by_last):
            if len(newest) >= keep:
                break
            newest.add(tid)  # an id also in the tail is in already (the tail had < keep)
        return newest

    def candidates(self, cleared: Mapping[str, str]) -> list[ClearableResult]:
        """Every result not cleared that may be eligible (the rest are protected or free
        nothing), in order of first occurrence."""
        index, late = self.index, self.tail.results
        settled = index.results
        ids = {tid for tid in index.pending if tid not in cleared}
        ids.update(tid for tid in late if tid in settled and tid not in cleared)
        out = [r for tid in ids if (r := self.get(tid)) is not None]
        out.sort(key=lambda r: r.first_position)
        out.extend(r for tid, r in late.items() if tid not in settled and tid not in cleared)
        return out

    def kept(self, cleared: Mapping[str, str]) -> int:
        """How many results are not cleared."""
        index, settled = self.index, self.index.results
        late = sum(1 for tid in self.tail.results if tid not in settled and tid not in cleared)
        return len(settled) - index.cleared_count + late
