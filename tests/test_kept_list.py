"""``KeptList`` says where it changed since a stamp: never later than the first position that
really differs (a reader then redoes too little), whatever list method changed it, also once
its journal has folded old changes together."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.kept_list import InputLog, KeptList, first_difference

OPS = (
    "append",
    "extend",
    "iadd",
    "setitem",
    "setitem_same",
    "setslice",
    "delitem",
    "delslice",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "imul",
    "put",
)


def _apply(lst: list[Any], op: str, draw: Any) -> None:
    n = len(lst)
    i = draw(st.integers(-n, n - 1)) if n else 0
    new = object()
    if op == "append":
        lst.append(new)
    elif op in ("extend", "iadd"):
        more = [object() for _ in range(draw(st.integers(0, 3)))]
        if op == "extend":
            lst.extend(more)
        else:
            lst += more
    elif op == "setitem" and n:
        lst[i] = new
    elif op == "setitem_same" and n:
        lst[i] = lst[i]
    elif op == "setslice":
        a, b = sorted((draw(st.integers(-n - 1, n + 1)), draw(st.integers(-n - 1, n + 1))))
        lst[a:b] = [object() for _ in range(draw(st.integers(0, 2)))]
    elif op == "delitem" and n:
        del lst[i]
    elif op == "delslice":
        del lst[draw(st.integers(-n - 1, n + 1)) :: draw(st.sampled_from((1, 2, -1)))]
    elif op == "insert":
        lst.insert(draw(st.integers(-n - 2, n + 2)), new)
    elif op == "pop" and n:
        lst.pop(i)
    elif op == "remove" and n:
        lst.remove(lst[i])
    elif op == "clear":
        lst.clear()
    elif op == "sort":
        lst.sort(key=id)
    elif op == "reverse":
        lst.reverse()
    elif op == "imul":
        lst *= draw(st.integers(0, 2))
    elif op == "put" and n:  # several positions at once, some set to what they hold
        at = draw(st.lists(st.integers(-n, n - 1), max_size=4))
        changes = [(j, lst[j] if draw(st.booleans()) else object()) for j in at]
        if isinstance(lst, KeptList):
            lst.put(changes)
        else:
            for j, v in changes:
                lst[j] = v


def _truth(before: list[Any], after: list[Any]) -> int | None:
    """The first position at which ``after`` differs from ``before`` (None: the same)."""
    first = first_difference(before, after)
    if first is None and len(before) == len(after):
        return None
    return min(len(before), len(after)) if first is None else first


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(OPS), max_size=400), st.data())
def test_changed_since_is_never_later_than_the_truth(ops: list[str], data: st.DataObject) -> None:
    kept: KeptList[Any] = KeptList(object() for _ in range(data.draw(st.integers(0, 6))))
    snapshots: list[tuple[int, list[Any]]] = [(kept.stamp, list(kept))]
    for op in ops:
        _apply(kept, op, data.draw)
        if data.draw(st.booleans()):
            snapshots.append((kept.stamp, list(kept)))
        stamp, before = snapshots[data.draw(st.integers(0, len(snapshots) - 1))]
        said, truth = kept.changed_since(stamp), _truth(before, kept)
        if truth is not None:
            assert said is not None and said <= truth, (op, said, truth)
        if said is None:
            assert truth is None


def test_a_reader_far_behind_gets_the_lowest_change_it_missed() -> None:
    kept: KeptList[int] = KeptList(range(100))
    stamp = kept.stamp
    kept[3] = -1  # then many changes at the end fold this one into the journal's floor
    for k in range(1_000):
        kept.append(k)
    assert kept.changed_since(stamp) == 3
    recent = kept.stamp
    kept.append(0)
    assert kept.changed_since(recent) == len(kept) - 1
    assert kept.changed_since(kept.stamp) is None


def test_copies_are_plain_lists() -> None:
    kept: KeptList[int] = KeptList([1, 2, 3])
    assert type(list(kept)) is list and type(kept[:2]) is list


@pytest.mark.parametrize("kept", [True, False])
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(OPS), max_size=60), st.data())
def test_an_input_log_follows_a_kept_list_as_it_follows_any_list(
    kept: bool, ops: list[str], data: st.DataObject
) -> None:
    """What a stage's log reports: never a later position than the truth, its own copy equal
    to the input, and what it dropped is what the old input held from there on."""
    log = InputLog()
    history: list[Any] = (KeptList if kept else list)(object() for _ in range(3))
    log.take(history)
    for op in ops:
        before = list(log.inputs)
        _apply(history, op, data.draw)
        first = log.take(history)
        truth = _truth(before, history)
        assert first <= (min(len(before), len(history)) if truth is None else truth)
        assert log.inputs == history and log.inputs is not history
        assert log.removed == before[first:]


def test_a_copy_or_a_pickle_has_a_journal_of_its_own() -> None:
    import copy
    import pickle

    kept: KeptList[int] = KeptList(range(200))
    stamp = kept.stamp
    for other in (copy.copy(kept), copy.deepcopy(kept), pickle.loads(pickle.dumps(kept))):
        assert type(other) is KeptList and other == kept
        other.append(1)  # changes the copy alone
    assert kept.stamp == stamp and kept.changed_since(stamp) is None
    kept[0] = -1
    assert kept.changed_since(stamp) == 0


def test_init_called_again_is_a_change() -> None:
    kept: KeptList[str] = KeptList(["a", "b"])
    stamp = kept.stamp
    kept.__init__(["x"])  # type: ignore[misc]
    assert kept == ["x"] and kept.changed_since(stamp) == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda lst: lst.pop("a"),
        lambda lst: lst.__delitem__("a"),
        lambda lst: lst.insert("a", 1),
        lambda lst: lst.__imul__(1.5),
        lambda lst: lst.__delitem__(2**63),
    ],
)
def test_a_bad_argument_raises_what_a_list_raises(change: Any) -> None:
    with pytest.raises(Exception) as plain:
        change([1, 2])
    with pytest.raises(type(plain.value)):
        change(KeptList([1, 2]))


@pytest.mark.parametrize("at", [5, -3, "a"])
def test_put_at_a_bad_position_raises_as_setting_it_does_and_changes_nothing(at: Any) -> None:
    kept: KeptList[int] = KeptList([1, 2])
    with pytest.raises(Exception) as plain:
        [1, 2][at] = 0
    stamp = kept.stamp
    with pytest.raises(type(plain.value)):
        kept.put([(0, 9), (at, 0)])
    assert kept == [1, 2] and kept.changed_since(stamp) is None


def test_put_is_one_change_at_its_lowest_position() -> None:
    kept: KeptList[int] = KeptList(range(10))
    stamp = kept.stamp
    kept.put([(7, -7), (-8, -2), (5, -5)])
    assert kept == [0, 1, -2, 3, 4, -5, 6, -7, 8, 9]
    assert kept.stamp == stamp + 1 and kept.changed_since(stamp) == 2
    kept.put([])
    kept.put([(0, kept[0])])  # the same object again: nothing changed
    assert kept.stamp == stamp + 1
    first = kept[0]
    kept.put([(0, -100), (-10, first)])  # in order: the later entry for a position wins
    assert kept[0] is first and kept.stamp == stamp + 1
    kept.put([(9, -100), (-1, -9), (9, -99)])
    assert kept[9] == -99 and kept.changed_since(stamp + 1) == 9
