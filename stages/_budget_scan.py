"""The budget's memory of earlier passes: the per-session cache that lets a pass cost what is
new, over the grouping scan's undoable steps (:mod:`stages._group_scan`).

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
from typing import Any

from pipeline.kept_list import InputLog, KeptList
from pipeline.messages import Message
from pipeline.replacement import ReplacementState
from pipeline.results.reading import read_results
from stages._group_scan import GroupScan, Name, result_name, step_slots
from stages._shared import patch_message

__all__ = ["BudgetCache", "patch_all"]


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
        names = [result_name(s, tool_names) for s in read_results(m)]
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
            undone = self.log.removed  # the messages scanned from ``start`` on, as they were
            # cannot happen: the log and the scan move together, and a pass that fails drops
            # its cache
            if len(undone) != scanned - start:
                raise RuntimeError("the budget's scan and its input log disagree")
            for index in range(scanned - 1, start - 1, -1):
                scan.pop(index, undone[index - start], replacements, touched)
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
                if not stale.isdisjoint(step_slots(scan.undo[index])):
                    self._patch(index, messages[index])
        for index in range(start, len(messages)):
            if step_slots(scan.undo[index]):
                self._patch(index, messages[index])

    def _patch(self, index: int, m: Message) -> None:
        apply = self.apply
        slots = step_slots(self.scan.undo[index])
        if apply.keys().isdisjoint(slots):
            patched = m  # none of its results is sent otherwise (most, in a first pass)
        else:
            names = iter(slots)

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
