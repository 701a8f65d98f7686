"""The budget's memory of earlier passes: the grouping scan as undoable steps, and the
per-session cache that lets a pass cost what is new.

A long session reaches thousands of messages, and the stage runs before every call. So that a
pass costs what is new rather than the whole history, each session keeps a cache in
``ctx.stage_state["tool_result_budget"]`` (stage objects are shared by sessions; the cache is
not): the grouping scan as one undoable step per message, candidate sizes and classes, the
tool-name map, the replacement map and the patched messages of the output.

Each pass compares the new input with the input of the previous pass, position by position: a
position is unchanged when it holds the same message object (messages compare by identity, so
a history that only grew costs one C-level sweep). From the first changed position on, the
cached steps are undone in reverse and the rest is scanned again. Results that depend on a
tool_use_id anywhere in the history (the replacement map) are recomputed for every id the
changed part touches, and older messages that carry such an id are patched again. So
replacing, inserting, deleting, truncating or reordering messages, or passing a different list,
gives the same output as a from-scratch pass (``tests/test_incremental.py`` proves it, byte
for byte, state included).

What a pass costs: Python work for the new (or changed) messages and for the groups they
touch, a C-level sweep over the history (comparing the message lists: under a nanosecond per
message), and one step per message that carries a replacement. The output is the cache's own
list, brought up to date in place (its receivers only read it: see
:class:`pipeline.core.Stage`), so no pass copies the history.

The contract that makes the cache safe:

- Messages are immutable. Replacing a message (a new object, e.g. ``with_content``) is
  supported; mutating a message's content list or a block dict in place is NOT (an equal-looking
  old object cannot be told from a changed one without re-reading all content every pass).
- The ledger (``ctx.replacement_state``) may change between passes in any way -- replaced by
  another object, ids added, removed or rewritten: a pass that finds the ledger it left at the
  version it left it (``ReplacementState.version`` counts every change) trusts it; otherwise it
  checks, completely, that the replacements are the ones the cache knows and that every
  candidate it scanned is still seen, and starts from scratch if not. (Ids added to
  ``seen_ids`` are harmless and kept.)
- A pass that raises (including cancellation) drops the cache: the next pass starts from scratch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.gate import empty_result_text, is_persistable
from pipeline.kept_list import InputLog, KeptList
from pipeline.messages import Message
from pipeline.replacement import ReplacementState, ResultSlot, candidate_size, read_results
from stages._shared import patch_message

__all__ = ["BudgetCache", "Candidate", "GroupScan", "Name", "collect_groups", "patch_all"]

Name = str | tuple[str, str]
"""What a tool_result is sent as depends on: a candidate's ledger key (id and output digest),
or ``("empty", placeholder)`` for a blank result (the placeholder names the tool its id was
called as where it stands)."""


def _name(slot: ResultSlot, tool_names: Mapping[str, str]) -> Name | None:
    if slot.tool_use_id is None:
        return None
    if slot.empty:
        return ("empty", empty_result_text(tool_names.get(slot.tool_use_id)))
    return slot.key


@dataclass(frozen=True, slots=True)
class Candidate:
    """A tool_result the budget may decide on, and where it sits. ``content`` is the tool's
    output (the harness tail split off: :mod:`pipeline.wire.harness`); ``key`` its ledger key."""

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


_Step = _Undo | tuple[Name | None, ...] | None
"""One message's step: None when it added nothing; a user message whose blocks all are
mappings and whose results all have ids, its slots alone (its candidates are the slots named
by a key: a string); else an :class:`_Undo`. A step is kept for every message of a held
conversation: the tuple alone is ~90 bytes less than an object beside it."""


def _slots(step: _Step) -> tuple[Name | None, ...]:
    if step is None:
        return ()
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
        u.malformed = sum(1 for b in m.content if not isinstance(b, Mapping))
        slots: list[Name | None] = []
        for slot in read_results(m):
            name = _name(slot, self.tool_names)
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
            self.undo.append(tuple(slots))
            return
        u.slots = tuple(slots)
        self.unaddressable += u.unaddressable
        self.malformed += u.malformed
        self.undo.append(u)

    def _push_assistant(self, m: Message) -> _Undo | None:
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
        if isinstance(m.content, list):
            names: list[str | None] = []
            for b in m.content:
                if not isinstance(b, Mapping):  # hostile input: not a block, not a tool_use
                    continue
                if b.get("type") == "tool_use" and isinstance(b.get("id"), str):
                    tid, name = b["id"], b.get("name")
                    names += (tid, self.tool_names.get(tid))
                    self.tool_names[tid] = name if isinstance(name, str) else ""
            if names:
                if u is None:
                    u = _Undo()
                u.names = tuple(names)
        return u

    def pop(self, index: int, replacements: Mapping[str, str], touched: set[Name]) -> None:
        """Undo the last step (message ``index``); add the names it touched to ``touched``."""
        u = self.undo.pop()
        if u is None:
            return
        if type(u) is tuple:
            u = _Undo(candidates=sum(type(n) is str for n in u), slots=u)
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


def patch_all(messages: list[Message], replacements: Mapping[str, str]) -> list[Message]:
    """Every message patched from scratch: each candidate sent as its replacement (by key),
    each blank result as its placeholder (the path for input the cache does not keep)."""
    out: list[Message] | None = None
    tool_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.type == "assistant" and isinstance(m.content, list):
            for b in m.content:
                if isinstance(b, Mapping) and b.get("type") == "tool_use":
                    tid, name = b.get("id"), b.get("name")
                    if isinstance(tid, str):
                        tool_names[tid] = name if isinstance(name, str) else ""
        names = [_name(s, tool_names) for s in read_results(m)]
        patched = _patched(m, names, replacements)
        if patched is not m:
            if out is None:
                out = list(messages)
            out[i] = patched
    return messages if out is None else out


def _patched(
    m: Message,
    slots: Sequence[Name | None],
    replacements: Mapping[str, str],
) -> Message:
    names = iter(slots)

    def content_for(block: Mapping[str, Any]) -> str | None:
        name = next(names, None)
        if name is None:
            return None
        return name[1] if isinstance(name, tuple) else replacements.get(name)

    return patch_message(m, content_for)


class BudgetCache:
    """One session's memory of earlier passes (the module docstring says what makes it safe)."""

    def __init__(self, state: ReplacementState) -> None:
        self.log = InputLog()
        """The input of the last pass, to find where this one first differs."""
        self.scan = GroupScan()
        self.apply: dict[Name, str] = {}
        """What a tool_result is sent as, by :data:`Name`: a candidate's replacement from the
        ledger, a blank result's placeholder (that of the id's last blank result)."""
        self.patches: dict[int, Message] = {}
        """position -> the message sent there in place of the input's (only changed ones)."""
        self._sent: KeptList[Message] = KeptList()
        """The input with the patches applied, as of the positions kept in sync so far: the
        output itself (when anything is patched), so a pass costs what changed, not a copy of
        the history or a sweep of every patch."""
        self._dirty: set[int] = set()
        """Positions whose patch changed since ``_sent`` was last brought up to date."""
        self.busy = False
        self._replaced = dict(state.replacements)
        """The ledger's replacements as the last pass left them (values: the same objects)."""
        self._ledger: tuple[ReplacementState, int] | None = None
        """The ledger and its version as the last pass left it."""

    def fits(self, state: ReplacementState) -> bool:
        """Nothing this cache relies on changed in the ledger since the last pass.

        It relies on the replacements (the texts it patched in, the re-applied count) and on
        every candidate it scanned being seen (so that no earlier group needs a decision). The
        ledger this cache left, at the version it left it, fits at once (O(1)); any other
        ledger, or a change since, is checked completely, with C-level sweeps and no copy
        (about 35 ns per scanned result id): any removal, rewrite or addition that matters is
        caught, also when the sizes stay the same; ids added to ``seen_ids`` change nothing
        cached, and a ledger replaced by an equal one keeps the cache.
        """
        last = self._ledger
        if last is not None and last[0] is state and last[1] == state.version:
            return True
        return (
            self._replaced == state.replacements and self.scan.cand_count.keys() <= state.seen_ids
        )

    def seal(self, state: ReplacementState, replaced_now: Mapping[str, str]) -> None:
        """Take in the replacements this pass made (the only change a pass makes to them) and
        the ledger as this pass leaves it."""
        self._replaced.update(replaced_now)
        self._ledger = (state, state.version)

    def sync(
        self, messages: list[Message], replacements: Mapping[str, str]
    ) -> tuple[int, int, set[Name]]:
        """Undo the scan back to the first change and scan the rest.

        Returns the first rescanned position, the index of the group that was open there (no
        earlier group holds a rescanned message) and the names of the results the change
        touched.
        """
        scan = self.scan
        scanned = len(scan.undo)
        start = self.log.take(messages)
        touched: set[Name] = set()
        if start < scanned:
            for index in range(scanned - 1, start - 1, -1):
                scan.pop(index, replacements, touched)
            for p in [p for p in self.patches if p >= start]:
                del self.patches[p]
            del self._sent[start:]
        first_group = len(scan.closed)
        for index in range(start, len(messages)):
            scan.push(index, messages[index], replacements, touched)
        return start, first_group, touched

    def update_output(
        self,
        messages: list[Message],
        start: int,
        touched: set[Name],
        replacements: Mapping[str, str],
    ) -> None:
        """Bring the replacement map and the patched messages up to date after this pass."""
        scan = self.scan
        stale: set[Name] = set()  # results whose text changed and that occur before ``start``
        stale_from = start
        for name in touched:
            if isinstance(name, tuple):
                text = name[1] if name in scan.first_pos else None
            else:
                text = replacements.get(name) if name in scan.cand_count else None
            old = self.apply.get(name)
            if text == old:
                continue
            if text is None:
                del self.apply[name]
            else:
                self.apply[name] = text
            first = scan.first_pos.get(name)
            if first is not None and first < start:
                stale.add(name)
                stale_from = min(stale_from, first)
        if stale:  # rare: a result repeated across the edit point, or an edit that removed one
            for index in range(stale_from, start):
                if not stale.isdisjoint(_slots(scan.undo[index])):
                    self._patch(index, messages[index])
        for index in range(start, len(messages)):
            if _slots(scan.undo[index]):
                self._patch(index, messages[index])

    def _patch(self, index: int, m: Message) -> None:
        apply = self.apply
        names = iter(_slots(self.scan.undo[index]))

        def content_for(block: Mapping[str, Any]) -> str | None:
            name = next(names, None)
            return None if name is None else apply.get(name)

        patched = patch_message(m, content_for)
        if patched is m:
            if self.patches.pop(index, None) is not None:
                self._dirty.add(index)
        else:
            self.patches[index] = patched
            self._dirty.add(index)

    def output(self, messages: list[Message]) -> list[Message]:
        """The projected list: the input itself when nothing changed, else the cache's own
        list, brought up to date in place on every pass (read-only for its receivers, as every
        stage's output: see :class:`pipeline.core.Stage`)."""
        sent = self._sent
        del sent[len(messages) :]
        sent.extend(messages[len(sent) :])
        patches = self.patches
        for index in self._dirty:
            if index < len(sent):
                sent[index] = patches.get(index, messages[index])
        self._dirty.clear()
        return sent if patches else messages
