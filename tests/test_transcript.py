"""Reading and appending Claude Code JSONL transcripts."""

from __future__ import annotations

import itertools
import json
import shutil
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pipeline import Message, TranscriptWriter, Usage, load_transcript, to_api
from pipeline.replacement import ReplacementRecord
from pipeline.results.keys import content_digest
from pipeline.transcript.read import LineProblem, TranscriptError
from pipeline.wire.pairing import check_pairing

SESSION = "5f0c1e2a-0000-4000-8000-000000000001"


def _base(rtype: str, uuid: str, parent: str | None, **extra: Any) -> dict[str, Any]:
    """The envelope every Claude Code 2.x record carries."""
    return {
        "parentUuid": parent,
        "isSidechain": False,
        "userType": "external",
        "cwd": "/home/USER/project",
        "sessionId": SESSION,
        "version": "2.1.39",
        "gitBranch": "main",
        "type": rtype,
        "uuid": uuid,
        "timestamp": "2026-02-10T21:11:56.846Z",
        **extra,
    }


def _user(uuid: str, parent: str | None, content: Any, **extra: Any) -> dict[str, Any]:
    return _base("user", uuid, parent, message={"role": "user", "content": content}, **extra)


def _assistant(
    uuid: str, parent: str | None, msg_id: str, block: dict[str, Any], output_tokens: int
) -> dict[str, Any]:
    return _base(
        "assistant",
        uuid,
        parent,
        requestId="req_1",
        message={
            "model": "claude-opus-4-6",
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "content": [block],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 3,
                "cache_creation_input_tokens": 1200,
                "cache_read_input_tokens": 11515,
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                "output_tokens": output_tokens,
                "service_tier": "standard",
            },
        },
    )


def _write(path: Path, records: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


THINKING = {"type": "thinking", "thinking": "Check the logs.", "signature": "c2ln"}
BASH = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "ls"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"}
REPLACEMENT = (
    "<persisted-output>\nOutput too large (58.6KB). Full output saved to: /x/toolu_01.txt\n\n"
    "Preview (first 2KB):\na.txt\n...\n</persisted-output>"
)


def _session_records() -> list[Any]:
    return [
        {"type": "file-history-snapshot", "messageId": "u1", "snapshot": {}},
        _base("progress", "p1", None, data={"type": "hook_progress", "hookEvent": "SessionStart"}),
        _user("u1", "p1", "why does the server not start?", todos=[]),
        _assistant("a1", "u1", "msg_01", THINKING, output_tokens=13),
        _assistant("a2", "a1", "msg_01", BASH, output_tokens=87),
        _user(
            "u2",
            "a2",
            [RESULT],
            toolUseResult={"stdout": "a.txt\nb.txt\n(structured, larger)", "stderr": ""},
        ),
        _base("system", "s1", "u2", subtype="turn_duration", content="", durationMs=1234),
        _base(
            "system",
            "s2",
            "s1",
            subtype="local_command",
            content="<local-command-stdout>ok</local-command-stdout>",
        ),
        {
            "type": "content-replacement",
            "sessionId": SESSION,
            "replacements": [
                {"kind": "tool-result", "tool_use_id": "toolu_01", "replacement": REPLACEMENT}
            ],
        },
        {"type": "mystery-record", "sessionId": SESSION, "payload": [1, 2, 3]},
        {"type": "queue-operation", "operation": "enqueue", "sessionId": SESSION},
        _base(
            "attachment",
            "t1",
            "s2",
            attachment={"type": "content", "content": [{"type": "text", "text": "reminder"}]},
        ),
        _assistant("a3", "t1", "msg_02", {"type": "text", "text": "Fixed."}, output_tokens=5),
        {"type": "summary", "summary": "Server start fix", "leafUuid": "a3"},
    ]


def test_loads_a_claude_code_session(tmp_path: Path) -> None:
    path = _write(tmp_path / "session.jsonl", _session_records())
    t = load_transcript(path)

    assert t.path == path
    assert t.session_id == SESSION
    assert [(m.type, m.uuid) for m in t.messages] == [
        ("progress", "p1"),
        ("user", "u1"),
        ("assistant", "a1"),
        ("assistant", "a2"),
        ("user", "u2"),
        ("system", "s1"),
        ("system", "s2"),
        ("attachment", "t1"),
        ("assistant", "a3"),
    ]
    progress, u1, a1, a2, u2, s1, s2, att, a3 = t.messages
    assert u1.content == "why does the server not start?"
    assert a1.content == [THINKING] and a2.content == [BASH]
    assert (a1.message_id, a2.message_id, a3.message_id) == ("msg_01", "msg_01", "msg_02")
    assert a2.model == "claude-opus-4-6"
    assert a1.usage == Usage(
        input_tokens=3, output_tokens=13, cache_creation_input_tokens=1200,
        cache_read_input_tokens=11515,
    )  # fmt: skip
    assert a2.usage is not None and a2.usage.output_tokens == 87
    assert a2.usage.input_side == 3 + 1200 + 11515
    assert u2.content == [RESULT]  # what the API saw, not the structured toolUseResult
    assert (s1.subtype, s2.subtype) == ("turn_duration", "local_command")
    assert s2.content == "<local-command-stdout>ok</local-command-stdout>"
    assert att.content == [{"type": "text", "text": "reminder"}]
    assert u1.timestamp == "2026-02-10T21:11:56.846Z"
    assert progress.content == ""

    assert t.skipped_types == Counter(
        {"file-history-snapshot": 1, "mystery-record": 1, "queue-operation": 1, "summary": 1}
    )
    assert t.replacement_records == [ReplacementRecord("toolu_01", REPLACEMENT)]
    assert t.problems == [] and t.sidechain_skipped == 0

    assert to_api(t.messages) == [
        {"role": "user", "content": "why does the server not start?"},
        {"role": "assistant", "content": [THINKING, BASH]},
        {
            "role": "user",
            "content": [
                RESULT,
                {"type": "text", "text": "<local-command-stdout>ok</local-command-stdout>\n"},
                {"type": "text", "text": "reminder"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Fixed."}]},
    ]


def test_blocks_from_different_lines_share_their_key_strings(tmp_path: Path) -> None:
    # one copy of "tool_use_id" per block was a tenth of a long session's memory
    again = [
        {**r, "uuid": r["uuid"] + "-again"} if isinstance(r, dict) and "uuid" in r else r
        for r in _session_records()
    ]  # the same content in other records (a record repeated exactly is read once)
    path = _write(tmp_path / "session.jsonl", _session_records() + again)
    results = [
        b
        for m in load_transcript(path).messages
        if isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]
    uses = [
        b
        for m in load_transcript(path).messages
        if isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_use"
    ]
    assert len(results) == len(uses) == 2
    for blocks in (results, uses, [u["input"] for u in uses]):
        first = {k: k for k in blocks[0]}
        assert all(first[k] is k for b in blocks[1:] for k in b if k in first)
    assert results[1] == RESULT  # same values, same key order


def test_compact_summary_and_meta_flags(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "s.jsonl",
        [
            _base("system", "b1", None, subtype="compact_boundary", content="Compacted"),
            _user("u1", "b1", "This session is being continued", isCompactSummary=True),
            _user("u2", "u1", "<command-name>/cost</command-name>", isMeta=True),
        ],
    )
    b1, u1, u2 = load_transcript(path).messages
    assert b1.is_compact_boundary
    assert u1.is_compact_summary and not u1.is_meta
    assert u2.is_meta and not u2.is_compact_summary


# --------------------------------------------------------------------------------------------
# Sidechains
# --------------------------------------------------------------------------------------------


def _side(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "isSidechain": True}


def test_interleaved_sidechain_records_are_left_out_of_the_main_thread(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "s.jsonl",
        [
            _user("m1", None, "main prompt"),
            _side(_user("x1", None, "sub-agent task")),
            _assistant("m2", "m1", "msg_main", BASH, 3),
            _side(_assistant("x2", "x1", "msg_side", {"type": "text", "text": "sub"}, 2)),
            _side(_base("progress", "x3", "x2")),
            _user("m3", "m2", [RESULT]),
        ],
    )
    t = load_transcript(path)
    assert [m.uuid for m in t.messages] == ["m1", "m2", "m3"]
    assert t.sidechain_skipped == 3
    assert not any(m.is_sidechain for m in t.messages)


def test_a_sidechain_only_file_is_its_own_thread(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "agent-a1.jsonl",
        [
            _side(_user("x1", None, "sub-agent task")),
            _side(_assistant("x2", "x1", "msg_side", BASH, 2)),
            _side(_user("x3", "x2", [RESULT])),
        ],
    )
    t = load_transcript(path)
    assert [m.uuid for m in t.messages] == ["x1", "x2", "x3"]
    assert all(m.is_sidechain for m in t.messages)
    assert t.sidechain_skipped == 0


# --------------------------------------------------------------------------------------------
# Malformed lines
# --------------------------------------------------------------------------------------------

BAD_LINES: list[tuple[str, Any, str]] = [
    ("bad-json", '{"type": "user", "message": ', "malformed"),
    ("not-an-object", "[1, 2, 3]", "JSON object"),
    ("a-string", '"user"', "JSON object"),
    ("no-type", {"uuid": "q", "message": {"content": "x"}}, "type"),
    (
        "tool-result-without-id",
        _user("q", None, [{"type": "tool_result", "content": "x"}]),
        "tool_use_id",
    ),
    ("content-wrong-type", _user("q", None, 42), "string or a list"),
    ("content-non-block", _user("q", None, ["just a string"]), "content block"),
    ("user-without-message", _base("user", "q", None), "'message'"),
    (
        "tool-result-content-wrong-type",
        _user("q", None, [{"type": "tool_result", "tool_use_id": "t", "content": 7}]),
        "string or a list",
    ),
    ("bad-usage", _assistant("q", None, "m", BASH, output_tokens=-5), "usage.output_tokens"),
    (
        "bad-replacement",
        {"type": "content-replacement", "replacements": [{"tool_use_id": "t"}]},
        "replacement",
    ),
]


@pytest.mark.parametrize(("line", "reason"), [pytest.param(b[1], b[2], id=b[0]) for b in BAD_LINES])
def test_malformed_line_names_file_and_line(tmp_path: Path, line: Any, reason: str) -> None:
    good = [_user("u1", None, "hello"), _assistant("a1", "u1", "msg_1", BASH, 4)]
    # a blank line still counts: line numbers are physical lines of the file
    path = _write(tmp_path / "bad.jsonl", [good[0], "", line, good[1]])
    with pytest.raises(TranscriptError) as info:
        load_transcript(path)
    err = info.value
    assert err.line == 3
    assert err.path == str(path)
    assert str(err).startswith(f"{path}:3: ")
    assert reason in str(err)

    t = load_transcript(path, strict=False)
    assert [m.uuid for m in t.messages] == ["u1", "a1"]
    assert len(t.problems) == 1
    assert t.problems[0].line == 3
    assert reason in t.problems[0].reason


def test_non_strict_load_lists_every_bad_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", ["{", _user("u1", None, "ok"), "[]", "nope"])
    t = load_transcript(path, strict=False)
    assert [m.uuid for m in t.messages] == ["u1"]
    assert [p.line for p in t.problems] == [1, 3, 4]
    assert all(isinstance(p, LineProblem) for p in t.problems)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _conversation() -> list[Message]:
    return [
        Message.user("list the files"),
        Message.assistant(
            [THINKING],
            message_id="msg_01",
            model="claude-opus-4-6",
            usage=Usage(input_tokens=3, output_tokens=13, cache_creation_input_tokens=1200),
        ),
        Message.assistant(
            [BASH],
            message_id="msg_01",
            model="claude-opus-4-6",
            usage=Usage(input_tokens=3, output_tokens=87, cache_creation_input_tokens=1200),
            stop_reason="tool_use",
        ),
        Message.user([RESULT]),
        Message(type="system", subtype="local_command", content="<local-command-stdout>"),
        Message(type="attachment", content=[{"type": "text", "text": "reminder"}]),
        Message(type="progress"),
    ]


def _raw_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_writer_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sessions" / "s1.jsonl"
    writer = TranscriptWriter(path, SESSION)
    first = _conversation()
    # a record bound to the output it replaced, and one written before records carried a digest
    records = [
        ReplacementRecord("toolu_01", REPLACEMENT, digest=content_digest("out")),
        ReplacementRecord("toolu_00", REPLACEMENT),
    ]
    later = [
        Message.assistant([{"type": "text", "text": "Done."}], message_id="msg_02", model="m"),
        Message.user("This session is being continued", is_compact_summary=True, is_meta=True),
    ]
    writer.append_messages(first)
    writer.append_replacements(records)
    writer.append_replacements([])  # no-op
    writer.append_messages(later)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    t = load_transcript(path, strict=True)
    written = first + later
    assert len(t.messages) == len(written)
    for got, want in zip(t.messages, written, strict=True):
        assert (got.type, got.uuid, got.content) == (want.type, want.uuid, want.content)
        assert (got.message_id, got.model, got.usage) == (want.message_id, want.model, want.usage)
        assert (got.subtype, got.stop_reason) == (want.subtype, want.stop_reason)
        assert (got.is_compact_summary, got.is_meta) == (want.is_compact_summary, want.is_meta)
    assert t.replacement_records == records
    assert t.session_id == SESSION
    assert to_api(t.messages) == to_api(written)

    raw = _raw_lines(path)
    assert [r["type"] for r in raw] == [
        *(m.type for m in first),
        "content-replacement",
        *(m.type for m in later),
    ]
    chained = [r for r in raw if "uuid" in r]
    assert chained[0]["parentUuid"] is None
    for prev, rec in itertools.pairwise(chained):
        assert rec["parentUuid"] == prev["uuid"]
    assert all(r["sessionId"] == SESSION for r in raw)
    assert raw[len(first)]["replacements"] == [
        {
            "kind": "tool-result",
            "tool_use_id": "toolu_01",
            "digest": content_digest("out"),
            "replacement": REPLACEMENT,
        },
        {"kind": "tool-result", "tool_use_id": "toolu_00", "replacement": REPLACEMENT},
    ]


def test_a_new_writer_continues_the_parent_chain(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    a, b = Message.user("one"), Message.user("two")
    TranscriptWriter(path, SESSION).append_messages([a])
    TranscriptWriter(path, SESSION, agent_id="agent-7").append_messages([b])
    raw = _raw_lines(path)
    assert raw[1]["parentUuid"] == a.uuid
    assert raw[1]["agentId"] == "agent-7" and "agentId" not in raw[0]


def test_torn_last_line_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    msgs = _conversation()[:4]
    TranscriptWriter(path, SESSION).append_messages(msgs)
    torn = json.dumps(_user("torn", msgs[-1].uuid, "never finished"))
    with path.open("a", encoding="utf-8") as fh:
        fh.write(torn[: len(torn) // 2])  # the crash: half a line, no newline

    with pytest.raises(TranscriptError) as info:
        load_transcript(path)
    assert info.value.line == 5

    t = load_transcript(path, strict=False)
    assert [m.uuid for m in t.messages] == [m.uuid for m in msgs]
    assert [p.line for p in t.problems] == [5]

    # resuming appends on a fresh line: the torn one stays the only casualty
    resumed = Message.user("after restart")
    TranscriptWriter(path, SESSION).append_messages([resumed])
    t = load_transcript(path, strict=False)
    assert [m.uuid for m in t.messages] == [*(m.uuid for m in msgs), resumed.uuid]
    assert [p.line for p in t.problems] == [5]
    assert _raw_lines_lenient(path)[-1]["parentUuid"] == msgs[-1].uuid


def _raw_lines_lenient(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_a_sync_after_the_log_was_removed_makes_nothing_durable_and_does_not_fail(
    tmp_path: Path,
) -> None:
    """Records made durable after the call (a wrapped client's, in the process's sync thread)
    whose directory is gone by then (a temporary one): nothing is left to sync, and no error."""
    writer = TranscriptWriter(tmp_path / "s" / "decisions.jsonl", "s", fsync_each=False)
    writer.append_stage_record("stage", {"k": 1})
    shutil.rmtree(tmp_path / "s")
    writer.sync()
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("strict", [True, False])
def test_a_record_written_twice_is_read_once(tmp_path: Path, strict: bool) -> None:
    """A line repeated exactly (the same record twice: a prompt, a response) is read once and
    reported; a record that only shares its uuid with another is not a repeat."""
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, "s")
    prompt = Message.user("go")
    answer = Message.assistant(
        [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}],
        message_id="r1",
        usage=Usage(input_tokens=5),
    )
    result = Message.user([{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}])
    writer.append_messages([prompt, answer, result])
    lines = path.read_text().splitlines(keepends=True)
    twin = json.loads(lines[2])
    twin["message"]["content"][0]["content"] = "other"  # its uuid, another record
    path.write_text("".join([lines[0], lines[0], lines[1], lines[1], lines[2]]))
    path.write_text(path.read_text() + json.dumps(twin) + "\n")
    loaded = load_transcript(path, strict=strict)
    assert [m.uuid for m in loaded.messages] == [prompt.uuid, answer.uuid, result.uuid, result.uuid]
    assert check_pairing(to_api(loaded.messages[:3])) == []
    assert loaded.problems == []  # nothing malformed: a strict load reads it too
    assert [(p.line, p.reason) for p in loaded.repeated] == [
        (2, "repeats an earlier record: read once"),
        (4, "repeats an earlier record: read once"),
    ]


def test_records_moved_out_of_order_are_read_where_they_stand_and_listed(
    tmp_path: Path,
) -> None:
    """Records are read in file order; one whose ``parentUuid`` names a record further down
    (lines swapped by hand) is listed, so the change is named rather than silent."""
    path = tmp_path / "t.jsonl"
    writer = TranscriptWriter(path, "s")
    writer.append_messages([Message.user("go"), Message.assistant("ok", message_id="r1")])
    writer.append_messages([Message.user("more")])
    first, second, third = path.read_text().splitlines(keepends=True)
    assert load_transcript(path).out_of_order == []
    path.write_text(second + first + third)
    loaded = load_transcript(path)
    assert [m.content for m in loaded.messages] == ["ok", "go", "more"]  # as they stand
    assert [p.line for p in loaded.out_of_order] == [1]
