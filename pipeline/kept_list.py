"""A list that tells its readers where it changed since they last looked.

The incremental parts of a pass find what changed in their input by comparing it, position by
position, with the input they took last time: one C-level sweep, cheap per message but paid by
every reader on every pass, so it grows with the history. A list kept across passes and only
changed by its owner (a stage's output, the replay's or the agent's history) can say instead:
each change notes the lowest position it touched, and a reader that took the same list before
asks for the lowest position touched since (:meth:`KeptList.changed_since`).

Every mutating method of ``list`` is overridden, so a change made through the list's methods,
operators or ``del`` is always noted. C code that works on a list's items directly (``heapq``)
goes around them, and so does calling ``list``'s own methods on one (``list.append(kept, x)``):
do not change a kept list that way. A slice or ``list(kept)`` is a
plain list; ``copy.copy``, ``copy.deepcopy`` and pickling give a kept list with a journal of
its own.

For any other list, :class:`InputLog` finds where a pass's input first differs from the last
one it took, with the sequence comparisons it and the wire rest on (:func:`first_difference`,
:func:`first_unequal`).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Sequence
from itertools import compress, count
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar, overload

if TYPE_CHECKING:
    from pipeline.messages import Message

__all__ = ["InputLog", "KeptList", "first_difference", "first_unequal", "shared_start"]

T = TypeVar("T")

_LOW_MAX = 2**62
"""Positions noted above this (an index past any list, about to raise) are noted as this."""

_JOURNAL = 256
"""Changes remembered one by one; older ones are folded into one lowest position."""


class KeptList(list[T]):
    """A ``list`` that journals the lowest position each change touched.

    :attr:`stamp` counts the changes so far; :meth:`changed_since` gives the lowest position
    touched by the changes after a stamp (``None``: none). A reader that fell far behind gets a
    lower position than the truth, never a higher one: it redoes more, never less.
    """

    __slots__ = ("_base", "_floor", "_lows")

    def __init__(self, iterable: Iterable[T] = ()) -> None:
        if hasattr(self, "_lows"):  # ``__init__`` called again refills the list: a change
            self._note(0)
        else:
            self._lows = array("q")
            self._base = 0
            """Changes folded into ``_floor`` (the stamp of ``_lows[0]``)."""
            self._floor = -1
            """The lowest position the folded changes touched (-1: none folded)."""
        super().__init__(iterable)

    def __copy__(self) -> KeptList[T]:
        return type(self)(self)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # the items as the constructor's argument: the journal is the new list's own
        return type(self), (list(self),)

    @property
    def stamp(self) -> int:
        """How many changes this list has had."""
        return self._base + len(self._lows)

    def changed_since(self, stamp: int) -> int | None:
        """The lowest position touched by the changes after ``stamp`` (``None``: no change)."""
        if stamp >= self.stamp:
            return None
        lows = self._lows
        if stamp >= self._base:
            return min(lows[stamp - self._base :])
        return min(self._floor, min(lows, default=self._floor))

    def _note(self, low: int) -> None:
        lows = self._lows
        lows.append(min(max(0, low), _LOW_MAX))
        if len(lows) > _JOURNAL:
            half = _JOURNAL // 2
            folded = min(lows[:half])
            self._floor = folded if self._floor < 0 else min(self._floor, folded)
            del lows[:half]
            self._base += half

    def _at(self, index: SupportsIndex) -> int:
        i = operator.index(index)
        return i + len(self) if i < 0 else i

    def _low_of(self, key: SupportsIndex | slice) -> int:
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            return start if step > 0 else 0
        return self._at(key)

    # -- every mutating method of list ---------------------------------------------------------
    @overload
    def __setitem__(self, key: SupportsIndex, value: T) -> None: ...
    @overload
    def __setitem__(self, key: slice, value: Iterable[T]) -> None: ...
    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, slice) and super().__getitem__(key) is value:
            return  # the same object again: nothing changed
        self._note(self._low_of(key))
        super().__setitem__(key, value)

    def put(self, changes: Iterable[tuple[SupportsIndex, T]]) -> None:
        """Set each ``(position, item)`` of ``changes`` as setting them one by one in order
        would (a later entry for a position wins), noted as one change at the lowest position
        that changed: a hundred records rewritten at once are one change to the readers.
        Raises ``IndexError`` for a position outside the list and ``TypeError`` for one that
        is no integer, before changing anything."""
        n = len(self)
        final: dict[int, T] = {}
        for i, v in changes:  # every position checked first: a bad one changes nothing
            j = operator.index(i)
            if not -n <= j < n:
                raise IndexError("list assignment index out of range")
            final[j + n if j < 0 else j] = v
        getitem = super().__getitem__
        changed = [(j, v) for j, v in final.items() if getitem(j) is not v]
        if not changed:
            return
        self._note(min(j for j, _ in changed))
        setitem = super().__setitem__
        for j, v in changed:
            setitem(j, v)

    def __delitem__(self, key: SupportsIndex | slice) -> None:
        self._note(self._low_of(key))
        super().__delitem__(key)

    def __iadd__(self, other: Iterable[T]) -> KeptList[T]:  # type: ignore[override,misc]
        self._note(len(self))
        super().__iadd__(other)
        return self

    def __imul__(self, n: SupportsIndex) -> KeptList[T]:
        self._note(len(self) if operator.index(n) >= 1 else 0)
        super().__imul__(n)
        return self

    def append(self, value: T) -> None:
        self._note(len(self))
        super().append(value)

    def extend(self, values: Iterable[T]) -> None:
        self._note(len(self))
        super().extend(values)

    def insert(self, index: SupportsIndex, value: T) -> None:
        self._note(min(self._at(index), len(self)))
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> T:
        self._note(self._at(index))
        return super().pop(index)

    def remove(self, value: T) -> None:
        self._note(0)  # the position is only known after a search: the conservative answer
        super().remove(value)

    def clear(self) -> None:
        self._note(0)
        super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._note(0)
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._note(0)
        super().reverse()


def first_difference(a: Sequence[object], b: Sequence[object]) -> int | None:
    """The first index at which ``a`` and ``b`` hold different objects (over the shorter of
    the two), or None: a C-level sweep."""
    return next(compress(count(), map(operator.is_not, a, b)), None)


def first_unequal(a: Sequence[object], b: Sequence[object]) -> int | None:
    """The first index at which ``a`` and ``b`` hold unequal items (``==``; for items that
    compare by identity, as :class:`~pipeline.messages.Message` does, the first other object),
    over the shorter of the two, or None. Lists compare in C with an identity shortcut per item:
    one comparison when they agree, else a binary search of slice comparisons -- about twice
    the items' comparisons, five times quicker than a sweep of ``is not`` calls."""
    if not (type(a) is list and type(b) is list):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    if (a == b) if len(a) == len(b) else (a[:n] == b[:n]):
        return None
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[lo:hi] != b[lo:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_start(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items ``a`` and ``b`` share (equal by value): :func:`first_unequal`,
    or the shorter length where they agree throughout. A request mostly repeats the last one's
    very objects, which compare in C by identity; where they part (a client moving its
    ``cache_control`` mark changes the message that held it) the binary search finds it."""
    same = first_unequal(a, b)
    return min(len(a), len(b)) if same is None else same


class InputLog:
    """The input of the last pass, to find where this pass's input first differs.

    A position is unchanged when it holds the very same message object (messages compare by
    identity: an equal-looking copy may still serialise otherwise).
    """

    def __init__(self) -> None:
        self.inputs: list[Message] = []
        """The last input taken (this log's own list, brought up to date in place)."""
        self.removed: list[Message] = []
        """What the last :meth:`take` dropped from :attr:`inputs` (from its first change on)."""
        self._kept: KeptList[Message] | None = None
        self._stamp = 0

    def take(self, messages: Sequence[Message]) -> int:
        """Make ``messages`` the remembered input; return the first position that differs.

        The same :class:`~pipeline.kept_list.KeptList` as last time says itself where it
        changed. Otherwise the common case, a history that only grew, costs the new tail plus
        one C-level sweep: the tail is appended first so that both lists have the same length,
        and ``list == list`` compares element identity without copying either list.
        """
        old = self.inputs
        n_old, n_new = len(old), len(messages)
        first: int | None = None
        if messages is self._kept:
            low = self._kept.changed_since(self._stamp)
            first = min(n_old, n_new) if low is None else min(low, n_old, n_new)
        elif n_new >= n_old and isinstance(messages, list):
            old.extend(messages[n_old:])
            if old == messages:
                self.removed = []
                self._remember(messages)
                return n_old
            del old[n_old:]
        if first is None:
            found = first_unequal(messages, old)  # records compare by identity
            first = min(n_old, n_new) if found is None else found
        if first < len(old):
            self.removed = old[first:]
            del old[first:]
        elif self.removed:
            self.removed = []
        if len(old) < n_new:
            old.extend(messages[len(old) :])
        self._remember(messages)
        return first

    def _remember(self, messages: Sequence[Message]) -> None:
        if isinstance(messages, KeptList):
            self._kept, self._stamp = messages, messages.stamp
        else:
            self._kept = None

    def clear(self) -> None:
        """Forget the last input: the next :meth:`take` reports a change at position 0."""
        self.inputs = []
        self.removed = []
        self._kept = None
