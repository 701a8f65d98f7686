"""Message digests: the fast writer gives the standard library's bytes, so every digest (and
every chain a store names records by) is what it always was."""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.results.keys import content_digest
from pipeline.wire import canonical
from pipeline.wire.canonical import canonical_json as _canonical
from pipeline.wire.digests import message_digest


def _reference(value: Any) -> bytes:
    """The canonical form as the standard library alone writes it."""
    text = json.dumps(
        value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr
    )
    return text.encode("utf-8", "surrogatepass")


class _Colour(enum.Enum):
    RED = 1


class _Level(enum.IntEnum):
    LOW = 1


class _Text(str):
    pass


_LEAVES = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            _Colour.RED,
            _Level.LOW,
            _Text("sub"),
            b"bytes",
            datetime.date(2026, 12, 5),
            uuid.UUID(int=7),
            frozenset({1}),
        ]
    ),
)
_KEYS = st.one_of(st.text(), st.integers(), st.booleans(), st.builds(_Text, st.text()))
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(), inner, max_size=4),
        st.dictionaries(_KEYS, inner, max_size=3),
    ),
    max_leaves=20,
)


@settings(max_examples=600)
@given(_VALUES)
def test_canonical_is_the_standard_librarys(value: Any) -> None:
    try:
        expected = _reference(value)
    except (TypeError, ValueError):  # keys it cannot sort or write: the same error, here too
        with pytest.raises((TypeError, ValueError)):
            _canonical(value)
        return
    assert _canonical(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        1e16,  # msgspec writes 1e16, the standard library 1e+16
        [{"x": 1e-7}],
        float("nan"),  # null against NaN
        _Colour.RED,  # 1 against its repr
        {"when": datetime.date(2026, 12, 5)},
        {"a\ud800": "lone \udfff"},  # msgspec refuses a lone surrogate
        {2: "a", 1: "b"},  # and keys that are not strings, with sorted keys
    ],
)
def test_what_msgspec_writes_otherwise_is_written_the_old_way(value: Any) -> None:
    assert _canonical(value) == _reference(value)


def test_message_digest_is_unchanged() -> None:
    message = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "é\n\x00 \u2028 😀"},
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
        ],
    }
    plain = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "é\n\x00 \u2028 😀"},
            {"type": "text", "text": "hi"},
        ],
    }
    expected = hashlib.blake2b(_reference(plain), digest_size=16).digest()
    assert message_digest(message) == expected


def _stripped(content: Any) -> Any:
    """Content with ``cache_control`` off every block and the blocks a block's content list
    holds, each block a new dict (how the digest was always defined)."""
    if not isinstance(content, list):
        return content
    out = []
    for b in content:
        if isinstance(b, Mapping):
            plain = {k: v for k, v in b.items() if k != "cache_control"}
            if isinstance(plain.get("content"), list):
                plain["content"] = _stripped(plain["content"])
            out.append(plain)
        else:
            out.append(b)
    return out


class _Blocks(list[Any]):
    """A content list of a type of its own."""


class _Block(Mapping[str, Any]):
    """A block that is a mapping but not a dict."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


_BLOCK_KEYS = st.sampled_from(["type", "text", "content", "cache_control", "id", "é"])
_CONTENT = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(_Blocks),
        st.dictionaries(_BLOCK_KEYS, inner, max_size=4),
        st.dictionaries(_BLOCK_KEYS, inner, max_size=4).map(_Block),
    ),
    max_leaves=12,
)


_MARK = {"type": "ephemeral"}


@settings(max_examples=300, deadline=None)
@given(_CONTENT)
@example([{"type": "tool_result", "content": _Blocks([{"text": "a", "cache_control": _MARK}])}])
@example([{"content": [{"content": [{"text": "deep", "cache_control": _MARK}]}]}])
@example([_Block({"type": "text", "text": "a", "cache_control": _MARK})])
@example([_Block({"type": "text", "text": "a"})])
@example(_Blocks([{"type": "text", "text": "a"}]))
@example([{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": _MARK}])
def test_a_digest_is_of_the_content_less_its_breakpoints_whatever_shape_it_has(
    content: Any,
) -> None:
    """Content left as it is where no block holds ``cache_control`` (no copy), and copied
    where one does, digests as the content less every breakpoint always did."""
    message = {"role": "user", "content": content}
    reference = {"role": "user", "content": _stripped(content)}
    try:
        expected: bytes | str = hashlib.blake2b(_canonical(reference), digest_size=16).digest()
    except (ValueError, TypeError, RecursionError) as exc:
        expected = type(exc).__name__
    try:
        got: bytes | str = message_digest(message)
    except (ValueError, TypeError, RecursionError) as exc:
        got = type(exc).__name__
    assert got == expected


def _nested(depth: int) -> list[Any]:
    value: list[Any] = ["x"]
    for _ in range(depth - 1):
        value = [value]
    return value


def _outcome(write: Any, value: Any) -> bytes | str:
    try:
        return bytes(write(value))
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__


@pytest.mark.parametrize("depth", [255, 256, 257, 990, 993, 994, 995, 996, 1000, 100_000])
def test_nesting_is_written_or_refused_as_before(depth: int) -> None:
    value = _nested(depth)
    old = _outcome(_reference, value)
    new = _outcome(_canonical, value)
    assert new == (old if isinstance(old, bytes) else "ValueError")


def _within(seconds: float, work: Any) -> Any:
    """``work()``'s result or exception, failing the test if it does not end in time."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(work())
        except Exception as exc:
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, "did not end"
    return done[0]


def test_a_value_that_holds_itself_is_refused_at_once() -> None:
    alone: list[Any] = []
    alone.append(alone)
    spread: list[Any] = []
    spread += [spread, spread]
    inner: dict[str, Any] = {}
    inner["k"] = inner
    for value in (alone, spread, inner):
        found = _within(10, lambda value=value: _canonical(value))
        assert isinstance(found, ValueError) and "Circular" in str(found)


class _Backwards(str):
    def __lt__(self, other: object) -> bool:
        return str(self) > str(other)


def test_keys_sorted_by_their_own_rules_are_sorted_so() -> None:
    value = {_Backwards("a"): 1, _Backwards("b"): 2}
    assert _canonical(value) == _reference(value) == b'{"b":2,"a":1}'


def test_many_values_are_written_the_old_way_alike() -> None:
    value = {"input": {"rows": list(range(100_000)), "name": "n"}}
    assert canonical.leaf_kinds(value) == canonical.OTHER
    assert _canonical(value) == _reference(value)


def test_a_result_digest_is_unchanged() -> None:
    blocks = [
        {"type": "text", "text": "é 😀", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
    ]
    plain = [{k: v for k, v in b.items() if k != "cache_control"} for b in blocks]
    expected = hashlib.sha256(b"j" + _reference(plain)).hexdigest()[:32]
    assert content_digest(blocks) == expected
    with pytest.raises(ValueError, match="tool result content nested too deeply"):
        content_digest([_nested(100_000)])
