"""The per-session state of ``Microcompact`` (what it cleared, and what it keeps to extend
its last pass instead of redoing it) and one pass's view of the history."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.incremental import AppendWatch
from pipeline.messages import Message
from stages._clear_index import ClearIndex, ClearView
from stages._clearable import ClearableScan, Gains, HistoryAt, scan_clearable
from stages._shared import CLEARED_PLACEHOLDER

__all__ = ["ClearPass", "ClearState", "LastPass", "Reapplied"]


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
    """What it sent, when that differs from its input: the list the stage returned, brought up
    to date in place by its next pass (its receivers only read it: see
    :class:`pipeline.core.Stage`)."""
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
    """The previous pass's re-application, while it can be extended."""
    gains: Gains = field(default_factory=dict)
    """The rough tokens of each tool_result block priced so far, by block identity (what
    clearing it would free: :func:`block_gain`)."""
    index: ClearIndex = field(default_factory=ClearIndex)
    """The compactable results of the settled part of the history (see :class:`ClearIndex`)."""
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

    def edited_from(
        self, last: LastPass | None, messages: list[Message], turn_start: int
    ) -> int | None:
        """For an input that changed from some position on without starting over (a client
        moving its ``cache_control`` mark changes its last message on every call): the lowest
        record sharing a tool_use_id or response id with what changed
        (:meth:`~pipeline.incremental.AppendWatch.reach`), when that lies in the last pass's
        newest turn or after (what it held cleared lies before), the newest turn
        (``turn_start``) starts no earlier than the last pass's (an edit can take a response
        away: a growth cannot) and the index folded in nothing from there on. The pass then
        goes on as for a history that grew from there; None otherwise."""
        watch = self.watch
        if watch.edit is None or last is None:
            return None
        first, replaced = watch.edit
        reach = watch.reach(messages, first, replaced)
        index = self.index
        if last.turn_start <= min(reach, turn_start) and index.valid and reach >= index.settled:
            return reach
        return None


@dataclass(slots=True)
class ClearPass(HistoryAt):
    """One pass over one history (where things are, :class:`HistoryAt`), and the compactable
    results if read."""

    response: tuple[int, int] | None
    state: ClearState
    incremental: bool
    _scan: ClearableScan | ClearView | None = None

    def scan(self) -> ClearableScan | ClearView:
        """The compactable results of the whole history (read only when a pass needs it)."""
        if self._scan is None:
            self._scan = self._read()
        return self._scan

    def _read(self) -> ClearableScan | ClearView:
        state = self.state
        if not self.incremental:
            return scan_clearable(
                self.messages, self.start, self.turn_start, self.names, self.tools, state.gains
            )
        return state.index.view(self, state.cleared, state.gains)
