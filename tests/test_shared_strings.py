"""Messages parsed from requests share their keys and short values: the same value, one string
object for every equal key, role, block type, id and tool name; content is left as it is."""

from __future__ import annotations

import json
import sys
from typing import Any

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
