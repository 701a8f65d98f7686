"""The skeleton every projecting stage's pass shares (history snip, context collapse): its
recorded decisions re-applied, what the anchor's usage already counted, and the decision told
once the stage has acted (or not)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pipeline import Message, SessionContext
from pipeline.incremental import AppendWatch
from pipeline.tracing import AttributeValue, Decision, Reason
from stages._shared.projection import Projection
from stages._shared.records import session_state
from stages._shared.rounds import RoundView

__all__ = ["ProjectionPass", "ProjectionState"]

D = TypeVar("D")


@dataclass(slots=True)
class ProjectionState(Generic[D]):
    """What a projecting stage keeps per session: the last pass's output while it can be
    reused, and (in the stage's own subclass) its decisions so far and which of them the
    request its usage anchor answered already had."""

    watch: AppendWatch = field(default_factory=AppendWatch)
    """Whether the history only grew since the last pass."""
    last: Projection | None = None
    """The previous pass's output, while it can be extended."""

    def decided(self) -> D:
        """Every decision so far, as the stage's projection takes them."""
        raise NotImplementedError

    def decided_count(self) -> int:
        """How many there are."""
        raise NotImplementedError

    def counted(self, anchor: str | None) -> D | None:
        """The decisions the anchor's request had; None when it had them all (the rest were
        made since: a retried pass, a crash before the call, and free tokens again)."""
        raise NotImplementedError


S = TypeVar("S", bound=ProjectionState[Any])


@dataclass(slots=True)
class ProjectionPass(Generic[S]):
    """One pass of a projecting stage over ``messages``: :meth:`open` re-applies the recorded
    decisions (``out``, with ``applied`` of them) and prices the request against the anchor's
    usage (``before``, with ``refreed`` tokens the anchor's request still held); the stage
    then decides, and :meth:`close` keeps the output for the next pass and tells the decision."""

    name: str
    view: RoundView
    state: S
    out: list[Message]
    applied: int
    last: Projection | None
    then: list[Message]
    """What the anchor's request held, in this pass's terms (``out`` when it held it all)."""
    refreed: int
    before: int

    @classmethod
    def open(
        cls,
        name: str,
        messages: list[Message],
        ctx: SessionContext,
        kind: type[S],
        restore: Callable[[SessionContext, RoundView, list[Mapping[str, Any]]], S],
        project: Callable[[list[Message], Any, list[bool]], tuple[list[Message], int]],
        *,
        reuse: bool,
        acts: Callable[[int], bool] | None = None,
    ) -> ProjectionPass[S]:
        """The pass of stage ``name`` over ``messages``: its state (``restore`` builds it from
        the stage's records on a session's first pass); ``project(messages, decisions, ok)``:
        the decisions applied; ``reuse``: extend the last pass's output where it can.

        ``acts(tokens)``: whether the stage may decide anything at that size. A stage that has
        decided nothing yet and may decide nothing now sends its input as it came, and keeps
        no view of the history for it: a pass that does decide later catches up from where
        its view was (or builds it afresh) -- the same output as if it had followed every
        pass, at the cost of what an idle pass no longer pays."""
        view = RoundView(messages, ctx.token_tracker.tokens_for_messages)
        state = session_state(ctx, name, kind, lambda records: restore(ctx, view, records))
        if acts is not None and not state.decided_count():
            before = ctx.size_of(messages)
            if not acts(before):
                state.last = None  # nothing to extend: the view it was made on is left behind
                return cls(name, view, state, messages, 0, None, messages, 0, before)
        out, applied, last = _reapply(
            messages,
            state,
            state.decided_count(),
            lambda: project(messages, state.decided(), view.ok),
            reuse=reuse,
        )
        older = state.counted(view.anchor)
        then = out if older is None else project(messages, older, view.ok)[0]
        refreed = view.freed(then, out)
        before = ctx.size_of(out, also_freed=refreed)
        return cls(name, view, state, out, applied, last, then, refreed, before)

    def close(
        self,
        ctx: SessionContext,
        decision: Decision,
        reason: Reason,
        *,
        count: int,
        members: Callable[[], Set[str]],
        freed: int,
        facts: Mapping[str, AttributeValue],
    ) -> list[Message]:
        """Keep this pass's output for the next (``count`` decisions naming ``members``), add
        ``freed`` tokens to the pass's report and tell the decision; the output."""
        out = self.out
        self.state.last = Projection.remember(self.last, count, members, out, self.applied)
        ctx.report.tokens_freed += freed
        ctx.decide(
            self.name,
            decision,
            reason,
            tokens_before=self.before,
            tokens_after=ctx.size_of(out),
            facts=dict(facts),
        )
        return out


def _reapply(
    messages: list[Message],
    state: ProjectionState[Any],
    decisions: int,
    project: Callable[[], tuple[list[Message], int]],
    *,
    reuse: bool,
) -> tuple[list[Message], int, Projection | None]:
    """The recorded decisions applied to ``messages``: the last pass's output plus the new
    records when the history only grew by records that reach nothing older and none of them
    is one a decision names; else ``project()`` from scratch.

    Returns the output, what :attr:`Projection.applied` counts, and the last pass's projection
    (taken out of ``state``: a pass that fails midway leaves nothing to reuse).
    """
    state.last, last = None, state.last
    grown = state.watch.advance(messages, reuse=reuse)
    if not decisions:
        return messages, 0, last
    extended = None
    if last is not None:
        extended = last.extend(messages, grown, decisions)
        if extended is None and grown is None:
            extended = last.extend_edited(messages, state.watch, decisions)
    out, applied = extended or project()
    return out, applied, last
