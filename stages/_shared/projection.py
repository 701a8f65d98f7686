"""A stage's last output, kept so that the next pass can extend it instead of redoing it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from pipeline.incremental import AppendWatch
from pipeline.messages import Message

__all__ = ["Projection", "ProjectionState", "reapply_projection"]


@dataclass(frozen=True, slots=True)
class Projection:
    """A stage's output of its last pass, kept so the next pass can extend it.

    For stages whose decisions (removals, summaries) only ever accumulate and name records by
    uuid: the output stays valid for a history that only grew (:meth:`AppendWatch.advance`)
    while no decision was added and no new record is one a decision names.
    """

    decisions: int
    """How many decisions the output applied."""
    members: frozenset[str]
    """The uuids those decisions name."""
    out: list[Message]
    """What the pass sent, when it differed from its input: the stage's own list, extended in
    place by the next pass (its receivers only read it: see :class:`pipeline.core.Stage`)."""
    applied: int
    """What the stage counts as applied (0: the input went through as it was)."""

    @classmethod
    def remember(
        cls,
        last: Projection | None,
        decisions: int,
        members: Callable[[], Iterable[str]],
        out: list[Message],
        applied: int,
    ) -> Projection:
        """The projection of this pass (``members`` is only read when decisions changed);
        ``out`` is kept, not copied: a list the stage built (or ``messages`` when ``applied``
        is 0, which is not kept)."""
        named = last.members if last is not None and last.decisions == decisions else None
        if named is None:
            named = frozenset(members())
        return cls(decisions, named, out if applied else [], applied)

    def extend(
        self, messages: list[Message], grown: int | None, decisions: int
    ) -> tuple[list[Message], int] | None:
        """This output plus the records new since (``grown``: the old length, from
        :meth:`AppendWatch.advance`), or ``None`` when it must be computed afresh. The kept
        list is extended in place: a pass costs the new records, not a copy of the history."""
        if (
            grown is None
            or decisions != self.decisions
            or not self.members.isdisjoint(m.uuid for m in messages[grown:])
        ):
            return None
        if self.applied == 0:
            return messages, 0
        out = self.out
        out += messages[grown:]
        return out, self.applied


class ProjectionState(Protocol):
    """What a projecting stage keeps per session for :func:`reapply_projection`."""

    watch: AppendWatch
    last: Projection | None


def reapply_projection(
    messages: list[Message],
    state: ProjectionState,
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
    extended = last.extend(messages, grown, decisions) if last else None
    out, applied = extended or project()
    return out, applied, last
