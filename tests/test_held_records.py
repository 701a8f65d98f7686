"""What a worker holds of a record log: pieces from record 0 without a gap, records past a gap
apart, snapshot chains taken up and folded in."""

from __future__ import annotations

from pipeline.store.held_records import HeldRecords, line_ended, record_number

D = "p/s/records"


def key(n: int) -> str:
    return f"{D}/{n:012d}.jsonl"


def test_records_join_the_pieces_once_the_gap_before_them_is_filled() -> None:
    held = HeldRecords(D)
    assert held.empty and held.last == -1 and key(0) not in held
    held.add(key(0), b"a\n")
    held.add(key(2), b"c")  # past a gap: held apart, its line end added when read
    assert held.last == 0 and key(2) in held and key(1) not in held
    assert held.texts() == [(b"a\n", key(0)), (b"c\n", key(2))]
    held.add(key(1), b"b\n")
    assert held.last == 2
    assert held.whole() == b"a\nb\nc\n"
    assert held.since(0) == [b"b\n", b"c\n"] and held.since(-1) == [b"a\n", b"b\n", b"c\n"]


def test_a_chain_taken_up_keeps_the_records_past_it() -> None:
    held = HeldRecords(D)
    for n in (0, 1, 5, 6):
        held.add(key(n), f"{n}\n".encode())
    assert held.last == 1
    held.take(-1, [(3, b"0\n1\n2\n3\n", "snap-0-3")])  # a base reaching 3
    assert held.last == 3 and key(5) in held and key(4) not in held
    held.take(3, [(5, b"4\n5\n", "snap-4-5")])  # a delta on the base held
    assert [k for _data, k in held.texts()] == ["snap-0-3", "snap-4-5", key(6)]
    assert held.last == 6 and held.whole() == b"0\n1\n2\n3\n4\n5\n6\n"
    held.take(3, [(6, b"4\n5\n6\n", "snap-4-6")])  # no further than what is held: kept as is
    assert [k for _data, k in held.texts()] == ["snap-0-3", "snap-4-5", key(6)]


def test_a_base_just_written_folds_the_pieces_it_holds() -> None:
    held = HeldRecords(D)
    for n in range(4):
        held.add(key(n), f"{n}\n".encode())
    held.fold(2, b"0\n1\n2\n", "base-0-2")
    assert [k for _data, k in held.texts()] == ["base-0-2", key(3)]
    assert held.ends_at(2) and not held.ends_at(1)
    assert held.since(1) is None
    held.fold(1, b"0\n1\n", "base-0-1")  # no piece ends there any more: left as it is
    assert [k for _data, k in held.texts()] == ["base-0-2", key(3)]


def test_names_and_line_ends() -> None:
    assert record_number(key(42)) == 42
    assert record_number(f"{D}/notes.txt") == -1 and record_number("000000000001.json") == -1
    assert line_ended(b"") == b"" and line_ended(b"x") == b"x\n" and line_ended(b"x\n") == b"x\n"
