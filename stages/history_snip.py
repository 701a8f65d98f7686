"""The ``history_snip`` stage: removes middle rounds of history by message uuid.

Strategy ``snip-middle``. When the estimate reaches ``trigger_fraction`` of ``context_window``,
whole API rounds go, oldest first, until it is down to ``target_fraction``. A round is one
response (all fragments of its id) and everything up to the next: its tool_results, progress and
system records, a new prompt; cuts are made only where no response and no tool pair straddles
them. Kept: the first user message, the round holding the latest prompt, the anchor's round and
the last ``keep_recent_rounds``. Each removed run becomes one user text (:func:`snip_marker_text`):
the model learns history is missing, and the wire alternates whatever borders the run; its text
and uuid depend only on the run. Removals are cumulative, re-applied on every pass, and recorded
(``{"removed": [new uuids], "anchor": ...}``) so a resumed session restores them. A record
that is malformed, or that names a record snip keeps (a damaged or edited transcript), is
ignored with a warning (``stage_record.ignored``).

Decision span per pass (``history_snip.<decision>``), the decision ``skip`` or ``reapply`` with
``below_trigger`` or ``nothing_eligible``; ``snip`` with ``over_trigger``.
"""

from __future__ import annotations

import uuid as _uuid
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline import Message, SessionContext
from pipeline.kept_list import KeptList
from pipeline.messages import stable_uuid, thread_start
from pipeline.tracing import ATTR, Decision, Reason
from stages._shared import (
    DEFAULT_CONTEXT_WINDOW,
    ProjectionPass,
    ProjectionState,
    RoundView,
    record_decision,
)
from stages._shared.args import check_below, check_bool, check_fraction, check_int
from stages._shared.records import RoundRecord, restore_round_records

__all__ = ["HistorySnip", "snip_marker_text"]

_MARKER_NAMESPACE = _uuid.UUID("5f0c8f2e-3b7a-4c59-9a57-68e1b2d4c701")


def snip_marker_text(removed_messages: int) -> str:
    """The user text that stands in for a run of removed messages."""
    return (
        f"[History snipped: {removed_messages} earlier messages were removed here to free context.]"
    )


def _marker(removed_messages: int, first_uuid: str) -> Message:
    uid = stable_uuid(_MARKER_NAMESPACE, "history_snip:" + first_uuid)
    return Message.user(snip_marker_text(removed_messages), uuid=uid, is_meta=True)


@dataclass(slots=True)
class _SnipState(ProjectionState[Collection[str]]):
    removed: dict[str, str | None] = field(default_factory=dict)
    """Removed uuid -> uuid of the usage anchor when it was removed (insertion ordered)."""
    by_anchor: dict[str, list[str]] = field(default_factory=dict)
    """Usage-anchor uuid -> the uuids removed while it was the anchor (a lookup per pass)."""

    def decided(self) -> Collection[str]:
        """Every record removed so far."""
        return self.removed.keys()

    def decided_count(self) -> int:
        """How many."""
        return len(self.removed)

    def counted(self, anchor: str | None) -> Collection[str] | None:
        """The removals the anchor's request lacked: those made before its response (later
        ones, from a retried pass or a crash before the call, are freed again against it)."""
        since = set(self.by_anchor.get(anchor, ())) if anchor is not None else set()
        return self.removed.keys() - since if since else None

    def remove(self, uids: Iterable[str], anchor: str | None) -> None:
        """Record removals made while ``anchor`` was the usage anchor (a uuid keeps its first)."""
        for uid in uids:
            if uid not in self.removed:
                self.removed[uid] = anchor
                if anchor is not None:
                    self.by_anchor.setdefault(anchor, []).append(uid)

    @classmethod
    def restore(cls, removals: Iterable[RoundRecord]) -> _SnipState:
        """A resumed session's state: every recorded removal (checked), repeated."""
        state = cls()
        for removal in removals:
            state.remove(removal.uuids, removal.anchor)
        return state


def _wire_messages(run: Sequence[Message]) -> int:
    """How many API messages ``run`` makes (what to_api would merge it into), in one scan."""
    count, role, responses = 0, "", set()
    for m in run:
        if m.type == "assistant":
            if m.message_id is None or m.message_id not in responses:
                count, role = count + 1, "assistant"  # a later fragment joins its response
                responses.add(m.message_id)
            continue
        sent = m.type in ("user", "attachment") or m.subtype == "local_command"
        if sent and m.blocks and role != "user":  # consecutive user records merge
            count, role = count + 1, "user"
    return count


def _project(
    messages: list[Message], removed: Collection[str], ok: Sequence[bool]
) -> tuple[list[Message], int]:
    """``messages`` without the removed records, a marker per removed run; the input list itself
    when nothing is removed. Returns the list and how many records were removed. Records before
    a compact boundary stay: they are not sent, so removing them would only fake freed tokens."""
    if not removed:
        return messages, 0
    start = thread_start(messages)
    out: list[Message] = KeptList(messages[:start])  # kept: its readers ask what changed
    dropped, i, n = 0, start, len(messages)
    while i < n:
        if messages[i].uuid not in removed:
            out.append(messages[i])
            i += 1
            continue
        j = i
        while j < n and messages[j].uuid in removed:
            j += 1
        run = messages[i:j]
        if not (ok[i] and ok[j]):
            out += run  # the history changed under a recorded decision: keep, never break pairs
        else:
            dropped += len(run)
            wire = _wire_messages(run)
            if wire:
                out.append(_marker(wire, run[0].uuid))
        i = j
    return (messages, 0) if dropped == 0 else (out, dropped)


class HistorySnip:
    """Stage: remove whole middle rounds of history when the context nears the window.

    ``context_window`` (tokens, default 200,000: ``default_stages(context_window=...)`` sets it
    for every stage that has one); snip when the estimate reaches
    ``trigger_fraction`` of it (default 0.8 = 160,000: under the reference autocompact threshold,
    as the cheaper step should be, and far above ordinary sessions), down to ``target_fraction``
    (0.6); always keep the last ``keep_recent_rounds`` API rounds (8). ``incremental=False``
    re-derives everything from the whole history on every pass (same results, the cost of a
    full rescan: a baseline for benchmarks).
    """

    name = "history_snip"
    strategy = "snip-middle"
    may_break_cache = True
    readonly_input = True

    def __init__(
        self,
        *,
        context_window: int = DEFAULT_CONTEXT_WINDOW,
        trigger_fraction: float = 0.8,
        target_fraction: float = 0.6,
        keep_recent_rounds: int = 8,
        incremental: bool = True,
    ) -> None:
        self.context_window = check_int("context_window", context_window, minimum=1)
        self.trigger_fraction = check_fraction("trigger_fraction", trigger_fraction)
        self.target_fraction = check_fraction("target_fraction", target_fraction)
        self.keep_recent_rounds = check_int("keep_recent_rounds", keep_recent_rounds, minimum=1)
        self.incremental = check_bool("incremental", incremental)
        check_below(
            "target_fraction", self.target_fraction, "trigger_fraction", self.trigger_fraction
        )

    @property
    def rereads_outputs(self) -> bool:
        """Whether a later pass may read again a tool output (or another long text) it has met
        (:func:`~pipeline.core.rereading_stages`): only when it rescans every pass
        (``incremental=False``)."""
        return not self.incremental

    @property
    def trigger_tokens(self) -> int:
        """Snip when the estimate reaches this many tokens."""
        return int(self.context_window * self.trigger_fraction)

    @property
    def target_tokens(self) -> int:
        """Snip until the estimate is at most this many tokens."""
        return int(self.context_window * self.target_fraction)

    def __repr__(self) -> str:
        return (
            f"HistorySnip(context_window={self.context_window}, trigger_fraction="
            f"{self.trigger_fraction}, target_fraction={self.target_fraction}, "
            f"keep_recent_rounds={self.keep_recent_rounds})"
        )

    async def __call__(self, messages: list[Message], ctx: SessionContext) -> list[Message]:
        run = ProjectionPass.open(
            self.name,
            messages,
            ctx,
            _SnipState,
            self._restore,
            _project,
            reuse=self.incremental,
            acts=lambda tokens: tokens >= self.trigger_tokens,
        )
        view, state, reapplied, before = run.view, run.state, run.applied, run.before
        decision = Decision.REAPPLY if reapplied else Decision.SKIP
        reason, new = Reason.BELOW_TRIGGER, []
        if before >= self.trigger_tokens:
            # a marker's own tokens come back, so cover them too
            excess = before - self.target_tokens + view.price([_marker(10**6, "")])
            new = self._select(view, state.removed.keys(), excess)
            reason = Reason.OVER_TRIGGER if new else Reason.NOTHING_ELIGIBLE
        if new:
            decision = Decision.SNIP
            state.remove(new, view.anchor)
            run.out, run.applied = _project(messages, state.removed, view.ok)
            data = {"strategy": self.strategy, "removed": new, "anchor": view.anchor}
            await record_decision(ctx, self.name, data)
            ctx.logger.info("history_snip.snipped", removed=len(new))
        freed = view.freed(run.then, run.out) if new else run.refreed
        return run.close(
            ctx,
            decision,
            reason,
            count=len(state.removed),
            members=state.removed.keys,
            freed=freed,
            facts={
                ATTR.STRATEGY: self.strategy,
                ATTR.REMOVED_NEW: len(new),
                ATTR.REMOVED_TOTAL: len(state.removed),
                ATTR.REAPPLIED: reapplied,
                ATTR.TOKENS_FREED: freed,
                ATTR.TRIGGER_TOKENS: self.trigger_tokens,
                ATTR.TARGET_TOKENS: self.target_tokens,
            },
        )

    def _restore(
        self, ctx: SessionContext, view: RoundView, records: list[Mapping[str, Any]]
    ) -> _SnipState:
        """The state a resumed session's records give, on its first pass. A record that is
        malformed, or that would remove what snip keeps (the first user message, the latest
        prompt, the anchor's round, the recent rounds: a forged or damaged record), is left
        out with a warning; the rest are repeated."""
        removals = restore_round_records(
            ctx, self, view, records, uuids_key="removed", build=lambda removal, _: removal
        )
        return _SnipState.restore(removals)

    def _select(self, view: RoundView, removed: Collection[str], excess: int) -> list[str]:
        """uuids of the oldest removable rounds whose tokens cover ``excess``."""
        messages = view.messages
        # a uuid that occurs twice would drop its twin elsewhere too: leave such rounds alone
        # (most histories have none: one set tells, without counting each)
        uuids = [m.uuid for m in messages]
        twins: set[str] = set()
        if len(set(uuids)) != len(uuids):
            twins = {u for u, c in Counter(uuids).items() if c > 1}
        chosen: list[str] = []
        freed = 0
        for s, e, protected in view.rounds(self.keep_recent_rounds):
            if freed >= excess:
                break
            uids = [m.uuid for m in messages[s:e]]
            if not protected and not any(u in removed or u in twins for u in uids):
                chosen += uids
                freed += view.price(messages[s:e])
        return chosen
