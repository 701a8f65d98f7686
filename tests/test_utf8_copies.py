"""Writing a value whose strings are not all ASCII leaves no UTF-8 copy on its strings.

msgspec writes such a string from the UTF-8 form CPython makes of it and keeps on it for as long
as it lives; a conversation the proxy holds would carry a second copy of every such text from
its first digest on. ``sys.getsizeof`` counts that copy."""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings

from pipeline.wire.canonical import ALIKE, ASCII, OTHER, canonical_json, leaf_kinds
from pipeline.wire.digests import message_digest
from pipeline.wire.encoding import dumps_body, fast_encode
from tests.json_values import json_values


def _message() -> Any:
    # parsed, as the body reader parses it: fresh strings
    return json.loads(
        json.dumps(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "naïve café " * 200},
                    {"type": "tool_result", "tool_use_id": "toolu_é", "content": "日本語" * 300},
                ],
            }
        )
    )


def _sizes(value: Any) -> list[int]:
    out = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(sys.getsizeof(v))
        elif isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v
    return out


@pytest.mark.parametrize(
    "write",
    [canonical_json, fast_encode, dumps_body, message_digest],
    ids=["canonical_json", "fast_encode", "dumps_body", "message_digest"],
)
def test_writing_leaves_no_utf8_copy_on_the_strings(write: Any) -> None:
    message = _message()
    before = _sizes(message)
    write(message)
    assert _sizes(message) == before


def test_msgspec_alone_leaves_one() -> None:
    """The reason (msgspec 0.23 on CPython 3.11, and earlier): a string it writes grows by its
    UTF-8 form. Should a release stop that, this test says so and the workaround can go."""
    message = _message()
    before = _sizes(message)
    msgspec.json.encode(message)
    if sum(_sizes(message)) <= sum(before):
        pytest.skip("this msgspec leaves no UTF-8 copy on the strings it writes")
    assert sum(_sizes(message)) > sum(before) + 3000


def test_the_bytes_are_msgspecs_own() -> None:
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0x300)] + ["😀", "\u2028", "日", "\U0010ffff", '"', "\\"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        value = [{"type": "text", "text": text, text: [rng.randint(-(10**20), 10**20), None]}]
        assert fast_encode(value) == msgspec.json.encode(value)
        assert dumps_body(value) == msgspec.json.encode(value)


def test_leaf_kinds() -> None:
    assert leaf_kinds({"a": ["b", 1, True, None]}) == ASCII
    assert leaf_kinds({"a": ["é"]}) == ALIKE
    assert leaf_kinds({"é": 1}) == ALIKE
    assert leaf_kinds({"a": 1.5}) == OTHER
    assert leaf_kinds({"é": 1.5}) == OTHER  # a float: msgspec writes it its own way


def test_a_lone_surrogate_is_still_written_by_the_standard_library() -> None:
    value = {"text": "é\ud800"}
    assert dumps_body(value) == json.dumps(value).encode()
    with pytest.raises(ValueError):
        fast_encode(value)


@settings(max_examples=400, deadline=None)
@given(json_values())
def test_a_value_is_written_by_the_writer_its_leaves_call_for(value: Any) -> None:
    """What a message is at a glance (ASCII text and numbers, a few levels deep) never changes
    which writer writes it: a value with a string that is not ASCII, the standard library
    (no UTF-8 copy); anything else, msgspec (its own way with a float)."""
    if leaf_kinds(value) == ALIKE:
        expected = _outcome(lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")))
    else:
        expected = _outcome(msgspec.json.encode)
    assert _outcome(fast_encode)(value) == expected(value)
    message = {"role": "user", "content": [value]}
    if isinstance(wrote := expected(value), bytes):
        wrote = b'{"role":"user","content":[' + wrote + b"]}"
    assert _outcome(fast_encode)(message) == wrote


def _outcome(write: Any) -> Any:
    """What ``write`` makes of a value as bytes, or the type of what it raises (an integer
    past 64 bits: msgspec's OverflowError)."""

    def outcome(value: Any) -> bytes | str:
        try:
            return _bytes(write(value))
        except (TypeError, ValueError, OverflowError) as exc:
            return type(exc).__name__

    return outcome


def _bytes(text: bytes | str) -> bytes:
    return text if isinstance(text, bytes) else text.encode()
