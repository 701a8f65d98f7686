"""Unit tests of the message model, `to_api` and the pairing check."""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from typing import Any, get_args, get_type_hints

import pytest
import typing_extensions
from anthropic.types.assistant_message_param import AssistantMessageParam
from anthropic.types.user_message_param import UserMessageParam
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from pipeline import Message, Usage, to_api
from pipeline.messages import uuid5_text
from pipeline.testing import assert_same_messages
from pipeline.wire.pairing import PairingError, PairingProblem, check_pairing, ensure_paired
from tests.builders import assistant, results, tool_result, tool_use, user_text


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def system(subtype: str | None, content: str = "") -> Message:
    return Message(type="system", subtype=subtype, content=content)


def progress() -> Message:
    return Message(type="progress")


def attachment(content: Any) -> Message:
    return Message(type="attachment", content=content)


# --------------------------------------------------------------------------------------------
# Validation against the anthropic SDK's own param types
# --------------------------------------------------------------------------------------------


def _block_param_types() -> dict[str, type]:
    """``{"text": TextBlockParam, "tool_result": ToolResultBlockParam, ...}`` read off the SDK."""
    content_t = get_type_hints(UserMessageParam)["content"]
    (iterable_t,) = [a for a in get_args(content_t) if a is not str]
    (union_t,) = get_args(iterable_t)
    out: dict[str, type] = {}
    for td in get_args(union_t):
        if typing_extensions.is_typeddict(td):
            for literal in get_args(get_type_hints(td)["type"]):
                out[literal] = td
    return out


_BLOCK_TYPES = _block_param_types()
_MESSAGE_TYPES: dict[str, Any] = {"user": UserMessageParam, "assistant": AssistantMessageParam}


def assert_sdk_message_param(param: Any) -> None:
    """``param`` is a dict the SDK's ``MessageParam`` accepts: right keys, value types, blocks."""
    assert isinstance(param, dict)
    td = _MESSAGE_TYPES[param["role"]]
    assert set(param) <= set(get_type_hints(td)), param.keys()
    TypeAdapter(td).validate_python(param)  # role literal, content str | iterable
    content = param["content"]
    if isinstance(content, str):
        return
    assert isinstance(content, list)
    for block in content:
        block_td = _BLOCK_TYPES[block["type"]]
        assert set(block) <= set(get_type_hints(block_td)), (block["type"], block.keys())
        TypeAdapter(block_td).validate_python(block)  # required keys and value types


def test_sdk_validator_rejects_bad_shapes() -> None:
    """The helper itself must be able to fail."""
    for bad in (
        {"role": "user", "content": [{"type": "text"}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
        {"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]},
        {"role": "assistant", "content": "x", "extra": 1},
        {"role": "user", "content": [{"type": "text", "text": 3}]},
    ):
        with pytest.raises(Exception):  # noqa: B017 - pydantic or assertion error
            assert_sdk_message_param(bad)


# --------------------------------------------------------------------------------------------
# to_api: dropping
# --------------------------------------------------------------------------------------------


def test_progress_and_non_local_command_system_records_are_dropped() -> None:
    msgs = [
        progress(),
        user_text("hello"),
        progress(),
        system("turn_duration", "12s"),
        system(None, "plain system text"),
        system("stop_hook_summary", "hook ran"),
        assistant("msg_1", text("hi there")),
        system("informational", "x"),
        progress(),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [text("hi there")]},
    ]


def test_only_dropped_records_give_empty_request() -> None:
    assert to_api([progress(), system("turn_duration", "1s")]) == []
    assert to_api([]) == []


def test_local_command_system_record_becomes_user_text() -> None:
    out = "<local-command-stdout>Total cost: $0.10</local-command-stdout>"
    msgs = [system("local_command", out)]
    assert to_api(msgs) == [{"role": "user", "content": [text(out)]}]


def test_local_command_merges_with_following_prompt_at_a_text_seam() -> None:
    msgs = [
        user_text("/cost"),
        system("local_command", "<local-command-stdout>$1</local-command-stdout>"),
        user_text("now continue"),
    ]
    assert to_api(msgs) == [
        {
            "role": "user",
            "content": [
                text("/cost\n"),
                text("<local-command-stdout>$1</local-command-stdout>\n"),
                text("now continue"),
            ],
        }
    ]


def test_empty_local_command_is_dropped() -> None:
    assert to_api([user_text("a"), system("local_command", "")]) == [
        {"role": "user", "content": "a"}
    ]


# --------------------------------------------------------------------------------------------
# to_api: attachments and user merging
# --------------------------------------------------------------------------------------------


def test_attachment_after_prompt_is_folded_into_it() -> None:
    msgs = [user_text("fix the bug"), attachment([text("<system-reminder>ctx</system-reminder>")])]
    assert to_api(msgs) == [
        {
            "role": "user",
            "content": [text("fix the bug\n"), text("<system-reminder>ctx</system-reminder>")],
        }
    ]


def test_attachment_before_prompt_is_folded_into_it() -> None:
    msgs = [attachment([text("ctx")]), user_text("question")]
    assert to_api(msgs) == [{"role": "user", "content": [text("ctx\n"), text("question")]}]


def test_attachment_after_tool_results_joins_that_user_message() -> None:
    msgs = [
        user_text("go"),
        assistant("msg_1", tool_use("t1")),
        results(tool_result("t1", "out")),
        attachment([text("reminder")]),
        assistant("msg_2", text("done")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [tool_use("t1")]},
        {"role": "user", "content": [tool_result("t1", "out"), text("reminder")]},
        {"role": "assistant", "content": [text("done")]},
    ]


def test_empty_attachment_is_dropped_and_lone_string_survives() -> None:
    msgs = [user_text("hi"), attachment(""), attachment([])]
    out = to_api(msgs)
    assert out == [{"role": "user", "content": "hi"}]
    assert isinstance(out[0]["content"], str)


def test_lone_string_user_message_stays_a_string() -> None:
    msgs = [user_text("what is 2+2?"), assistant("m1", text("4")), user_text("thanks")]
    out = to_api(msgs)
    assert out == [
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": [text("4")]},
        {"role": "user", "content": "thanks"},
    ]
    assert isinstance(out[2]["content"], str)


def test_user_block_list_stays_a_list() -> None:
    out = to_api([Message.user([text("hi")])])
    assert out == [{"role": "user", "content": [text("hi")]}]


def test_consecutive_user_messages_merge_with_newline_at_text_seam() -> None:
    first = [text("a")]
    msgs = [Message.user(first), user_text("b"), user_text("c")]
    out = to_api(msgs)
    assert out == [{"role": "user", "content": [text("a\n"), text("b\n"), text("c")]}]
    assert first == [text("a")], "the seam newline must not be written into the input block"


def test_no_newline_at_a_seam_that_is_not_text_text() -> None:
    msgs = [
        user_text("q"),
        assistant("m1", tool_use("t1")),
        results(tool_result("t1", "r1")),
        user_text("note"),
    ]
    out = to_api(msgs)
    assert out[-1] == {"role": "user", "content": [tool_result("t1", "r1"), text("note")]}


def test_merged_user_messages_hoist_tool_results_first_stably() -> None:
    msgs = [
        user_text("go"),
        assistant("m1", tool_use("t1"), tool_use("t2"), tool_use("t3")),
        results(tool_result("t1", "r1")),
        user_text("interjection"),
        results(tool_result("t2", "r2")),
        Message.user([text("tail"), tool_result("t3", "r3")]),
    ]
    out = to_api(msgs)
    assert len(out) == 3
    # Hoisting happens at every merge, so by the time "tail" arrives "interjection" is the last
    # block: that is a text/text seam and gets the newline.
    assert out[2] == {
        "role": "user",
        "content": [
            tool_result("t1", "r1"),
            tool_result("t2", "r2"),
            tool_result("t3", "r3"),
            text("interjection\n"),
            text("tail"),
        ],
    }


def test_single_user_message_with_text_before_tool_result_is_hoisted() -> None:
    msgs = [
        user_text("go"),
        assistant("m1", tool_use("t1")),
        Message.user([text("see below"), tool_result("t1", "r")]),
    ]
    assert to_api(msgs)[2]["content"] == [tool_result("t1", "r"), text("see below")]


def test_tool_result_block_fields_are_kept() -> None:
    block = tool_result("t1", [text("x")], is_error=True, cache_control={"type": "ephemeral"})
    out = to_api([user_text("go"), assistant("m1", tool_use("t1")), results(block)])
    assert out[2]["content"] == [block]


# --------------------------------------------------------------------------------------------
# to_api: assistant fragments
# --------------------------------------------------------------------------------------------


def test_consecutive_same_id_fragments_merge() -> None:
    thinking = {"type": "thinking", "thinking": "hmm", "signature": "sig"}
    msgs = [
        user_text("q"),
        assistant("msg_1", thinking),
        progress(),
        assistant("msg_1", text("Let me look.")),
        assistant("msg_1", tool_use("t1")),
        results(tool_result("t1", "r1")),
        assistant("msg_2", text("ok")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [thinking, text("Let me look."), tool_use("t1")]},
        {"role": "user", "content": [tool_result("t1", "r1")]},
        {"role": "assistant", "content": [text("ok")]},
    ]


def test_parallel_tool_use_fragments_with_results_in_between_merge() -> None:
    """Claude Code writes a result as soon as its tool ran, before the next fragment."""
    msgs = [
        user_text("q"),
        assistant("msg_1", tool_use("t1")),
        results(tool_result("t1", "r1")),
        assistant("msg_1", tool_use("t2")),
        results(tool_result("t2", "r2")),
    ]
    out = to_api(msgs)
    assert out == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [tool_use("t1"), tool_use("t2")]},
        {"role": "user", "content": [tool_result("t1", "r1"), tool_result("t2", "r2")]},
    ]
    assert check_pairing(out) == []


def test_interleaved_ids_merge_back_exactly_as_spec_describes() -> None:
    """``[asst X, user trA, asst Y, user trB, asst X, user trC]``."""
    msgs = [
        user_text("go"),
        assistant("X", tool_use("A")),
        results(tool_result("A", "ra")),
        assistant("Y", tool_use("B")),
        results(tool_result("B", "rb")),
        assistant("X", tool_use("C")),
        results(tool_result("C", "rc")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [tool_use("A"), tool_use("C")]},
        {"role": "user", "content": [tool_result("A", "ra")]},
        {"role": "assistant", "content": [tool_use("B")]},
        {"role": "user", "content": [tool_result("B", "rb"), tool_result("C", "rc")]},
    ]


def test_same_id_fragment_does_not_merge_across_a_text_user_message() -> None:
    msgs = [
        user_text("q"),
        assistant("X", text("one")),
        user_text("interrupt"),
        assistant("X", text("two")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [text("one")]},
        {"role": "user", "content": "interrupt"},
        {"role": "assistant", "content": [text("two")]},
    ]


def test_fragments_without_id_never_merge() -> None:
    msgs = [
        user_text("q"),
        Message.assistant([text("a")]),
        Message.assistant([text("b")]),
    ]
    assert to_api(msgs)[1:] == [
        {"role": "assistant", "content": [text("a")]},
        {"role": "assistant", "content": [text("b")]},
    ]


def test_different_ids_back_to_back_stay_separate() -> None:
    out = to_api([user_text("q"), assistant("X", text("a")), assistant("Y", text("b"))])
    assert [p["role"] for p in out] == ["user", "assistant", "assistant"]


# --------------------------------------------------------------------------------------------
# to_api: compaction slicing
# --------------------------------------------------------------------------------------------


def test_slices_after_the_last_compact_boundary() -> None:
    msgs = [
        user_text("old 1"),
        assistant("m1", text("old reply")),
        system("compact_boundary", "Conversation compacted"),
        user_text("middle"),
        assistant("m2", text("middle reply")),
        system("compact_boundary", "Conversation compacted"),
        user_text("summary of everything"),
        assistant("m3", text("continuing")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "summary of everything"},
        {"role": "assistant", "content": [text("continuing")]},
    ]


def test_slices_at_a_compact_summary_user_record() -> None:
    msgs = [
        user_text("old"),
        assistant("m1", text("old reply")),
        Message.user("This session is being continued...", is_compact_summary=True),
        assistant("m2", text("next")),
        user_text("more"),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": "This session is being continued..."},
        {"role": "assistant", "content": [text("next")]},
        {"role": "user", "content": "more"},
    ]


def test_claude_code_2x_boundary_then_summary() -> None:
    msgs = [
        user_text("old"),
        assistant("m1", tool_use("t0")),
        results(tool_result("t0", "old result")),
        system("compact_boundary"),
        Message.user("summary", is_compact_summary=True),
        attachment([text("restored file")]),
        assistant("m2", text("go on")),
    ]
    assert to_api(msgs) == [
        {"role": "user", "content": [text("summary\n"), text("restored file")]},
        {"role": "assistant", "content": [text("go on")]},
    ]


def test_a_later_summary_wins_over_an_earlier_boundary() -> None:
    msgs = [
        system("compact_boundary"),
        user_text("first summary"),
        assistant("m1", text("a")),
        Message.user("second summary", is_compact_summary=True),
    ]
    assert to_api(msgs) == [{"role": "user", "content": "second summary"}]


# --------------------------------------------------------------------------------------------
# to_api: output shape and purity
# --------------------------------------------------------------------------------------------


def _rich_conversation() -> list[Message]:
    thinking = {"type": "thinking", "thinking": "plan", "signature": "c2ln"}
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    return [
        progress(),
        user_text("please look"),
        attachment([text("<system-reminder>todo</system-reminder>")]),
        assistant("m1", thinking, usage=Usage(input_tokens=5, output_tokens=3)),
        assistant("m1", text("Looking.")),
        assistant("m1", tool_use("t1", "Read", file_path="/x")),
        assistant("m1", tool_use("t2", "Bash", command="ls")),
        results(tool_result("t1", [text("line 1"), image])),
        system("turn_duration", "3s"),
        results(tool_result("t2", "a\nb", is_error=False)),
        assistant("m2", text("Done.")),
        system("local_command", "<local-command-stdout>ok</local-command-stdout>"),
        user_text("thanks"),
    ]


def test_output_is_accepted_by_the_sdk_param_types() -> None:
    out = to_api(_rich_conversation())
    assert [p["role"] for p in out] == ["user", "assistant", "user", "assistant", "user"]
    for param in out:
        assert_sdk_message_param(param)
    json.dumps(out)  # plain JSON: what the SDK sends


def test_to_api_does_not_mutate_its_input() -> None:
    msgs = _rich_conversation()
    snapshot = copy.deepcopy(msgs)
    first = to_api(msgs)
    assert_same_messages(msgs, snapshot)
    assert to_api(msgs) == first
    # and editing the output's containers does not reach back into the input
    first[0]["content"].append(text("x"))  # type: ignore[union-attr]
    assert_same_messages(msgs, snapshot)


# --------------------------------------------------------------------------------------------
# Pairing check
# --------------------------------------------------------------------------------------------


def _req(*params: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in params]


def test_valid_request_reports_nothing() -> None:
    req = _req(
        ("user", "q"),
        ("assistant", [text("x"), tool_use("a"), tool_use("b")]),
        ("user", [tool_result("b", "rb"), tool_result("a", "ra"), text("note")]),
        ("assistant", [text("done")]),
        ("user", "next"),
    )
    assert check_pairing(req) == []
    ensure_paired(req)  # does not raise
    assert check_pairing([]) == []


def test_unanswered_tool_use() -> None:
    req = _req(
        ("user", "q"),
        ("assistant", [tool_use("a"), tool_use("b")]),
        ("user", [tool_result("a", "ra")]),
    )
    assert check_pairing(req) == [PairingProblem("unanswered_tool_use", "b", 1)]


def test_tool_use_at_the_end_is_unanswered() -> None:
    req = _req(("user", "q"), ("assistant", [tool_use("a")]))
    assert check_pairing(req) == [PairingProblem("unanswered_tool_use", "a", 1)]


def test_tool_use_answered_only_by_a_later_message_is_unanswered_and_orphan() -> None:
    req = _req(
        ("user", "q"),
        ("assistant", [tool_use("a")]),
        ("user", "no results here"),
        ("assistant", [text("x")]),
        ("user", [tool_result("a", "late")]),
    )
    assert check_pairing(req) == [
        PairingProblem("unanswered_tool_use", "a", 1),
        PairingProblem("orphan_tool_result", "a", 4),
    ]


def test_orphan_tool_result() -> None:
    req = _req(
        ("user", [tool_result("z", "no use")]),
        ("assistant", [text("x")]),
        ("user", [tool_result("y", "also none")]),
    )
    assert check_pairing(req) == [
        PairingProblem("orphan_tool_result", "z", 0),
        PairingProblem("orphan_tool_result", "y", 2),
    ]


def test_duplicate_tool_result() -> None:
    req = _req(
        ("user", "q"),
        ("assistant", [tool_use("a")]),
        ("user", [tool_result("a", "1"), tool_result("a", "2")]),
    )
    assert check_pairing(req) == [PairingProblem("duplicate_tool_result", "a", 2)]


def test_duplicate_tool_use() -> None:
    req = _req(
        ("user", "q"),
        ("assistant", [tool_use("a")]),
        ("user", [tool_result("a", "1")]),
        ("assistant", [tool_use("a")]),
        ("user", [tool_result("a", "2")]),
    )
    assert check_pairing(req) == [PairingProblem("duplicate_tool_use", "a", 3)]


def test_ensure_paired_raises_naming_every_problem() -> None:
    req = _req(
        ("user", [tool_result("ghost", "x")]),
        ("assistant", [tool_use("lost")]),
        ("user", "nothing"),
    )
    with pytest.raises(PairingError) as info:
        ensure_paired(req)
    assert info.value.problems == [
        PairingProblem("orphan_tool_result", "ghost", 0),
        PairingProblem("unanswered_tool_use", "lost", 1),
    ]
    assert "'ghost'" in str(info.value) and "'lost'" in str(info.value)
    assert "message 1" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_to_api_output_of_paired_records_passes_the_check() -> None:
    assert check_pairing(to_api(_rich_conversation())) == []


# --------------------------------------------------------------------------------------------
# Usage and Message
# --------------------------------------------------------------------------------------------


def test_usage_from_api_mapping() -> None:
    usage = Usage.from_mapping(
        {
            "input_tokens": 3,
            "cache_creation_input_tokens": 13835,
            "cache_read_input_tokens": 11515,
            "output_tokens": 13,
            "cache_creation": {"ephemeral_5m_input_tokens": 0},
            "service_tier": "standard",
        }
    )
    assert usage == Usage(
        input_tokens=3,
        output_tokens=13,
        cache_creation_input_tokens=13835,
        cache_read_input_tokens=11515,
    )
    assert usage.input_side == 3 + 13835 + 11515
    assert usage.total == 3 + 13835 + 11515 + 13
    assert Usage.from_mapping(usage.to_mapping()) == usage


def test_usage_missing_or_null_counts_are_zero() -> None:
    assert Usage.from_mapping({"input_tokens": 7, "cache_read_input_tokens": None}) == Usage(
        input_tokens=7
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("input_tokens", "12"),
        ("output_tokens", -1),
        ("cache_creation_input_tokens", 1.5),
        ("cache_read_input_tokens", True),
        ("input_tokens", [1]),
    ],
)
def test_usage_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"usage\.{field}\b"):
        Usage.from_mapping({field: value})


@pytest.mark.parametrize("bad", ["tool", "User", "", "human"])
def test_message_rejects_unknown_types(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown message type"):
        Message(type=bad)  # type: ignore[arg-type]


def test_message_views() -> None:
    assert Message.user("hi").blocks == [text("hi")]
    assert Message.user("").blocks == []
    assert Message.assistant([text("a")], message_id="m", model="<synthetic>").is_synthetic
    assert system("compact_boundary").is_compact_boundary
    assert not system("local_command").is_compact_boundary
    m = Message.assistant([text("a")], message_id="m", usage=Usage(input_tokens=1))
    changed = m.with_content([text("b")])
    assert changed.content == [text("b")]
    assert (changed.uuid, changed.message_id, changed.usage) == (m.uuid, "m", Usage(1))
    assert m.content == [text("a")]
    assert Message.user("x").uuid != Message.user("x").uuid


def test_with_content_keeps_every_other_field() -> None:
    """with_content passes the fields by position: every one, set to a value that is not its
    default, comes back (a new field that is keyword-only or left out fails here)."""
    values: dict[str, Any] = {
        "type": "assistant",
        "content": [text("a")],
        "uuid": "u1",
        "message_id": "m1",
        "model": "claude-x",
        "usage": Usage(input_tokens=7),
        "stop_reason": "end_turn",
        "subtype": "s",
        "timestamp": "2026-12-01T00:00:00.000Z",
        "is_compact_summary": True,
        "is_sidechain": True,
        "is_meta": True,
    }
    assert set(values) == {f.name for f in dataclasses.fields(Message)}
    m = Message(**values)
    changed = m.with_content([text("b")])
    assert changed.content == [text("b")]
    assert {n: getattr(changed, n) for n in values if n != "content"} == {
        n: v for n, v in values.items() if n != "content"
    }


@given(raw=st.binary(min_size=16, max_size=16))
def test_a_version_5_uuid_text_is_the_uuid_modules(raw: bytes) -> None:
    assert uuid5_text(raw) == str(uuid.UUID(bytes=raw, version=5))


@pytest.mark.parametrize("size", [0, 15, 17])
def test_a_version_5_uuid_needs_16_bytes(size: int) -> None:
    with pytest.raises(ValueError, match="16"):
        uuid5_text(bytes(size))
