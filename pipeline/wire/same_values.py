"""Equality of request values as JSON tells them apart.

Python's ``==`` holds ``1``, ``1.0`` and ``True`` equal (and ``0.0`` and ``-0.0``), which a
request writes as different values: a message whose only change from the last request is such
a value must count as changed, or what was built for the old one goes on in its place.
:func:`same_value` tells them apart; :func:`same_start` applies it where it can matter at the
cost of a look at each position only: a body reader hands on the very objects of the messages
whose bytes repeat, so only a message parsed again is compared deeper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress
from operator import is_not
from typing import Any

__all__ = ["same_start", "same_value"]


def same_value(a: Any, b: Any) -> bool:
    """``a == b``, with a bool, an int and a float told apart at any depth, as are ``0.0``
    and ``-0.0`` (values JSON writes differently); other types compared by ``==`` alone."""
    if a is b:
        return True
    try:
        if a != b:  # in C: values that differ otherwise end here
            return False
    except RecursionError:  # nested past what the C comparison's recursion takes
        return _walked(a, b, values=True)
    return _walked(a, b, values=False)


def _walked(a: Any, b: Any, *, values: bool) -> bool:
    """The walk of :func:`same_value` (on a stack of its own: no recursion), for values
    equal by ``==`` (``values``: not known to be, compared here too)."""
    pairs: list[tuple[Any, Any]] = [(a, b)]
    while pairs:
        x, y = pairs.pop()
        if x is y:
            continue
        kind = type(x)
        if kind is not type(y):
            return False
        if kind is dict:
            if values and x.keys() != y.keys():
                return False
            # equal dicts hold the same keys (JSON's: strings, compared as such)
            pairs.extend((v, y[k]) for k, v in x.items())
        elif kind is list or kind is tuple:
            if values and len(x) != len(y):
                return False
            pairs.extend(zip(x, y, strict=True))
        elif kind is float:
            if x != y or (x == 0.0 and math.copysign(1.0, x) != math.copysign(1.0, y)):
                return False
        elif values and x != y:
            return False
    return True


def same_start(a: Sequence[Any], b: Sequence[Any], n: int, start: int = 0) -> int:
    """How many of the first ``n`` items of ``a`` and ``b`` (equal by ``==`` there) are the
    same value (:func:`same_value`), the first ``start`` taken as such: a position that holds
    one object in both costs no look, and the first ``start`` none at all."""
    if start < n:
        for i in compress(range(start, n), map(is_not, a[start:n], b[start:n])):
            if not same_value(a[i], b[i]):
                return i
    return min(n, len(a), len(b))
