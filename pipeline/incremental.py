"""What a stage may reuse from its previous pass over the same session.

A long session reaches thousands of messages and the pipeline runs before every call, while a
turn usually only appends a few records. Stages that re-apply earlier decisions (a projection of
the whole history) keep their last output and redo only the new part -- when that is provably
the same as starting over. Two pieces serve them (and ``stages._shared.projection`` builds on them):

- :class:`InputLog` finds the first position where this pass's input differs from the last
  pass's, in one C-level sweep when the history only grew.
- :class:`AppendWatch` says whether the input only grew *and nothing new reaches back*: no new
  record shares a uuid, a response id or a tool_use_id with an older one (so no earlier cut,
  pair or decision changes meaning) and none is a compact boundary (so the part the API sees
  starts where it did). Then whatever a stage computed for the old records still holds, and it
  returns the old length; otherwise it rebuilds its view of the history (or follows the edit
  at the cost of what changed) and returns ``None``, and the stage computes from scratch --
  unless, after an edit it followed (Claude Code moves its ``cache_control`` mark on every
  call, so the message that held it changes), :attr:`AppendWatch.edit` and
  :meth:`AppendWatch.reach` show that the stage's decisions and cuts lie before anything the
  edit touched or pairs with: it then goes on from there.

The contract: messages are immutable (replace a message, never mutate its content in place).
A message replaced by another object counts as changed, even if equal (an equal copy may
serialise differently), and makes the stages start over.
``tests/test_incremental.py`` (the budget) and ``tests/test_incremental_stages.py`` (the later
stages) check them against from-scratch passes, byte for byte, over random histories with
edits to old messages.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from itertools import compress, count

from pipeline.kept_list import InputLog, KeptList, first_difference, first_unequal
from pipeline.messages import Message, holds_compaction, live_start, thread_start

__all__ = [
    "AppendWatch",
    "InputLog",
    "ThreadStart",
    "first_difference",
    "first_unequal",
    "message_keys",
]


class ThreadStart:
    """Where the part of a history the API sees begins, at the cost of what changed.

    That is the last compact boundary or compact summary (the boundary itself kept, also when
    a summary follows it, so that the token tracker still sees that a compaction happened), or
    0. A pass whose input only grew
    looks at the new records alone; a change at or before the known start looks again at all.
    :attr:`tail` is that part itself, kept the same way.
    """

    def __init__(self) -> None:
        self._log = InputLog()
        self._start = 0
        self.tail: KeptList[Message] = KeptList()
        """``messages[start:]`` of the last call when its start is past 0 (else empty): one
        list brought up to date at the cost of what changed, not a slice of the history per
        pass (read-only for its receivers, as a stage's output)."""

    def __call__(self, messages: Sequence[Message]) -> int:
        """The index of the first record the API's view holds (0: the whole history)."""
        first = self._log.take(messages)
        if first <= self._start:
            first, self._start = 0, 0
        for i in range(len(messages) - 1, first - 1, -1):
            if messages[i].restarts_thread:
                # Claude Code 2.x writes the boundary, then the summary: start at the boundary
                boundary = i > 0 and not messages[i].is_compact_boundary
                self._start = i - 1 if boundary and messages[i - 1].is_compact_boundary else i
                break
        self._keep_tail(messages, first)
        return self._start

    def _keep_tail(self, messages: Sequence[Message], first: int) -> None:
        start, tail = self._start, self.tail
        if not start:
            if tail:
                tail.clear()
            return
        # the tail's first ``kept`` still hold: a change at or before the old start made
        # ``first`` 0, and a start found past it lies at ``first`` or later (or one before,
        # on a boundary that was already the old start): ``kept`` <= 0 redoes the whole tail
        kept = first - start
        if 0 <= kept <= len(tail):
            del tail[kept:]
            tail += messages[start + kept :]
        else:
            tail[:] = messages[start:]


def message_keys(m: Message) -> tuple[str, str | None, list[str]]:
    """The identities a record shares with others: its uuid, its response id (assistant
    records) and the tool_use_ids it calls or answers."""
    if m.type == "assistant":
        rid, kind, field = m.message_id, "tool_use", "id"
    elif m.type == "user":
        rid, kind, field = None, "tool_result", "tool_use_id"
    else:
        return m.uuid, None, []
    tids: list[str] = []
    if isinstance(m.content, list):
        tids = [
            # any mapping: the stages read tool_results from any mapping block
            str(b.get(field))
            for b in m.content
            if isinstance(b, Mapping) and b.get("type") == kind
        ]
    return m.uuid, rid, tids


def _keeps_keys(was: Message, now: Message) -> bool:
    """Whether ``now`` surely has the keys of ``was`` (:func:`message_keys`), read without
    building them: the same uuid, kind and response id, and block for block the same object,
    or blocks of the same type whose ids are the very same objects (a cleared result). False
    when unsure: the caller then compares the keys."""
    before, after = was.content, now.content
    if (
        was.uuid != now.uuid
        or was.type != now.type
        or was.message_id != now.message_id
        or not isinstance(before, list)
        or not isinstance(after, list)
        or len(before) != len(after)
    ):
        return False
    for a, b in zip(before, after, strict=True):
        if a is b:
            continue
        if type(a) is not dict or type(b) is not dict or a.get("type") is not b.get("type"):
            return False
        if a.get("tool_use_id") is not b.get("tool_use_id") or a.get("id") is not b.get("id"):
            return False
    return True


def _pair_keys(m: Message) -> list[tuple[str, str]]:
    """The keys a record pairs by (:func:`message_keys` without its uuid): its response id
    and the tool_use_ids it calls or answers."""
    _uuid, rid, tids = message_keys(m)
    keys = [("t", t) for t in tids]
    if rid is not None:
        keys.append(("r", rid))
    return keys


def _reaches_back(m: Message) -> bool:
    return (
        m.is_compact_boundary
        or (m.type == "user" and m.is_compact_summary)
        or (m.type == "assistant" and holds_compaction(m))
    )


def _bump(counts: dict[str, int], key: str, by: int) -> None:
    n = counts.get(key, 0) + by
    if n:
        counts[key] = n
    else:
        del counts[key]


def _names_in(messages: Sequence[Message]) -> dict[str, str]:
    """tool_use_id -> tool name over ``messages`` (the latest use of an id names it)."""
    names: dict[str, str] = {}
    for m in messages:
        if m.type == "assistant" and isinstance(m.content, list):
            for b in m.content:
                if isinstance(b, dict) and b.get("type") == "tool_use":
                    tid, name = b.get("id"), b.get("name")
                    if isinstance(tid, str) and isinstance(name, str):
                        names[tid] = name
    return names


class AppendWatch:
    """Whether each pass's input is the last one plus records that reach nothing older.

    Also keeps, for the current input, :attr:`start` (``thread_start``), :attr:`live`
    (``live_start``) and :attr:`tool_names`
    (tool_use_id -> tool name), which stages would otherwise rescan the history for. Its index
    of the input's identities (uuids, response ids, tool_use_ids, each with how many records
    carry it) follows an edit at the cost of what changed, not of the whole history.
    """

    def __init__(self) -> None:
        self._log = InputLog()
        self._uuids: dict[str, int] = {}
        self._rids: dict[str, int] = {}
        self._tids: dict[str, int] = {}
        self._length = 0
        self._primed = False
        self.start = 0
        """Index of the first record the API sees (after the last compact boundary)."""
        self.live = 0
        """Index of the first record a stage may remove or clear (:func:`~pipeline.messages.
        live_start`: after a server compaction block, too)."""
        self.tool_names: dict[str, str] = {}
        """tool_use_id -> tool name, over every record of the input."""
        self.edit: tuple[int, list[Message]] | None = None
        """After an :meth:`advance` that returned ``None`` but followed the change without
        starting over: where the input first changed and the records it replaced from there
        (the old tail). A client that moves its ``cache_control`` mark to its last message
        changes the message that held it on every call; a stage may extend its last output
        past such an edit (see :meth:`reach`). None otherwise."""

    def reach(self, messages: Sequence[Message], first: int, replaced: Sequence[Message]) -> int:
        """The lowest position before ``first`` of a record of ``messages`` that shares a
        response id or a tool_use_id with a record from ``first`` on or with one of
        ``replaced``; ``first`` when none does. A cut at or before it splits no pair or
        response the edit made or unmade. Found walking back from ``first`` only as far as the
        key counts say such records lie (one or two records for an edit that moves a mark)."""
        want: dict[tuple[str, str], int] = {}
        tail: dict[tuple[str, str], int] = {}
        for m in messages[first:]:
            for key in _pair_keys(m):
                tail[key] = tail.get(key, 0) + 1
        for m in (*messages[first:], *replaced):
            for key in _pair_keys(m):
                counts = self._rids if key[0] == "r" else self._tids
                before = counts.get(key[1], 0) - tail.get(key, 0)
                if before > 0:
                    want[key] = before
        at = first
        while want and at > 0:
            at -= 1
            for key in _pair_keys(messages[at]):
                left = want.get(key)
                if left is not None:
                    if left > 1:
                        want[key] = left - 1
                    else:
                        del want[key]
        return at

    def advance(self, messages: Sequence[Message], *, reuse: bool = True) -> int | None:
        """Take this pass's input. Return the old length if the input is the last one plus
        records that share no key with it and restart nothing; else ``None`` (the views
        follow the change). ``reuse=False`` always rebuilds (a stage configured to compute
        every pass afresh), and the next pass rebuilds too. If it raises (a record it cannot
        read), the next rebuilds."""
        primed, self._primed = self._primed and reuse, False
        self.edit = None
        try:
            if not reuse:
                self._log.clear()
                self._rebuild(messages)
                self._length = len(messages)
                return None
            n_old = self._length
            first = self._log.take(messages)
            added = messages[first:]
            grew = primed and first == n_old and not any(map(_reaches_back, added))
            if grew and self._add_disjoint(added):
                self._learn_names(added)
                self._length, self._primed = len(messages), True
                return n_old
            removed = self._log.removed
            if primed and first >= self.start and len(removed) <= len(added):
                # every old position kept (a stage clearing old results, then the new turn):
                # only the positions that hold another record count, found in a C-level sweep
                at = list(compress(count(), map(operator.is_not, removed, added)))
                old, new = [removed[k] for k in at], [added[k] for k in at]
                tail = added[len(removed) :]
                if not any(
                    m.type == "assistant" or _reaches_back(m) for m in (*old, *new)
                ) and not any(map(_reaches_back, tail)):
                    # (tool names come from assistant records alone)
                    for was, now in zip(old, new, strict=True):
                        if _keeps_keys(was, now):
                            continue
                        keys = message_keys(was), message_keys(now)
                        if keys[0] != keys[1]:  # a cleared result keeps its keys: no change
                            self._count_keys(keys[0], -1)
                            self._count_keys(keys[1], 1)
                    self._count(tail, 1)
                    self._learn_names(tail)
                    self._length, self._primed = len(messages), True
                    self.edit = (first, removed)
                    return None
            if (
                primed
                and first >= self.start
                and not any(map(_reaches_back, removed))
                and not any(map(_reaches_back, added))
            ):
                self._count(removed, -1)
                self._count(added, 1)
                self._forget_names(removed, added, messages)
                self._learn_names(added)
                self.edit = (first, removed)
            else:
                self._rebuild(messages)
            self._length, self._primed = len(messages), True
            return None
        except BaseException:
            self._log.clear()  # what was taken in is not what the views describe
            raise

    def invalidate(self) -> None:
        """Make the next :meth:`advance` rebuild (a pass failed midway)."""
        self._primed = False
        self._log.clear()

    def _add_disjoint(self, records: Sequence[Message]) -> bool:
        """Count ``records`` in if none shares a key with the records counted so far; else
        count nothing and return False. (Each record's keys are read once: every incremental
        stage's watch does this for every new record.)"""
        uuids, rids, tids = self._uuids, self._rids, self._tids
        keys = list(map(message_keys, records))
        for uuid, rid, ids in keys:
            if uuid in uuids or (rid is not None and rid in rids) or any(t in tids for t in ids):
                return False
        for uuid, rid, ids in keys:
            uuids[uuid] = uuids.get(uuid, 0) + 1
            if rid is not None:
                rids[rid] = rids.get(rid, 0) + 1
            for t in ids:
                tids[t] = tids.get(t, 0) + 1
        return True

    def _count(self, records: Sequence[Message], by: int) -> None:
        for m in records:
            self._count_keys(message_keys(m), by)

    def _count_keys(self, keys: tuple[str, str | None, list[str]], by: int) -> None:
        uuid, rid, ids = keys
        _bump(self._uuids, uuid, by)
        if rid is not None:
            _bump(self._rids, rid, by)
        for t in ids:
            _bump(self._tids, t, by)

    def _rebuild(self, messages: Sequence[Message]) -> None:
        self._uuids, self._rids, self._tids = {}, {}, {}
        self._count(messages, 1)
        self.start = thread_start(messages)
        self.live = live_start(messages)
        self.tool_names = {}
        self._learn_names(messages)

    def _forget_names(
        self, removed: Sequence[Message], added: Sequence[Message], messages: Sequence[Message]
    ) -> None:
        """Drop the names the removed records gave. An id that a tool_use among the records
        added back names gets its name from them (the latest use names it, and they come last);
        one still carried elsewhere takes its name from the records again (rare: ids are unique
        per call)."""
        named_again: dict[str, str] | None = None
        for m in removed:
            if m.type != "assistant":
                continue
            for tid in message_keys(m)[2]:
                if named_again is None:
                    named_again = _names_in(added)
                if tid in named_again:
                    continue
                if tid in self._tids:
                    self.tool_names = {}
                    self._learn_names(messages)
                    return
                self.tool_names.pop(tid, None)

    def _learn_names(self, messages: Sequence[Message]) -> None:
        self.tool_names.update(_names_in(messages))
