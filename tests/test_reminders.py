"""Claude Code 2.1 reminders (``REMINDER`` attachments) and recorded whole messages
(``WIRE_MESSAGE``) on the wire, with exact expected output.

Every example also checks that ``to_api`` leaves the records as they were (their content is
compared with a deep copy taken before) and that ``WireCache`` gives ``to_api``'s answer on
every prefix, both from a fresh cache and from one cache fed the prefixes in order.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pipeline import Message, TranscriptWriter, load_transcript, to_api
from pipeline.messages import REMINDER, WIRE_MESSAGE, Usage
from pipeline.wire.cache import WireCache
from tests.builders import assistant, results, tool_result, tool_use, user_text

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def reminder(*texts: str) -> Message:
    """A reminder attachment as the loader builds it from a 2.1 ``rendered`` list."""
    return Message(type="attachment", content=[text(t) for t in texts], subtype=REMINDER)


def attachment(*texts: str) -> Message:
    """A plain (pre-2.1) attachment."""
    return Message(type="attachment", content=[text(t) for t in texts])


def wire_user(content: Any) -> Message:
    return Message.user(content, subtype=WIRE_MESSAGE)


def wire_assistant(content: Any, message_id: str | None = None) -> Message:
    return Message.assistant(content, message_id=message_id, subtype=WIRE_MESSAGE)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def wire(messages: Sequence[Message]) -> list[Any]:
    """``to_api(messages)``, after checking that no record changed and that ``WireCache``
    agrees on every prefix (a fresh cache each time, and one cache fed the prefixes in
    order)."""
    before = copy.deepcopy([m.content for m in messages])
    before_json = _dumps(before)
    grown = WireCache()
    for k in range(len(messages) + 1):
        prefix = list(messages[:k])
        expected = _dumps(to_api(prefix))
        assert _dumps(WireCache().to_api(prefix)) == expected, f"fresh cache, prefix {k}"
        assert _dumps(grown.to_api(prefix)) == expected, f"grown cache, prefix {k}"
    out = to_api(messages)
    after = [m.content for m in messages]
    assert after == before and _dumps(after) == before_json, "a record was mutated"
    return list(out)


def last(messages: Sequence[Message]) -> Any:
    """The content of the last wire message."""
    return wire(messages)[-1]["content"]


R1 = "<system-reminder>\nfirst\n</system-reminder>"
R2 = "<system-reminder>\nsecond\n</system-reminder>"
R3 = "<system-reminder>\nthird\n</system-reminder>"


def tool_turn(*ids: str, mid: str = "m1") -> Message:
    return assistant(mid, *(tool_use(t) for t in ids))


# -- before the prompt ------------------------------------------------------------------------


def test_reminders_after_a_string_prompt_go_before_it_with_a_seam() -> None:
    msgs = [user_text("fix the bug"), reminder(R1), reminder(R2), reminder(R3)]
    assert wire(msgs) == [
        {"role": "user", "content": [text(R1), text(R2), text(R3 + "\n"), text("fix the bug")]}
    ]


def test_reminders_before_a_prompt_that_starts_with_an_image_have_no_seam() -> None:
    prompt = Message.user([IMAGE, text("what is this?")])
    msgs = [prompt, reminder(R1), reminder(R2), reminder(R3)]
    assert wire(msgs) == [
        {"role": "user", "content": [text(R1), text(R2), text(R3), IMAGE, text("what is this?")]}
    ]


def test_reminders_before_a_list_prompt_that_starts_with_text_have_a_seam() -> None:
    prompt = Message.user([text("look"), IMAGE])
    msgs = [prompt, reminder(R1)]
    assert wire(msgs) == [{"role": "user", "content": [text(R1 + "\n"), text("look"), IMAGE]}]


def test_a_reminder_with_several_rendered_texts_keeps_them_in_order() -> None:
    msgs = [user_text("go"), reminder(R1, R2), reminder(R3)]
    assert last(msgs) == [text(R1), text(R2), text(R3 + "\n"), text("go")]


def test_a_reminder_right_after_an_assistant_starts_a_user_message_a_prompt_joins() -> None:
    head = [user_text("go"), assistant("m1", text("done"))]
    alone = [*head, reminder(R1)]
    assert wire(alone)[-1] == {"role": "user", "content": [text(R1)]}
    msgs = [*alone, reminder(R2), user_text("next")]
    assert wire(msgs) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [text("done")]},
        {"role": "user", "content": [text(R1), text(R2 + "\n"), text("next")]},
    ]


def test_tool_results_after_a_reminder_only_message_come_first() -> None:
    msgs = [
        user_text("go"),
        tool_turn("a", "b"),
        reminder(R1),
        results(tool_result("b", "B")),
        results(tool_result("a", "A")),
    ]
    assert last(msgs) == [tool_result("b", "B"), tool_result("a", "A"), text(R1)]


# -- into the tool result ---------------------------------------------------------------------


def test_a_reminder_after_one_tool_result_goes_into_its_stripped_string_content() -> None:
    record = results(tool_result("a", "line 1\nline 2\t\n"))
    msgs = [user_text("go"), tool_turn("a"), record, reminder(R1)]
    assert wire(msgs) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [tool_use("a")]},
        {"role": "user", "content": [tool_result("a", "line 1\nline 2\n\n" + R1)]},
    ]
    assert record.content == [tool_result("a", "line 1\nline 2\t\n")]  # the record's copy


def test_a_reminder_after_three_parallel_results_goes_into_the_last_one() -> None:
    # completion order b, c, a: the last tool_result on the wire is a's
    msgs = [
        user_text("go"),
        tool_turn("a", "b", "c"),
        results(tool_result("b", "B\t\n")),
        results(tool_result("c", "C \n")),
        results(tool_result("a", "A  \t\n")),
        reminder(R1),
    ]
    assert last(msgs) == [
        tool_result("b", "B\t\n"),
        tool_result("c", "C \n"),
        tool_result("a", "A\n\n" + R1),
    ]


def test_a_reminder_after_a_list_result_gets_a_text_block() -> None:
    msgs = [
        tool_turn("a"),
        results(tool_result("a", [text("see the image "), IMAGE])),
        reminder(R1),
    ]
    assert last(msgs) == [tool_result("a", [text("see the image "), IMAGE, text(R1)])]


def test_two_reminders_after_a_string_result() -> None:
    msgs = [tool_turn("a"), results(tool_result("a", "out\n")), reminder(R1), reminder(R2)]
    assert last(msgs) == [tool_result("a", "out\n\n" + R1 + "\n\n" + R2)]


def test_two_reminders_after_a_list_result() -> None:
    msgs = [tool_turn("a"), results(tool_result("a", [IMAGE])), reminder(R1), reminder(R2)]
    assert last(msgs) == [tool_result("a", [IMAGE, text(R1), text(R2)])]


def test_a_reminder_with_two_texts_after_a_string_result() -> None:
    msgs = [tool_turn("a"), results(tool_result("a", "out")), reminder(R1, R2)]
    assert last(msgs) == [tool_result("a", "out\n\n" + R1 + "\n\n" + R2)]


@pytest.mark.parametrize("content", [None, "missing"])
def test_a_reminder_after_a_result_without_content(content: Any) -> None:
    block = tool_result("a", content)
    if content == "missing":
        del block["content"]
    msgs = [tool_turn("a"), results(block), reminder(R1)]
    assert last(msgs) == [{"type": "tool_result", "tool_use_id": "a", "content": "\n\n" + R1}]


def test_each_reminder_goes_into_the_result_it_follows() -> None:
    msgs = [
        tool_turn("a", "b"),
        results(tool_result("a", "A")),
        reminder(R1),
        results(tool_result("b", "B")),
        reminder(R2),
    ]
    assert last(msgs) == [tool_result("a", "A\n\n" + R1), tool_result("b", "B\n\n" + R2)]


def test_a_reminder_after_results_and_a_prompt_goes_into_the_last_result() -> None:
    """The message holds a tool_result: the reminder goes there, not before the prompt."""
    msgs = [
        tool_turn("a"),
        results(tool_result("a", "A"), text("and a remark")),
        reminder(R1),
    ]
    assert last(msgs) == [tool_result("a", "A\n\n" + R1), text("and a remark")]


def test_extra_fields_of_the_result_block_are_kept() -> None:
    block = tool_result("a", "boom ", is_error=True, cache_control={"type": "ephemeral"})
    msgs = [tool_turn("a"), results(block), reminder(R1)]
    assert last(msgs) == [
        tool_result("a", "boom\n\n" + R1, is_error=True, cache_control={"type": "ephemeral"})
    ]


# -- plain attachments keep the old rule ------------------------------------------------------


def test_a_plain_attachment_after_a_prompt_follows_it_with_a_seam() -> None:
    msgs = [user_text("fix the bug"), attachment("ctx")]
    assert wire(msgs) == [{"role": "user", "content": [text("fix the bug\n"), text("ctx")]}]


def test_a_plain_attachment_after_a_result_is_a_block_after_it() -> None:
    msgs = [tool_turn("a"), results(tool_result("a", "out \n")), attachment("ctx")]
    assert last(msgs) == [tool_result("a", "out \n"), text("ctx")]


def test_a_plain_attachment_before_a_prompt_stays_before_it() -> None:
    msgs = [assistant("m1", text("done")), attachment("ctx"), user_text("next")]
    assert last(msgs) == [text("ctx\n"), text("next")]


def test_a_reminder_goes_before_a_prompt_and_its_plain_attachment() -> None:
    msgs = [user_text("go"), attachment("ctx"), reminder(R1)]
    assert last(msgs) == [text(R1 + "\n"), text("go\n"), text("ctx")]


# -- the transcript round trip ----------------------------------------------------------------


def _history() -> list[Message]:
    usage = Usage(input_tokens=10, output_tokens=5)
    return [
        user_text("fix the bug"),
        reminder(R1),
        reminder(R2, R3),
        assistant("m1", tool_use("a"), tool_use("b"), usage=usage),
        results(tool_result("b", "B \t\n")),
        results(tool_result("a", [text("listing"), IMAGE])),
        reminder(R1),
        assistant("m2", tool_use("c"), usage=usage),
        results(tool_result("c", "C")),
        reminder(R2),
        reminder(R3),
        assistant("m3", text("done"), usage=usage),
        reminder(R1),
        user_text("next"),
    ]


def test_the_history_renders_as_expected() -> None:
    assert wire(_history()) == [
        {"role": "user", "content": [text(R1), text(R2), text(R3 + "\n"), text("fix the bug")]},
        {"role": "assistant", "content": [tool_use("a"), tool_use("b")]},
        {
            "role": "user",
            "content": [
                tool_result("b", "B \t\n"),
                tool_result("a", [text("listing"), IMAGE, text(R1)]),
            ],
        },
        {"role": "assistant", "content": [tool_use("c")]},
        {"role": "user", "content": [tool_result("c", "C\n\n" + R2 + "\n\n" + R3)]},
        {"role": "assistant", "content": [text("done")]},
        {"role": "user", "content": [text(R1 + "\n"), text("next")]},
    ]


def test_writer_and_loader_round_trip_reminders(tmp_path: Path) -> None:
    history = _history()
    path = tmp_path / "session.jsonl"
    TranscriptWriter(path, "sess-reminders").append_messages(history)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[2]["type"] == "attachment"
    assert lines[2]["attachment"] == {"type": "reminder"}
    assert lines[2]["rendered"] == [{"content": R2}, {"content": R3}]
    loaded = load_transcript(path).messages
    assert [(m.type, m.subtype, m.uuid) for m in loaded] == [
        (m.type, m.subtype, m.uuid) for m in history
    ]
    assert [m.is_reminder for m in loaded] == [m.is_reminder for m in history]
    for got, want in zip(loaded, history, strict=True):
        if want.is_reminder:
            assert got.content == want.content
    assert _dumps(wire(loaded)) == _dumps(wire(history))


# -- recorded whole messages ------------------------------------------------------------------


def test_two_consecutive_user_wire_messages_stay_two_messages() -> None:
    msgs = [wire_user("first"), wire_user([text("second")])]
    assert wire(msgs) == [
        {"role": "user", "content": "first"},
        {"role": "user", "content": [text("second")]},
    ]


def test_a_tool_result_record_does_not_merge_into_a_wire_message() -> None:
    msgs = [
        wire_assistant([tool_use("a"), tool_use("b")]),
        wire_user([tool_result("a", "A")]),
        results(tool_result("b", "B")),
    ]
    assert wire(msgs) == [
        {"role": "assistant", "content": [tool_use("a"), tool_use("b")]},
        {"role": "user", "content": [tool_result("a", "A")]},
        {"role": "user", "content": [tool_result("b", "B")]},
    ]


def test_a_reminder_does_not_go_into_a_wire_message() -> None:
    head = [wire_assistant([tool_use("a")]), wire_user([tool_result("a", "A ")])]
    assert wire([*head, reminder(R1)])[1:] == [
        {"role": "user", "content": [tool_result("a", "A ")]},
        {"role": "user", "content": [text(R1)]},
    ]
    assert wire([*head, reminder(R1), user_text("next")])[1:] == [
        {"role": "user", "content": [tool_result("a", "A ")]},
        {"role": "user", "content": [text(R1 + "\n"), text("next")]},
    ]


def test_a_plain_attachment_or_prompt_does_not_merge_into_a_wire_message() -> None:
    msgs = [wire_user("recorded"), attachment("ctx"), user_text("next")]
    assert wire(msgs) == [
        {"role": "user", "content": "recorded"},
        {"role": "user", "content": [text("ctx\n"), text("next")]},
    ]


def test_a_wire_message_merges_into_nothing_before_it() -> None:
    msgs = [
        user_text("go"),
        wire_user("recorded prompt"),
        assistant("X", text("fragment")),
        wire_assistant([text("recorded answer")], message_id="X"),
    ]
    assert wire(msgs) == [
        {"role": "user", "content": "go"},
        {"role": "user", "content": "recorded prompt"},
        {"role": "assistant", "content": [text("fragment")]},
        {"role": "assistant", "content": [text("recorded answer")]},
    ]


def test_a_fragment_does_not_merge_into_an_assistant_wire_message() -> None:
    msgs = [user_text("go"), wire_assistant([text("recorded")], message_id="X")]
    msgs.append(assistant("X", text("later fragment")))
    assert wire(msgs)[1] == {"role": "assistant", "content": [text("recorded")]}
