"""The canonical JSON that digests are taken of (:func:`canonical_json`): the bytes every
stored digest was made from, written fast where that gives the same bytes.

msgspec writes a string that is not ASCII from the UTF-8 form CPython makes of it and then
keeps on the string for as long as it lives (``PyUnicode_AsUTF8AndSize``): a message a
conversation holds would carry a second copy of each such text from its first digest on (0.12x
of a real Claude Code session's wire text). :func:`leaf_kinds` tells a value msgspec writes
without one (:data:`ASCII`) from one the standard library writes alike instead (:data:`ALIKE`),
whose strings it only reads."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import msgspec

from pipeline.wire.deferred import DeferredText, text_or

__all__ = [
    "ALIKE",
    "ASCII",
    "NUMBERS",
    "OTHER",
    "WRITTEN_ALIKE",
    "canonical_json",
    "leaf_kinds",
    "plain_ascii",
]

# what json.dumps builds on every call with these options: built once
# (an output held out of memory as its text: pipeline.wire.held_outputs)
_ENCODER = json.JSONEncoder(
    sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=text_or(repr)
)
_FAST = msgspec.json.Encoder(order="sorted")
_ALIKE: frozenset[type] = frozenset({str, int, bool, type(None)})
"""The leaf types msgspec writes as the standard library does, byte for byte (a float is
written differently by each in some cases; an enum, a date, bytes... by msgspec as a value and
by the standard library as its ``repr``)."""
WRITTEN_ALIKE = _ALIKE - {str}
"""The leaf types other than strings that msgspec and the standard library write alike (what
:func:`plain_ascii` may be told to take for a value either may write)."""
NUMBERS = WRITTEN_ALIKE | {float}
"""The leaf types other than strings that JSON gives (what :func:`plain_ascii` may be told to
take)."""
_GLANCE = 6
"""Levels below a message read at a glance before it is walked (:func:`plain_ascii`): its
content list, a block, a tool call's input and three levels within it."""
_DEEPEST = 256
"""Levels of nesting the fast writer is used for: far above any message, far below where
either writer gives up (the standard library's limit depends on the caller's stack)."""
_MOST_ITEMS = 1 << 16
"""Values looked at, at most, before leaving a value to the standard library."""


def canonical_json(value: Any, *, what: str = "content") -> bytes:
    """``value`` as compact JSON with sorted keys, as the standard library writes it
    (``ensure_ascii=False``, a lone surrogate passed through, anything else by its ``repr``),
    in UTF-8; ``ValueError`` naming ``what`` for a value nested too deeply to write, the
    standard library's for one that holds itself. What msgspec writes alike
    (:func:`leaf_kinds` says :data:`ASCII`), it writes: ~3-7 times as fast, and digests are a new
    conversation's first cost (one per message)."""
    if plain_ascii(value, _GLANCE, WRITTEN_ALIKE) or leaf_kinds(value) == ASCII:
        try:
            return _FAST.encode(value)
        except (TypeError, ValueError, RecursionError):
            pass  # a lone surrogate, a key that is not a string: the standard library's way
    try:
        text = _ENCODER.encode(value)
    except RecursionError:
        raise ValueError(f"{what} nested too deeply") from None
    return text.encode("utf-8", "surrogatepass")


ASCII = 0
"""Dicts with keys of the exact type ``str``, lists, tuples and leaves of :data:`_ALIKE`'s exact
types, every string ASCII: msgspec writes them as the standard library does."""
ALIKE = 1
"""As :data:`ASCII`, but with a string that is not ASCII or a held output
(:class:`~pipeline.wire.deferred.DeferredText`, written as its text) among them: the standard
library writes it alike without keeping a UTF-8 copy on a string (see the module)."""
OTHER = 2
"""Anything else, or more than :data:`_DEEPEST` levels deep or :data:`_MOST_ITEMS` values."""


def leaf_kinds(value: Any) -> int:
    """:data:`ASCII`, :data:`ALIKE` or :data:`OTHER`: which of the two writers ``value`` is
    for (the two give up on nesting at different depths, and a value that holds itself would
    never end: the standard library says so)."""
    level, items, kinds = [value], 0, ASCII
    for _ in range(_DEEPEST):
        items += len(level)
        if items > _MOST_ITEMS:
            return OTHER
        below: list[Any] = []
        push = below.extend
        for v in level:
            kind = type(v)
            if kind is dict:
                for key in v:
                    if type(key) is not str:  # a subclass may sort by its own rules
                        return OTHER
                    if not key.isascii():
                        kinds = ALIKE
                push(v.values())
            elif kind is list or kind is tuple:
                push(v)
            elif kind is str:
                if not v.isascii():  # a flag the string carries
                    kinds = ALIKE
            elif kind is DeferredText:
                kinds = ALIKE
            elif kind not in _ALIKE:
                return OTHER
        if not below:
            return kinds
        level = below
    return OTHER


def plain_ascii(value: Any, depth: int, scalars: frozenset[type]) -> bool:
    """Whether ``value`` is a dict of ASCII ``str`` keys whose values are ASCII strings,
    leaves of the exact ``scalars`` types or, within ``depth`` levels below it, such dicts and
    lists of them: what most messages are, told without :func:`leaf_kinds`' walk (about a
    third of its cost). With :data:`NUMBERS`, a value msgspec writes without a UTF-8 copy of
    any string and that holds no lone surrogate; without ``float``, one :func:`leaf_kinds`
    calls :data:`ASCII` when it holds no more than its values (and that msgspec writes as the
    standard library does whatever their number). False says nothing: walk it."""
    if type(value) is not dict:
        return False
    for key in value:
        if type(key) is not str or not key.isascii():
            return False
    return _plain_items(value.values(), depth, scalars)


def _plain_items(items: Iterable[Any], depth: int, scalars: frozenset[type]) -> bool:
    for v in items:
        kind = type(v)
        if kind is str:
            if not v.isascii():
                return False
        elif kind is dict:
            if not depth or not plain_ascii(v, depth - 1, scalars):
                return False
        elif kind is list:
            if not depth or not _plain_items(v, depth - 1, scalars):
                return False
        elif kind not in scalars:
            return False
    return True
