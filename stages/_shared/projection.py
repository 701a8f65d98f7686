"""A stage's last output, kept so that the next pass can extend it instead of redoing it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    out: tuple[Message, ...]
    """What the pass sent, when it differed from its input (a copy: callers may edit lists)."""
    applied: int
    """What the stage counts as applied (0: the input went through as it was)."""

    @classmethod
    def remember(
        cls,
        last: Projection | None,
        decisions: int,
        members: Callable[[], Iterable[str]],
        out: Sequence[Message],
        applied: int,
    ) -> Projection:
        """The projection of this pass (``members`` is only read when decisions changed)."""
        named = last.members if last is not None and last.decisions == decisions else None
        if named is None:
            named = frozenset(members())
        return cls(decisions, named, tuple(out) if applied else (), applied)

    def extend(
        self, messages: list[Message], grown: int | None, decisions: int
    ) -> tuple[list[Message], int] | None:
        """This output plus the records new since (``grown``: the old length, from
        :meth:`AppendWatch.advance`), or ``None`` when it must be computed afresh."""
        if (
            grown is None
            or decisions != self.decisions
            or not self.members.isdisjoint(m.uuid for m in messages[grown:])
        ):
            return None
        if self.applied == 0:
            return messages, 0
        return [*self.out, *messages[grown:]], self.applied
