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
  returns the old length; otherwise it rebuilds its view of the history and returns ``None``,
  and the stage computes from scratch.

The contract: messages are immutable (replace a message, never mutate its content in place).
A message replaced by another object counts as changed, even if equal (an equal copy may
serialise differently), and makes the stages start over.
``tests/test_incremental.py`` (the budget) and ``tests/test_incremental_stages.py`` (the later
stages) check them against from-scratch passes, byte for byte, over random histories with
edits to old messages.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from itertools import compress, count

from pipeline.messages import Message, thread_start

__all__ = ["AppendWatch", "InputLog", "first_difference", "message_keys"]


def first_difference(a: Sequence[object], b: Sequence[object]) -> int | None:
    """The first index at which ``a`` and ``b`` hold different objects (over the shorter of
    the two), or None: a C-level sweep."""
    return next(compress(count(), map(operator.is_not, a, b)), None)


class InputLog:
    """The input of the last pass, to find where this pass's input first differs.

    A position is unchanged when it holds the very same message object (messages compare by
    identity: an equal-looking copy may still serialise otherwise).
    """

    def __init__(self) -> None:
        self.inputs: list[Message] = []

    def take(self, messages: Sequence[Message]) -> int:
        """Make ``messages`` the remembered input; return the first position that differs.

        The common case, a history that only grew, costs the new tail plus one C-level sweep:
        the tail is appended first so that both lists have the same length, and ``list ==
        list`` compares element identity without copying either list.
        """
        old = self.inputs
        n_old, n_new = len(old), len(messages)
        if n_new >= n_old and isinstance(messages, list):
            old.extend(messages[n_old:])
            if old == messages:
                return n_old
            del old[n_old:]
        first = first_difference(messages, old)
        self.inputs = list(messages)
        return min(n_old, n_new) if first is None else first

    def clear(self) -> None:
        """Forget the last input: the next :meth:`take` reports a change at position 0."""
        self.inputs = []


def message_keys(m: Message) -> Iterator[str]:
    """The identities a record shares with others: its uuid, its response id and the
    tool_use_ids it calls or answers (prefixed, so the kinds never collide)."""
    yield "u:" + m.uuid
    if m.type == "assistant":
        if m.message_id is not None:
            yield "r:" + m.message_id
        kind, field = "tool_use", "id"
    elif m.type == "user":
        kind, field = "tool_result", "tool_use_id"
    else:
        return
    if isinstance(m.content, list):
        for b in m.content:
            if isinstance(b, dict) and b.get("type") == kind:
                yield "t:" + str(b.get(field))


def _reaches_back(m: Message) -> bool:
    return m.is_compact_boundary or (m.type == "user" and m.is_compact_summary)


class AppendWatch:
    """Whether each pass's input is the last one plus records that reach nothing older.

    Also keeps, for the current input, :attr:`start` (``thread_start``) and :attr:`tool_names`
    (tool_use_id -> tool name), which stages would otherwise rescan the history for.
    """

    def __init__(self) -> None:
        self._log = InputLog()
        self._keys: set[str] = set()
        self._length = 0
        self._primed = False
        self.start = 0
        """Index of the first record the API sees (after the last compact boundary)."""
        self.tool_names: dict[str, str] = {}
        """tool_use_id -> tool name, over every record of the input."""

    def advance(self, messages: Sequence[Message], *, reuse: bool = True) -> int | None:
        """Take this pass's input. Return the old length if the input is the last one plus
        records that share no key with it and restart nothing; else ``None`` (rebuilt).
        ``reuse=False`` always rebuilds (a stage configured to compute every pass afresh), and
        the next pass rebuilds too. If it raises (a record it cannot read), the next rebuilds."""
        primed, self._primed = self._primed and reuse, False
        try:
            first = self._log.take(messages) if reuse else -1
            if not reuse:
                self._log.clear()
            if primed and first == self._length:
                n_old = self._length
                tail = messages[n_old:]
                keys = [k for m in tail for k in message_keys(m)]
                if not any(map(_reaches_back, tail)) and self._keys.isdisjoint(keys):
                    self._keys.update(keys)
                    self._learn_names(tail)
                    self._length, self._primed = len(messages), True
                    return n_old
            self._rebuild(messages)
            self._length, self._primed = len(messages), reuse
            return None
        except BaseException:
            self._log.clear()  # what was taken in is not what the views describe
            raise

    def invalidate(self) -> None:
        """Make the next :meth:`advance` rebuild (a pass failed midway)."""
        self._primed = False
        self._log.clear()

    def _rebuild(self, messages: Sequence[Message]) -> None:
        self._keys = {k for m in messages for k in message_keys(m)}
        self.start = thread_start(messages)
        self.tool_names = {}
        self._learn_names(messages)

    def _learn_names(self, messages: Sequence[Message]) -> None:
        for m in messages:
            if m.type == "assistant" and isinstance(m.content, list):
                for b in m.content:
                    if isinstance(b, dict) and b.get("type") == "tool_use":
                        tid, name = b.get("id"), b.get("name")
                        if isinstance(tid, str) and isinstance(name, str):
                            self.tool_names[tid] = name
