"""A stage's last output, kept so that the next pass can extend it instead of redoing it."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

from pipeline.incremental import AppendWatch
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
    members: Set[str]
    """The uuids those decisions name: the stage's own set, read as it stands (its decisions
    only accumulate, and a count of them other than :attr:`decisions` makes this output
    stale whatever the set holds), so a history's worth of uuids is not copied."""
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
        members: Callable[[], Set[str]],
        out: list[Message],
        applied: int,
    ) -> Projection:
        """The projection of this pass (``members`` is only read when decisions changed);
        ``out`` is kept, not copied: a list the stage built (or ``messages`` when ``applied``
        is 0, which is not kept)."""
        named = last.members if last is not None and last.decisions == decisions else None
        if named is None:
            named = members()
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

    def extend_edited(
        self, messages: list[Message], watch: AppendWatch, decisions: int
    ) -> tuple[list[Message], int] | None:
        """This output with its tail replaced, for an input that changed from some position on
        without starting over (``watch.edit``: a client moving its ``cache_control`` mark
        changes its last message on every call), or ``None`` when it must be computed afresh.

        It holds when no record a decision names lies at or after the lowest record that
        shares a response id or tool_use_id with the changed tail (old or new,
        :meth:`AppendWatch.reach`): every cut and span a decision was applied at is then judged
        on records and pairs the edit left alone, so a fresh projection makes the same ones
        and passes the rest through as it came -- the old tail went out as it came in, and the
        new one does. The kept list is changed in place from the edit on."""
        edit = watch.edit
        if edit is None or decisions != self.decisions:
            return None
        first, replaced = edit
        reach = watch.reach(messages, first, replaced)
        if not self.members.isdisjoint(m.uuid for m in messages[reach:]) or not (
            self.members.isdisjoint(m.uuid for m in replaced)
        ):
            return None
        if self.applied == 0:
            return messages, 0
        out = self.out
        cut = len(out) - len(replaced)
        if cut < 0 or not _same_objects(out[cut:], replaced):
            return None  # not as it came in: a fresh projection says what it is
        out[cut:] = messages[first:]
        return out, self.applied


def _same_objects(a: Sequence[Message], b: Sequence[Message]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
