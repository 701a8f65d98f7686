"""Request values compared as JSON tells them apart (``pipeline.wire.same_values``)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from pipeline.wire.same_values import same_start, same_value


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, True),
        (0, False),
        (1, 1.0),
        (True, 1.0),
        (0.0, -0.0),
        ({"a": [1, {"b": 1}]}, {"a": [1, {"b": True}]}),
        ([{"x": 2}], [{"x": 2.0}]),
        ({"k": (1, 2)}, {"k": [1, 2]}),  # a tuple is not a list, though JSON writes both alike
        (float("nan"), float("nan")),
        ({"a": 1}, {"a": 2}),
    ],
)
def test_values_python_holds_equal_but_json_tells_apart_differ(a: Any, b: Any) -> None:
    assert not same_value(a, b)
    assert not same_value(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1),
        ("x", "x"),
        (None, None),
        (-0.0, -0.0),
        ({"a": 1, "b": [True, 1.5, None]}, {"b": [True, 1.5, None], "a": 1}),  # key order
        ([{"type": "text", "text": "é"}], [{"type": "text", "text": "é"}]),
    ],
)
def test_values_json_writes_alike_are_the_same(a: Any, b: Any) -> None:
    assert same_value(a, b)


def test_a_deep_value_is_walked_without_recursion() -> None:
    a: Any = 1
    b: Any = True
    for _ in range(300):  # 600 levels, walked on a stack of its own
        a, b = [a], [b]
        a, b = {"k": a}, {"k": b}
    assert a == b  # by Python's ==
    assert not same_value(a, b)


def test_same_start_looks_only_where_the_objects_differ() -> None:
    class Loud:
        """Equal to anything; its type matches only itself (no look should reach it)."""

        def __eq__(self, other: object) -> bool:
            raise AssertionError("compared")

        __hash__ = object.__hash__

    shared = Loud()
    a = [shared, {"n": 1}, {"n": 1}, {"n": 2}]
    b = [shared, {"n": 1}, {"n": True}, {"n": 2}]
    assert same_start(a, b, 4) == 2
    assert same_start(a, b, 2) == 2
    assert same_start(a, a, 4) == 4
    assert same_start(a, b[:1], 4) == 1  # no further than the shorter list


def test_a_value_nested_past_the_c_comparison_s_recursion_is_walked() -> None:
    """Python's own ``==`` recurses in C and gives up (``RecursionError``) on values nested a
    few hundred levels deep: the comparison goes on on a stack of its own, never raising."""
    a: Any = [1]
    b: Any = [1]
    c: Any = [True]
    for _ in range(5_000):
        a, b, c = [a], [b], [c]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000)  # the interpreter's own: a test before may have raised it
    try:
        with pytest.raises(RecursionError):
            _ = a == b
        assert same_value(a, b)
        assert not same_value(a, c)
        assert not same_value(a, [[a]])
    finally:
        sys.setrecursionlimit(limit)


def test_same_start_takes_the_first_positions_given_as_compared() -> None:
    a: list[Any] = [{"n": 1}, {"n": 1}, {"n": 2}]
    b: list[Any] = [{"n": True}, {"n": 1}, {"n": 2.0}]
    assert same_start(a, b, 3) == 0
    assert same_start(a, b, 3, start=1) == 2  # (the caller compared the first already)
    assert same_start(a, b, 2, start=1) == 2
