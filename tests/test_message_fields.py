"""A message's own fields besides role and content, kept beside the records by name
(:mod:`pipeline.wire.message_fields`)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.messages import Message
from pipeline.wire.message_fields import MessageFields, extra_fields


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        ({"role": "user", "content": "x"}, None),
        ({"content": "x", "role": "user"}, None),
        ({"role": "user", "content": "x", "a": 1, "b": None}, {"a": 1, "b": None}),
        ({"a": [1], "role": "user", "content": "x"}, {"a": [1]}),
        ({"role": "user"}, None),
        ("not a message", None),
        (None, None),
    ],
)
def test_extra_fields_are_the_ones_besides_role_and_content(param: Any, expected: Any) -> None:
    got = extra_fields(param)
    assert got == expected
    if expected is not None:
        assert list(got or {}) == list(expected)  # in the message's order


def test_fields_follow_the_records_of_the_last_request() -> None:
    params: list[Any] = [
        {"role": "user", "content": "a", "n": 1},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c", "n": 3},
    ]
    records = [Message.from_param(p) for p in params]
    fields = MessageFields()
    fields.update((), records, params, 0)
    assert fields.by_name == {records[0].uuid: {"n": 1}, records[2].uuid: {"n": 3}}
    # the request parts after its first message: the old records from there are gone
    params2: list[Any] = [params[0], {"role": "assistant", "content": "b2", "m": 2}]
    records2 = [records[0], Message.from_param(params2[1])]
    fields.update(records[1:], records2, params2, 1)
    assert fields.by_name == {records[0].uuid: {"n": 1}, records2[1].uuid: {"m": 2}}
    # a new record of an old name (the same place in the same conversation) takes its fields
    params3: list[Any] = [{"role": "user", "content": "a"}, params2[1]]
    records3 = [Message.from_param(params3[0], uuid=records[0].uuid), records2[1]]
    fields.update(records2[:1], records3[:1], params3, 0)
    assert fields.by_name == {records2[1].uuid: {"m": 2}}
