"""The tool-result budget's grouping scan, one undoable step per message (:class:`GroupScan`).

The budget decides on the results an API-level user message carries together, so it groups
them as the wire will send them; a long session's budget keeps that grouping across passes
(:mod:`stages._budget_scan`) and takes back exactly what a message added when the history
changes under it. What a tool_result is sent as is known by its :data:`Name`: a decision on one
output never applies to another output that reuses its id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.gate import empty_result_text, is_persistable
from pipeline.messages import Message
from pipeline.results.reading import ResultSlot, candidate_size, read_results

__all__ = ["Candidate", "GroupScan", "Name", "collect_groups", "result_name", "step_slots"]

Name = str | tuple[str, str]
"""What a tool_result is sent as depends on: a candidate's ledger key (id and output digest),
or ``("empty", placeholder)`` for a blank result (the placeholder names the tool its id was
called as where it stands)."""


def result_name(slot: ResultSlot, tool_names: Mapping[str, str]) -> Name | None:
    """What ``slot`` is sent as depends on (None: a result without a usable id)."""
    if slot.tool_use_id is None:
        return None
    if slot.empty:
        return ("empty", empty_result_text(tool_names.get(slot.tool_use_id)))
    return slot.key


@dataclass(frozen=True, slots=True)
class Candidate:
    """A tool_result the budget may decide on, and where it sits. ``content`` is the tool's
    output (the harness tail split off: :mod:`pipeline.wire.harness`), None once the result
    is decided (:meth:`GroupScan.settle`); ``key`` its ledger key."""

    msg_index: int
    tool_use_id: str
    tool_name: str | None
    content: Any
    size: int
    persistable: bool
    key: str = ""


@dataclass(slots=True)
class _Undo:
    """What one message added to the scan, so that a rollback can take exactly that back (a
    user message with nothing but its results to undo keeps its :attr:`slots` alone: see
    :data:`_Step`)."""

    closed_group: bool = False
    """An assistant with a new id closed the open group."""
    assistant_id: str | None = None
    """The response id this message was the first to show."""
    names: tuple[str | None, ...] = ()
    """tool_use_id, then the name it had before or None, for every tool_use, in order."""
    candidates: int = 0
    """Candidates appended to the open group."""
    unaddressable: int = 0
    malformed: int = 0
    slots: tuple[Name | None, ...] = ()
    """Per tool_result block, in order: what it is sent as (what the output patch reads)."""


@dataclass(frozen=True, slots=True)
class _Answer:
    """An assistant message's step when none of its tool ids had a name before it: the rest
    of what it added (its response id, its tool ids) is read back from the message when it is
    undone. Four shared values stand for every such step (an :class:`_Undo` and its names,
    ~150 bytes, were kept for every answer of a held conversation)."""

    closed_group: bool
    new_id: bool
    """Its response id was new (see :attr:`_Undo.assistant_id`)."""


_ANSWERS = {(c, n): _Answer(c, n) for c in (False, True) for n in (False, True)}

_Step = _Undo | _Answer | tuple[Name | None, ...] | str | None
"""One message's step: None when it added nothing; a user message whose blocks all are
mappings and whose results all have ids, its slots alone (its candidates are the slots named
by a key: a string), and a lone candidate's key itself (the most common user message: one
result); an assistant message whose tool ids are all new, an :class:`_Answer`; else an
:class:`_Undo`. A step is kept for every message of a held conversation: the tuple alone is
~90 bytes less than an object beside it, the key alone ~60 less than a tuple of it."""


def step_slots(step: _Step) -> tuple[Name | None, ...]:
    """What one message's step says each of its tool_result blocks is sent as, in order."""
    if step is None or type(step) is _Answer:
        return ()
    if type(step) is str:
        return (step,)
    return step if type(step) is tuple else step.slots  # type: ignore[union-attr]


class GroupScan:
    """The grouping scan as one undoable step per message.

    A group is a maximal run of user messages not separated by an assistant message with an id
    not seen before: same-id fragments (streaming, interleaved streams) merge back into one wire
    message, and progress / attachment / system records never split a group. Alongside: tool
    names by id, the placeholders of empty results, and per id where it first occurs and how
    many candidates carry it. Results are known by :data:`Name`: a decision on one output is
    never applied to another output that reuses its id.
    """

    def __init__(self) -> None:
        self.undo: list[_Step] = []
        self.closed: list[tuple[Candidate, ...]] = []
        """The groups closed, each a tuple (a list of one candidate is 88 bytes, a tuple 48)."""
        self.current: list[Candidate] = []
        self.tool_names: dict[str, str] = {}
        self.assistant_ids: set[str] = set()
        self.unaddressable = 0
        """tool_result blocks without a usable string id."""
        self.malformed = 0
        """Non-mapping items in user content lists (the output patch cannot read them)."""
        self.first_pos: dict[Name, int] = {}
        self.cand_count: dict[str, int] = {}
        """Result key -> how many candidates carry it."""
        self.sizes: dict[str, int] = {}
        """Result key -> its output's size (the same output for every candidate of a key)."""
        self.reapplied = 0
        """Candidates whose id the ledger had replaced when they were counted (see push/pop)."""

    def kept_off(self, replacements: Mapping[str, str]) -> int:
        """Characters the replaced candidates do not carry: each one's size less its
        replacement's (none below 0). Read from the ledger as it stands, so a replacement
        rewritten elsewhere counts at its new length; costs the smaller of the two maps."""
        counts = self.cand_count
        if len(replacements) < len(counts):
            pairs = ((k, r) for k, r in replacements.items() if k in counts)
        else:
            pairs = ((k, replacements[k]) for k in counts if k in replacements)
        return sum(counts[k] * max(0, self.sizes[k] - len(r)) for k, r in pairs)

    def settle(self, first_group: int) -> None:
        """Every candidate from group ``first_group`` on is decided: let go of their outputs
        (what persisting one needs). A decided result is never persisted later, and a scan
        that holds no output keeps none alive once the records let go of theirs (a replay
        that reads each output only while a request can carry it)."""
        closed = self.closed
        for i in range(first_group, len(closed)):
            group = closed[i]
            for c in group:
                if c.content is not None:
                    closed[i] = tuple(map(_settled, group))
                    break
        self.current = list(map(_settled, self.current))

    @property
    def groups(self) -> list[list[Candidate]]:
        """Every group with at least one candidate, in order."""
        closed = [list(g) for g in self.closed]
        return [*closed, self.current] if self.current else closed

    def push(
        self, index: int, m: Message, replacements: Mapping[str, str], touched: set[Name]
    ) -> None:
        """Scan message ``index``; add the names of its tool_results to ``touched``."""
        if m.type == "assistant":
            self.undo.append(self._push_assistant(m))
            return
        if m.type != "user" or not isinstance(m.content, list):
            self.undo.append(None)
            return
        u = _Undo()
        u.malformed = sum(1 for b in m.content if not (type(b) is dict or isinstance(b, Mapping)))
        slots: list[Name | None] = []
        for slot in read_results(m):
            name = result_name(slot, self.tool_names)
            slots.append(name)
            if name is None:
                u.unaddressable += slot.tool_use_id is None
                continue
            self.first_pos.setdefault(name, index)
            tid = slot.tool_use_id
            assert tid is not None
            if slot.empty:
                continue
            key = slot.key
            assert key is not None
            size = candidate_size(slot.core)
            self.sizes.setdefault(key, size)
            self.current.append(
                Candidate(
                    msg_index=index,
                    tool_use_id=tid,
                    tool_name=self.tool_names.get(tid),
                    content=slot.core,
                    size=size,
                    persistable=is_persistable(slot.core),
                    key=key,
                )
            )
            u.candidates += 1
            self.cand_count[key] = self.cand_count.get(key, 0) + 1
            if key in replacements:
                self.reapplied += 1
        if not (slots or u.malformed):
            self.undo.append(None)  # nothing to undo: share None rather than keep an object
            return
        touched.update(n for n in slots if n is not None)
        if not (u.unaddressable or u.malformed):
            lone = slots[0] if len(slots) == 1 else None
            self.undo.append(lone if type(lone) is str else tuple(slots))
            return
        u.slots = tuple(slots)
        self.unaddressable += u.unaddressable
        self.malformed += u.malformed
        self.undo.append(u)

    def _push_assistant(self, m: Message) -> _Undo | _Answer | None:
        u: _Undo | None = None
        if m.message_id is None or m.message_id not in self.assistant_ids:
            u = _Undo()
            if self.current:
                self.closed.append(tuple(self.current))
                self.current = []
                u.closed_group = True
            if m.message_id is not None:
                self.assistant_ids.add(m.message_id)
                u.assistant_id = m.message_id
        names: list[str | None] = []
        for tid, name in _tool_uses(m):
            names += (tid, self.tool_names.get(tid))
            self.tool_names[tid] = name if isinstance(name, str) else ""
        if names:
            if u is None:
                u = _Undo()
            if any(n is not None for n in names[1::2]):
                u.names = tuple(names)
                return u
        if u is None:
            return None
        return _ANSWERS[u.closed_group, u.assistant_id is not None]

    def pop(
        self, index: int, m: Message, replacements: Mapping[str, str], touched: set[Name]
    ) -> None:
        """Undo the last step (message ``index``, ``m`` as it was scanned); add the names it
        touched to ``touched``."""
        u = self.undo.pop()
        if u is None:
            return
        if type(u) is str:
            u = (u,)
        if type(u) is tuple:
            u = _Undo(candidates=sum(type(n) is str for n in u), slots=u)
        elif type(u) is _Answer:
            u = _Undo(
                closed_group=u.closed_group,
                assistant_id=m.message_id if u.new_id else None,
                names=tuple(x for tid, _name in _tool_uses(m) for x in (tid, None)),
            )
        assert isinstance(u, _Undo)
        for _ in range(u.candidates):
            key = self.current.pop().key
            touched.add(key)
            n = self.cand_count[key] - 1
            if n:
                self.cand_count[key] = n
            else:
                del self.cand_count[key]
                del self.sizes[key]
            if key in replacements:
                self.reapplied -= 1
        for name in u.slots:
            if name is None:
                continue
            touched.add(name)
            if self.first_pos.get(name) == index:
                del self.first_pos[name]
        self.unaddressable -= u.unaddressable
        self.malformed -= u.malformed
        names = u.names
        for k in range(len(names) - 2, -1, -2):
            tid = names[k]
            assert tid is not None
            _restore(self.tool_names, tid, names[k + 1])
        if u.assistant_id is not None:
            self.assistant_ids.discard(u.assistant_id)
        if u.closed_group:
            # everything scanned after this message is undone, so the open group is empty
            self.current = list(self.closed.pop())


def _tool_uses(m: Message) -> list[tuple[str, Any]]:
    """The id and name of each of ``m``'s tool_use blocks with a string id, in order: what an
    answer adds to the scan, and what undoing it takes back (an item that is not a mapping,
    hostile input, is neither a block nor a tool_use)."""
    if not isinstance(m.content, list):
        return []
    return [
        (b["id"], b.get("name"))
        for b in m.content
        if (type(b) is dict or isinstance(b, Mapping))
        and b.get("type") == "tool_use"
        and isinstance(b.get("id"), str)
    ]


def _settled(c: Candidate) -> Candidate:
    if c.content is None:
        return c
    # by position: a first pass settles every result of the history, and
    # dataclasses.replace costs ~2.5 times this
    return Candidate(c.msg_index, c.tool_use_id, c.tool_name, None, c.size, c.persistable, c.key)


def _restore(d: dict[str, str], key: str, previous: str | None) -> None:
    if previous is None:
        d.pop(key, None)
    else:
        d[key] = previous


def collect_groups(messages: Sequence[Message]) -> list[list[Candidate]]:
    """Candidates grouped by the API-level user message they will be sent in."""
    scan = GroupScan()
    scratch: set[Name] = set()
    for index, m in enumerate(messages):
        scan.push(index, m, {}, scratch)
    return scan.groups
