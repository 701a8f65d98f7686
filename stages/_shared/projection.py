"""A stage's last output, kept so that the next pass can extend it instead of redoing it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline.messages import Message

__all__ = ["Projection"]


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
