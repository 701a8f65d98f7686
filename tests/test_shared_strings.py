"""Messages parsed from requests share their keys and short values: the same value, one string
object for every equal key, role, block type, id and tool name; content is left as it is."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from pipeline.wire.shared_strings import SHARED_MAX, shared, shared_message


def _parsed(k: int) -> Any:
    text = json.dumps(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "z" * 500},
                {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": k}},
            ],
        }
    )
    return json.loads(text)  # new strings for every key and value, as the decoder makes them


def test_two_messages_parsed_apart_share_their_keys_and_short_values() -> None:
    one, two = shared_message(_parsed(1)), shared_message(_parsed(2))
    assert one == _parsed(1) and two == _parsed(2)
    assert [list(b) for b in one["content"]] == [list(b) for b in _parsed(1)["content"]]
    key_one, key_two = next(iter(one)), next(iter(two))
    assert key_one is key_two  # "role"
    assert one["role"] is two["role"]
    result_one, result_two = one["content"][0], two["content"][0]
    assert result_one["type"] is result_two["type"]
    assert result_one["tool_use_id"] is not result_two["tool_use_id"]  # ids: see below
    assert result_one["content"] is not result_two["content"]  # content: not interned
    use_one, use_two = one["content"][1], two["content"][1]
    assert use_one["name"] is use_two["name"]
    assert next(iter(use_one["input"])) is next(iter(use_two["input"]))


def test_tool_ids_are_shared_among_the_messages_parsed_together_not_interned() -> None:
    ids: dict[str, str] = {}
    one, two = shared_message(_parsed(1), ids), shared_message(_parsed(2), ids)
    call_one, result_one = one["content"][1]["id"], one["content"][0]["tool_use_id"]
    assert call_one is result_one is two["content"][0]["tool_use_id"]
    assert ids == {"toolu_01": "toolu_01"}
    # never the interpreter's table: an id is held by its conversation alone
    fresh = json.loads('"toolu_' + "q" * 20 + '"')
    shared_message({"role": "user", "content": [{"type": "tool_result", "tool_use_id": fresh}]})
    assert sys.intern("toolu_" + "q" * 20) is not fresh


def test_long_values_and_what_is_not_a_message_are_left_alone() -> None:
    long = "x" * (SHARED_MAX + 1)
    assert shared(long) is long
    assert shared_message("text") == "text"
    odd: dict[Any, Any] = {1: "not a JSON key", "role": "user"}
    assert shared_message(odd) is odd
    string_content = json.loads('{"role": "user", "content": "hello"}')
    assert shared_message(string_content) == {"role": "user", "content": "hello"}


def test_a_message_s_small_dicts_share_their_key_tables() -> None:
    """A parsed message's dicts (the message, its blocks, a call's input) are plain dicts to
    every reader -- equal, in order, written alike, changed alike -- that share one key
    table among the dicts of the same keys: ~110 bytes a block of three keys, ~190 each as
    dicts of their own."""
    import tracemalloc

    import msgspec

    parsed = [_parsed(k) for k in range(4_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        shared_all = [shared_message(m) for m in parsed]
        each = (tracemalloc.get_traced_memory()[0] - before) / len(parsed)
    finally:
        tracemalloc.stop()
    # a message, its list, two blocks, an input dict and two ids: ~820 bytes as dicts of
    # their own
    assert each < 620
    for k in (0, 1, 3_999):
        one = shared_all[k]
        assert type(one) is dict and all(type(b) is dict for b in one["content"])
        assert one == _parsed(k)
        assert json.dumps(one) == json.dumps(_parsed(k))
        assert msgspec.json.encode(one) == msgspec.json.encode(_parsed(k))
    block, plain = shared_all[0]["content"][0], _parsed(0)["content"][0]
    for change in (
        lambda d: d.update(content="changed"),
        lambda d: d.update(is_error=True),
        lambda d: d.pop("tool_use_id"),
        lambda d: d.setdefault("cache_control", {"type": "ephemeral"}),
    ):
        change(block)
        change(plain)
        assert block == plain and list(block) == list(plain)
    assert shared_all[1]["content"][0]["content"] == "z" * 500  # the others are left alone


def test_hostile_keys_get_dicts_of_their_own_and_the_shapes_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys that are not lower-case names (``__class__``, ``__dict__``), too many keys, and
    key orders past the bound all give plain dicts, with the same keys and values."""
    from pipeline.wire import shared_strings

    monkeypatch.setattr(shared_strings, "_shapes", {})  # the process's own stay as they are

    for block in (
        {"__class__": 1, "type": "x"},
        {"__dict__": {"a": 1}},
        {"Type": "x", "ID": "y"},
        {f"k{i}": i for i in range(20)},
        {"a" * 40: 1},
    ):
        message = shared_message({"role": "user", "content": [dict(block)]})
        assert message["content"][0] == block
        assert list(message["content"][0]) == list(block)
    for i in range(shared_strings.MAX_SHAPES + 50):
        keys = (f"k{i}", "type")
        made = shared_strings.keyed_alike(keys, [i, "t"])
        assert made == dict(zip(keys, [i, "t"], strict=True)) and list(made) == list(keys)
    assert len(shared_strings._shapes) <= shared_strings.MAX_SHAPES
    # past the bound the orders start afresh: a later conversation's blocks still share
    # (a new table's first ~30 dicts are larger: the interpreter sizes their values down
    # one dict at a time)
    later = [
        shared_message({"role": "user", "content": [{"type": "text", "text": f"{k}"}]})
        for k in range(40)
    ]
    block = later[-1]["content"][0]
    assert sys.getsizeof(block) < sys.getsizeof({"type": "text", "text": "39"})
    # a key no table is made for is kept by nothing here, nor interned when long
    long_key = "".join(["k"] * 100_000)
    message = shared_message({"role": "user", "content": [{long_key: 1, "type": "x"}]})
    assert all(len(k) <= 32 for keys in shared_strings._shapes for k in keys)
    (kept,) = [k for k in message["content"][0] if len(k) > 64]
    assert sys.intern("".join(["k"] * 100_000)) is not kept


def test_a_shared_message_holds_its_block_lists_at_their_size() -> None:
    """A held conversation keeps every message's content list (and a tool_result's list of
    blocks): each is as long as its items, with no room left for more (a comprehension's
    list of one block keeps room for three more: 24 bytes)."""
    inner = [{"type": "text", "text": "out"}]
    message = shared_message(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": inner}],
        }
    )
    content = message["content"]
    assert sys.getsizeof(content) == sys.getsizeof([None])
    assert sys.getsizeof(content[0]["content"]) == sys.getsizeof([None])
    assert content[0]["content"] == inner and content[0]["content"] is not inner
    many = shared_message({"role": "user", "content": [{"type": "text", "text": "a"}] * 5})
    assert sys.getsizeof(many["content"]) == sys.getsizeof([None] * 5)


def test_keys_and_values_of_different_lengths_are_refused() -> None:
    from pipeline.wire.shared_strings import keyed_alike

    for keys, values in ((("type", "text"), ["t"]), (("type",), ["t", "x"])):
        with pytest.raises(ValueError, match="keys for"):
            keyed_alike(keys, values)
