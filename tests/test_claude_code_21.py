"""Claude Code 2.1 transcripts against what Claude Code really sent.

The corpus folder ``claude-code-2.1_scripted`` holds sessions recorded from the real CLI
(2.1.328) against a scripted Messages API, with every request body it sent
(``requests.jsonl``): the ground truth for the wire rebuild, the recorded ``api-request``
records (system prompt, tools, params) and the replay. Synthetic transcripts written here cover
what the corpus does not: a compaction with a recorded chain, a chain that cannot be verified,
unknown and ignored record types, malformed records. A last test records a fresh session where
the real CLI is installed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import Pipeline, SessionContext, TokenTracker, load_transcript, to_api
from pipeline.transcript.read import LineProblem, Transcript, TranscriptError
from pipeline.transcript.replay import CallResult, find_calls, replay_messages
from stages import default_stages
from tests.conftest import CORPUS

SCRIPTED = CORPUS / "claude-code-2.1_scripted"
RECORD = Path(__file__).resolve().parents[2] / "shared" / "tools" / "record-claude-code"
CLAUDE = Path("/tmp/claude-code-2.1.328/node_modules/.bin/claude")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _strip_cache_control(value: Any) -> Any:
    """``value`` without any ``cache_control`` key, at any depth (a new object)."""
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _session_dirs() -> list[Path]:
    if not SCRIPTED.is_dir():
        return []
    return sorted(d for d in SCRIPTED.iterdir() if d.is_dir() and (d / "requests.jsonl").exists())


def _session_params() -> list[Any]:
    dirs = _session_dirs()
    if not dirs:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no corpus at {SCRIPTED}"))]
    return [pytest.param(d, id=d.name, marks=pytest.mark.corpus) for d in dirs]


def _transcript_file(folder: Path) -> Path:
    """The session's transcript: the ``.jsonl`` next to ``requests.jsonl`` that is not it."""
    (path,) = [p for p in folder.glob("*.jsonl") if p.name != "requests.jsonl"]
    return path


def _bodies(requests_file: Path, *, main_only: bool = False) -> list[dict[str, Any]]:
    """The request bodies a session sent, in order (``main_only``: the main thread's, those
    that carry tools)."""
    bodies = [
        json.loads(line)["body"]
        for line in requests_file.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    return [b for b in bodies if b.get("tools")] if main_only else bodies


def _sent_messages(bodies: list[dict[str, Any]]) -> list[str]:
    """Per request: its ``messages`` as JSON text, ``cache_control`` removed."""
    return [_dumps(_strip_cache_control(b["messages"])) for b in bodies]


def _rebuilt(t: Transcript) -> list[str]:
    """Per call found in ``t``: ``to_api`` of the records before it, as JSON text."""
    return [_dumps(to_api(t.messages[: c.index])) for c in find_calls(t.messages)]


async def _replay(t: Transcript, root: Path, *, with_requests: bool = True) -> list[CallResult]:
    ctx = SessionContext(t.session_id or "s", root)
    requests = t.requests if with_requests else ()
    pipe = Pipeline(default_stages())
    return [r async for r in replay_messages(t.messages, pipe, ctx, requests=requests)]


# --------------------------------------------------------------------------------------------
# 1-3. The corpus sessions: rebuild, replay, recorded requests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", _session_params())
@pytest.mark.parametrize("recorded_wire", [True, False], ids=["recorded", "renderer"])
def test_every_call_rebuilds_byte_for_byte(folder: Path, recorded_wire: bool) -> None:
    """``to_api`` of the records before each call is exactly what that call sent: through the
    recorded wire and through the renderer alone (the records render to it by themselves)."""
    t = load_transcript(_transcript_file(folder), recorded_wire=recorded_wire)
    sent = _sent_messages(_bodies(folder / "requests.jsonl"))
    calls = find_calls(t.messages)
    assert len(calls) == len(sent) > 1
    for call, got, expected in zip(calls, _rebuilt(t), sent, strict=True):
        assert got == expected, f"call {call.number} ({call.message_id})"
    assert (t.wire_check.replaced, t.wire_check.unverified) == (0, 0)
    assert not t.unknown_types and not t.problems


@pytest.mark.parametrize("folder", _session_params())
@pytest.mark.asyncio
async def test_replay_with_default_stages_sends_what_was_sent(folder: Path, tmp_path: Path) -> None:
    """The replay through the default stages, told each call's system prompt and tools, sends
    the recorded messages on every call, persisting nothing."""
    t = load_transcript(_transcript_file(folder))
    sent = [_strip_cache_control(b["messages"]) for b in _bodies(folder / "requests.jsonl")]
    results = await _replay(t, tmp_path / "store")
    assert len(results) == len(sent)
    for r, expected in zip(results, sent, strict=True):
        assert r.request == expected, f"call {r.call.number}"
        assert not r.persisted and not r.persist_failed
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


@pytest.mark.parametrize("folder", _session_params())
def test_recorded_requests_hold_model_system_and_tools(folder: Path) -> None:
    """One ``RecordedRequest`` per call: the body's model, tools and system prompt (less the
    billing header block the shape does not hold) and its other parameters."""
    t = load_transcript(_transcript_file(folder))
    bodies = _bodies(folder / "requests.jsonl")
    calls = find_calls(t.messages)
    assert len(t.requests) == len(calls) == len(bodies)
    for call, rec, body in zip(calls, t.requests, bodies, strict=True):
        assert rec.position == call.index  # recorded just before the response
        assert rec.model == body["model"] == call.model
        assert list(rec.tools) == _strip_cache_control(body["tools"])
        assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
        assert rec.system == _strip_cache_control(body["system"][1:])
        for key in ("max_tokens", "thinking", "context_management"):
            assert rec.params[key] == body[key], key
    # each request names the one before it (or none: a resumed run re-sends from scratch)
    ids = [r.request_id for r in t.requests]
    assert len(set(ids)) == len(ids) and None not in ids
    assert all(r.base is None or r.base in ids[:n] for n, r in enumerate(t.requests))


# --------------------------------------------------------------------------------------------
# 4. Tampered copies of a corpus session
# --------------------------------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _reminder_after_tool_result(lines: list[str]) -> tuple[int, int]:
    """(line index, call number) of the first ``total_tokens_reminder`` attachment that follows
    a tool-result user record (attachments between them aside): the call it goes into is the
    next one."""
    last_kind: str | None = None
    responses: set[str] = set()
    for i, line in enumerate(lines):
        raw = json.loads(line)
        rtype = raw.get("type")
        if rtype == "assistant":
            responses.add(raw["message"]["id"])
            last_kind = "assistant"
        elif rtype == "user":
            content = raw["message"]["content"]
            tool_result = isinstance(content, list) and any(
                b.get("type") == "tool_result" for b in content
            )
            last_kind = "tool_result" if tool_result else "prompt"
        elif (
            rtype == "attachment"
            and raw.get("attachment", {}).get("type") == "total_tokens_reminder"
            and last_kind == "tool_result"
        ):
            return i, len(responses)
    raise AssertionError("no reminder after a tool result")


@pytest.mark.parametrize("folder", _session_params())
@pytest.mark.asyncio
async def test_a_lost_reminder_is_restored_from_the_recording(folder: Path, tmp_path: Path) -> None:
    """Without the reminder folded into a tool result, the records alone no longer render what
    the call sent; the recorded blob puts it back (and the replay sends it)."""
    lines = _lines(_transcript_file(folder))
    at, call_number = _reminder_after_tool_result(lines)
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(lines[:at] + lines[at + 1 :]), encoding="utf-8")
    sent = _sent_messages(_bodies(folder / "requests.jsonl"))

    rendered = _rebuilt(load_transcript(tampered, recorded_wire=False))
    assert len(rendered) == len(sent)
    assert rendered[:call_number] == sent[:call_number]
    assert rendered[call_number] != sent[call_number]

    t = load_transcript(tampered)
    assert _rebuilt(t) == sent
    assert t.wire_check.replaced >= 1 and t.wire_check.unverified == 0
    results = await _replay(t, tmp_path / "store")
    assert [_dumps(r.request) for r in results] == sent


@pytest.mark.parametrize("folder", _session_params())
@pytest.mark.asyncio
async def test_an_edited_prompt_loses_to_the_recorded_blob(folder: Path, tmp_path: Path) -> None:
    """The first prompt's user record changed: the recorded blob of the first call wins, on that
    call and on every later one that re-sends it."""
    lines = _lines(_transcript_file(folder))
    first = next(i for i, line in enumerate(lines) if json.loads(line).get("type") == "user")
    record = json.loads(lines[first])
    assert isinstance(record["message"]["content"], str)
    record["message"]["content"] = "an edited prompt, not the one sent"
    lines[first] = json.dumps(record, ensure_ascii=False) + "\n"
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(lines), encoding="utf-8")
    sent = _sent_messages(_bodies(folder / "requests.jsonl"))

    rendered = _rebuilt(load_transcript(tampered, recorded_wire=False))
    assert all(got != expected for got, expected in zip(rendered, sent, strict=True))

    t = load_transcript(tampered)
    assert _rebuilt(t) == sent
    assert t.wire_check.replaced >= 1 and t.wire_check.unverified == 0
    assert "an edited prompt" not in _dumps(to_api(t.messages))
    results = await _replay(t, tmp_path / "store")
    assert [_dumps(r.request) for r in results] == sent


# --------------------------------------------------------------------------------------------
# 5. Synthetic 2.1 transcripts
# --------------------------------------------------------------------------------------------

SESSION = "5f0c1e2a-0000-4000-8000-0000000000c1"
MODEL = "claude-sonnet-4-5"
SHAPE_HASH = "shape-0001"
SYSTEM = [{"type": "text", "text": "You are a tiny test agent."}]
TOOLS = [
    {
        "name": "Echo",
        "description": "Echo the text back.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
]


class _Records:
    """Builds a small 2.1 transcript line by line (uuids chained, hashes from the content)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self._n = 0
        self._parent: str | None = None

    def _envelope(self, rtype: str, **extra: Any) -> dict[str, Any]:
        self._n += 1
        uid = f"00000000-0000-4000-8000-{self._n:012d}"
        rec = {
            "parentUuid": self._parent,
            "isSidechain": False,
            "type": rtype,
            "uuid": uid,
            "timestamp": f"2026-12-01T10:00:{self._n:02d}.000Z",
            "sessionId": SESSION,
            "version": "2.1.328",
            **extra,
        }
        self._parent = uid
        self.lines.append(rec)
        return rec

    def raw(self, record: dict[str, Any]) -> None:
        self.lines.append(record)

    def shape(self) -> None:
        self.raw(
            {
                "type": "api-request-shape",
                "sessionId": SESSION,
                "shapeHash": SHAPE_HASH,
                "shape": {"system": SYSTEM, "tools": TOOLS},
            }
        )

    def user(self, content: Any, **extra: Any) -> None:
        self._envelope("user", message={"role": "user", "content": content}, **extra)

    def reminder(self, text: str) -> str:
        """A rendered attachment; returns the text it sends."""
        rendered = f"<system-reminder>\n{text}\n</system-reminder>"
        self._envelope(
            "attachment",
            attachment={"type": "total_tokens_reminder", "text": text},
            rendered=[{"content": rendered}],
        )
        return rendered

    def synthetic(self, text: str) -> None:
        """An assistant message no API call produced (Claude Code's ``<synthetic>`` model)."""
        self._envelope(
            "assistant",
            message={
                "id": f"msg_synthetic_{self._n}",
                "role": "assistant",
                "model": "<synthetic>",
                "content": [{"type": "text", "text": text}],
            },
        )

    def system(self, subtype: str, content: str = "") -> None:
        self._envelope("system", subtype=subtype, content=content, level="info")

    def assistant(self, msg_id: str, blocks: list[dict[str, Any]], input_tokens: int) -> None:
        for block in blocks:  # one record per block, as Claude Code streams them
            self._envelope(
                "assistant",
                message={
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": MODEL,
                    "content": [block],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": input_tokens,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0,
                        "output_tokens": 10,
                    },
                },
            )

    def blob(self, message: dict[str, Any]) -> str:
        digest = hashlib.sha256(_dumps(message).encode()).hexdigest()
        self.raw(
            {"type": "api-request-blob", "sessionId": SESSION, "hash": digest, "message": message}
        )
        return digest

    def request(
        self, request_id: str, tail: list[str], *, keep: int = 0, base: str | None = None
    ) -> None:
        rec: dict[str, Any] = {
            "type": "api-request",
            "sessionId": SESSION,
            "id": request_id,
            "shapeHash": SHAPE_HASH,
            "params": {"model": MODEL, "max_tokens": 1024},
            "keep": keep,
            "tail": tail,
        }
        if base is not None:
            rec["base"] = base
        self.raw(rec)

    def write(self, path: Path) -> Path:
        path.write_text(
            "".join(_dumps(r) + "\n" for r in self.lines),
            encoding="utf-8",
        )
        return path


def _first_call(r: _Records) -> dict[str, Any]:
    """A prompt with a reminder, its blob, its request and the response; returns the blob."""
    r.shape()
    r.user("hello")
    lead = r.reminder("be brief")
    sent = {
        "role": "user",
        "content": [{"type": "text", "text": lead + "\n"}, {"type": "text", "text": "hello"}],
    }
    r.request("req-1", [r.blob(sent)])
    r.assistant("msg_1", [{"type": "text", "text": "hi there"}], 100)
    return sent


@pytest.mark.asyncio
async def test_a_compaction_rebuilds_from_its_recorded_chain(tmp_path: Path) -> None:
    """After a compaction the call sent four messages the records do not render to (two user
    messages in a row among them): the chain's blobs are put in place of those records, never
    merged; the next call (keep 4, a response known by its hash only, a blob) follows on."""
    r = _Records()
    first_sent = _first_call(r)
    r.system("compact_boundary", "Conversation compacted")
    r.user("Summary: the user said hello.", isCompactSummary=True, isVisibleInTranscriptOnly=True)
    r.user("go on")
    r.reminder("later")
    after: list[dict[str, Any]] = [
        {"role": "user", "content": "Summary: the user said hello."},
        {"role": "assistant", "content": [{"type": "text", "text": "Understood."}]},
        {"role": "user", "content": "go on"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "<system-reminder>\nlater\n</system-reminder>"}],
        },
    ]
    r.request("req-2", [r.blob(m) for m in after])
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "Echo", "input": {"text": "x"}}
    r.assistant("msg_2", [{"type": "text", "text": "echoing"}, tool_use], 200)
    r.user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "echoed  \t\n"}])
    folded = r.reminder("still brief")
    result_sent = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "echoed\n\n" + folded}
        ],
    }
    response_hash = "f" * 64  # the response: no blob holds it
    r.request("req-3", [response_hash, r.blob(result_sent)], keep=4, base="req-2")
    r.assistant("msg_3", [{"type": "text", "text": "done"}], 300)
    path = r.write(tmp_path / "compacted.jsonl")

    t = load_transcript(path)
    assert (t.wire_check.replaced, t.wire_check.unverified) == (4, 0)
    calls = find_calls(t.messages)
    assert [c.message_id for c in calls] == ["msg_1", "msg_2", "msg_3"]
    response = {
        "role": "assistant",
        "content": [{"type": "text", "text": "echoing"}, tool_use],
    }
    expected = [[first_sent], after, [*after, response, result_sent]]
    got = [to_api(t.messages[: c.index]) for c in calls]
    assert [_dumps(g) for g in got] == [_dumps(e) for e in expected]
    assert len(got[1]) == 4 and [m["role"] for m in got[1]] == ["user", "assistant"] + ["user"] * 2

    # the records alone render the compacted part as one user message
    plain = load_transcript(path, recorded_wire=False)
    plain_calls = find_calls(plain.messages)
    assert _dumps(to_api(plain.messages[: plain_calls[1].index])) != _dumps(after)

    # the stages see the part after the compaction; the replay sends what was recorded
    results = await _replay(t, tmp_path / "store")
    assert [_dumps(res.request) for res in results] == [_dumps(e) for e in expected]


@pytest.mark.parametrize("case", ["lost-response", "extra-message"])
def test_a_chain_that_names_a_message_without_a_blob_is_unverified(
    case: str, tmp_path: Path
) -> None:
    """The records do not render to the chain a call recorded, and the difference lies at a
    message known only by its hash: nothing to put in place, the records are left as they
    render, and the call is counted unverified."""
    r = _Records()
    r.shape()
    r.user("hello")
    r.request("req-1", [r.blob({"role": "user", "content": "hello"})])
    if case == "lost-response":
        # the response the second call built on is missing from the records (a lost write):
        # the second prompt merges with the first
        r.user("again")
        tail = ["a" * 64, r.blob({"role": "user", "content": "again"})]
        r.request("req-2", tail, keep=1, base="req-1")
        r.assistant("msg_2", [{"type": "text", "text": "ok"}], 50)
    else:
        r.assistant("msg_1", [{"type": "text", "text": "hi"}], 40)
        r.user("again")
        # the call sent a fourth message that no record (and no blob) holds
        tail = ["a" * 64, r.blob({"role": "user", "content": "again"}), "b" * 64]
        r.request("req-2", tail, keep=1, base="req-1")
        r.assistant("msg_2", [{"type": "text", "text": "ok"}], 50)
    path = r.write(tmp_path / "chain.jsonl")

    t = load_transcript(path)
    plain = load_transcript(path, recorded_wire=False)
    assert (t.wire_check.replaced, t.wire_check.unverified) == (0, 1)
    assert [m.uuid for m in t.messages] == [m.uuid for m in plain.messages]
    assert _rebuilt(t) == _rebuilt(plain)
    last = to_api(t.messages[: find_calls(t.messages)[-1].index])
    if case == "lost-response":
        merged = [{"type": "text", "text": "hello\n"}, {"type": "text", "text": "again"}]
        assert last == [{"role": "user", "content": merged}]
    else:
        assert [m["role"] for m in last] == ["user", "assistant", "user"]


def test_reminders_render_as_claude_code_sends_them(tmp_path: Path) -> None:
    """The renderer alone (no recorded wire): reminders before the prompt they came with (the
    last gains a newline before the prompt's text, none before an image), reminders after tool
    results into the last tool result (a string right-stripped, then ``"\\n\\n" + text`` per
    reminder; a list one text block per reminder)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    r = _Records()
    r.user("first prompt")
    one, two = r.reminder("one"), r.reminder("two")
    r.assistant("msg_1", [{"type": "tool_use", "id": "t1", "name": "Echo", "input": {}}], 10)
    r.user([{"type": "tool_result", "tool_use_id": "t1", "content": "out \t\n"}])
    three, four = r.reminder("three"), r.reminder("four")
    r.assistant(
        "msg_2",
        [
            {"type": "tool_use", "id": "t2", "name": "Echo", "input": {}},
            {"type": "tool_use", "id": "t3", "name": "Echo", "input": {}},
        ],
        20,
    )
    r.user([{"type": "tool_result", "tool_use_id": "t2", "content": "plain  "}])
    r.user(
        [
            {
                "type": "tool_result",
                "tool_use_id": "t3",
                "content": [{"type": "text", "text": "x"}, image],
            }
        ]
    )
    five = r.reminder("five")
    r.assistant("msg_3", [{"type": "text", "text": "now an image"}], 30)
    r.user([image, {"type": "text", "text": "look"}])
    six = r.reminder("six")
    r.assistant("msg_4", [{"type": "text", "text": "done"}], 40)
    t = load_transcript(r.write(tmp_path / "reminders.jsonl"))
    assert all(m.is_reminder for m in t.messages if m.type == "attachment")

    def text(value: str) -> dict[str, Any]:
        return {"type": "text", "text": value}

    def response(n: int) -> dict[str, Any]:
        return {"role": "assistant", "content": r.lines[n]["message"]["content"]}

    sent = to_api(t.messages)
    assert sent[0] == {
        "role": "user",
        "content": [text(one), text(two + "\n"), text("first prompt")],
    }
    assert sent[2] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": f"out\n\n{three}\n\n{four}"}
        ],
    }
    assert sent[4] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": "plain  "},
            {"type": "tool_result", "tool_use_id": "t3", "content": [text("x"), image, text(five)]},
        ],
    }
    assert sent[6] == {"role": "user", "content": [text(six), image, text("look")]}
    assert [m["role"] for m in sent] == ["user", "assistant"] * 4
    assert sent[1] == response(3)
    # the records are not changed by rendering (blocks are shared, never edited)
    assert r.lines[4]["message"]["content"][0]["content"] == "out \t\n"
    assert t.messages[4].content == [
        {"type": "tool_result", "tool_use_id": "t1", "content": "out \t\n"}
    ]


def test_unknown_and_ignored_record_types_are_counted_not_fatal(tmp_path: Path) -> None:
    r = _Records()
    r.raw({"type": "queue-operation", "operation": "enqueue", "content": "hello"})
    r.raw({"type": "queue-operation", "operation": "dequeue"})
    _first_call(r)
    r.raw({"type": "last-prompt", "lastPrompt": "hello", "leafUuid": "x"})
    r.raw({"type": "tools-used", "tools": ["Bash"]})
    r.raw({"type": "atis-latch", "atis": ""})
    r.raw({"type": "future-thing", "payload": {"anything": [1, 2, 3]}})
    path = r.write(tmp_path / "types.jsonl")

    t = load_transcript(path)  # strict: none of them fails the load
    assert t.unknown_types == Counter({"future-thing": 1})
    assert t.skipped_types == Counter(
        {
            "queue-operation": 2,
            "last-prompt": 1,
            "tools-used": 1,
            "atis-latch": 1,
            "future-thing": 1,
            "api-request-shape": 1,
            "api-request-blob": 1,
            "api-request": 1,
        }
    )
    assert not t.problems
    assert len(t.requests) == 1 and len(find_calls(t.messages)) == 1
    assert [m.type for m in t.messages] == ["user", "attachment", "assistant"]


def _bad_request(**change: Any) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        rec: dict[str, Any] = {
            "type": "api-request",
            "sessionId": SESSION,
            "id": "req-bad",
            "params": {"model": MODEL},
            "keep": 0,
            "tail": [],
        }
        rec.update(change)
        return rec

    return make


def _bad_blob(message: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {
        "type": "api-request-blob",
        "sessionId": SESSION,
        "hash": "h",
        "message": message,
    }


def _bad_attachment(rendered: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {
        "type": "attachment",
        "uuid": "00000000-0000-4000-8000-00000000bad0",
        "sessionId": SESSION,
        "attachment": {"type": "date", "date": "2026-12-01"},
        "rendered": copy.deepcopy(rendered),
    }


MALFORMED: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "request-params-not-object": (_bad_request(params="claude"), "params"),
    "request-params-list": (_bad_request(params=[MODEL]), "params"),
    "request-tail-string": (_bad_request(tail="abc"), "tail"),
    "request-tail-numbers": (_bad_request(tail=["h1", 2]), "tail"),
    "request-keep-negative": (_bad_request(keep=-1), "keep"),
    "request-keep-bool": (_bad_request(keep=True), "keep"),
    "request-keep-float": (_bad_request(keep=1.5), "keep"),
    "blob-role-system": (_bad_blob({"role": "system", "content": "x"}), "user or assistant"),
    "blob-content-number": (_bad_blob({"role": "user", "content": 42}), "content"),
    "blob-no-message": (_bad_blob("hello"), "message"),
    "attachment-rendered-string": (_bad_attachment("<system-reminder>x"), "rendered"),
    "attachment-rendered-object": (_bad_attachment({"content": "x"}), "rendered"),
    "attachment-item-no-content": (_bad_attachment([{"text": "x"}]), "rendered[0]"),
    "attachment-item-number": (_bad_attachment([{"content": "ok"}, {"content": 7}]), "rendered[1]"),
    "attachment-item-string": (_bad_attachment(["x"]), "rendered[0]"),
    "shape-without-hash": (
        lambda: {"type": "api-request-shape", "shape": {"system": SYSTEM, "tools": TOOLS}},
        "shapeHash",
    ),
    "shape-tools-not-list": (
        lambda: {"type": "api-request-shape", "shapeHash": "s2", "shape": {"tools": "Bash"}},
        "tools",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_record_names_its_line(case: str, tmp_path: Path) -> None:
    """Strict: ``TranscriptError`` naming the file and line, and what is wrong; not strict: the
    line is skipped and listed, the rest loads."""
    make, words = MALFORMED[case]
    r = _Records()
    _first_call(r)
    good = r.write(tmp_path / "good.jsonl")
    r.lines.insert(3, make())  # after the prompt and its reminder, before the blob
    path = r.write(tmp_path / "bad.jsonl")
    assert _dumps(r.lines[3]) == path.read_text(encoding="utf-8").splitlines()[3]

    with pytest.raises(TranscriptError) as info:
        load_transcript(path)
    assert info.value.line == 4
    assert info.value.path == str(path)
    assert f"{path}:4: malformed record" in str(info.value)
    assert words in info.value.reason

    t = load_transcript(path, strict=False)
    assert t.problems == [LineProblem(4, info.value.reason)]
    reference = load_transcript(good)
    assert [m.uuid for m in t.messages] == [m.uuid for m in reference.messages]
    assert len(t.requests) == 1 and _rebuilt(t) == _rebuilt(reference)


# --------------------------------------------------------------------------------------------
# Records that render more than a call sent; request positions after a replacement
# --------------------------------------------------------------------------------------------


def _extra_record_session(path: Path, *, edit_first_prompt: bool) -> list[dict[str, Any]]:
    """Two calls; before the second, a record (a synthetic assistant message) that the call did
    not send: the records render one message more than its chain (keep 1, the response's hash,
    one blob). Returns
    the messages the second call recorded sending."""
    r = _Records()
    r.shape()
    r.user("hello, edited after the fact" if edit_first_prompt else "hello")
    hello = {"role": "user", "content": "hello"}
    r.request("req-1", [r.blob(hello)])
    r.assistant("msg_1", [{"type": "text", "text": "hi"}], 40)
    r.user("again")
    r.synthetic("No response requested.")
    again = {"role": "user", "content": "again"}
    r.request("req-2", ["c" * 64, r.blob(again)], keep=1, base="req-1")
    r.assistant("msg_2", [{"type": "text", "text": "ok"}], 50)
    r.write(path)
    return [hello, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}, again]


@pytest.mark.parametrize("edit_first_prompt", [False, True], ids=["alone", "with-a-replacement"])
def test_records_beyond_the_recorded_chain_are_dropped_or_reported(
    edit_first_prompt: bool, tmp_path: Path
) -> None:
    """A call whose records render one message more than it recorded sending: its rebuild is
    made exact (the recording wins) or the call is counted unverified; either way the outcome
    must not depend on an unrelated replacement elsewhere in the session."""
    sent = _extra_record_session(tmp_path / "extra.jsonl", edit_first_prompt=edit_first_prompt)
    t = load_transcript(tmp_path / "extra.jsonl")
    calls = find_calls(t.messages)
    assert [c.message_id for c in calls] == ["msg_1", "msg_2"]
    rebuilt = to_api(t.messages[: calls[1].index])
    assert _dumps(rebuilt) == _dumps(sent), (rebuilt, t.wire_check)
    assert t.wire_check.left_out == 1  # the synthetic record the call did not send
    # both variants end the same way for that call
    other = tmp_path / "other.jsonl"
    _extra_record_session(other, edit_first_prompt=not edit_first_prompt)
    u = load_transcript(other)
    assert _dumps(to_api(u.messages[: find_calls(u.messages)[1].index])) == _dumps(rebuilt)


@pytest.mark.asyncio
async def test_request_positions_follow_the_records_after_a_replacement(tmp_path: Path) -> None:
    """The first prompt edited after the fact: its prompt and reminder records (two) become one
    recorded message. Each request's position must still be its call's index, and the replay's
    first call must count the system prompt and tools."""
    r = _Records()
    _first_call(r)
    r.user([{"type": "text", "text": "more"}])
    more = {"role": "user", "content": [{"type": "text", "text": "more"}]}
    reply = "d" * 64
    r.request("req-2", [reply, r.blob(more)], keep=1, base="req-1")
    r.assistant("msg_2", [{"type": "text", "text": "sure"}], 120)
    r.lines[1]["message"]["content"] = "hello, edited after the fact"
    t = load_transcript(r.write(tmp_path / "edited.jsonl"))
    assert (t.wire_check.replaced, t.wire_check.unverified) == (1, 0)
    calls = find_calls(t.messages)
    with_req = await _replay(t, tmp_path / "a")
    without = await _replay(t, tmp_path / "b", with_requests=False)
    own = TokenTracker().set_request(system=SYSTEM, tools=TOOLS)
    grown = with_req[0].estimated_tokens - without[0].estimated_tokens
    assert [q.position for q in t.requests] == [c.index for c in calls]
    assert grown == pytest.approx(own, rel=0.02)


# --------------------------------------------------------------------------------------------
# 6. The token tracker with the recorded system prompt and tools
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", _session_params())
@pytest.mark.asyncio
async def test_first_estimate_counts_system_prompt_and_tools(folder: Path, tmp_path: Path) -> None:
    """The corpus usage is about request chars / 4, system prompt and tools included: told them,
    the first call's estimate (no usage yet) grows by about their tokens and lands near it."""
    t = load_transcript(_transcript_file(folder))
    with_req = (await _replay(t, tmp_path / "a"))[0]
    without = (await _replay(t, tmp_path / "b", with_requests=False))[0]
    actual = with_req.actual_tokens
    assert actual is not None and actual == without.actual_tokens

    first = t.requests[0]
    own = TokenTracker().set_request(system=first.system, tools=first.tools)
    chars = len(_dumps(first.system)) + len(_dumps(list(first.tools)))
    grown = with_req.estimated_tokens - without.estimated_tokens
    assert grown == pytest.approx(own, rel=0.02)
    assert grown == pytest.approx(chars / 4, rel=0.25)

    assert abs(with_req.estimated_tokens - actual) < abs(without.estimated_tokens - actual)
    assert abs(with_req.estimated_tokens - actual) / actual <= 0.25
    assert abs(without.estimated_tokens - actual) / actual > 0.5  # what it missed before


# --------------------------------------------------------------------------------------------
# 7. A live recording with the real CLI
# --------------------------------------------------------------------------------------------

_PNG_SCRIPT = r"""python3 - <<'PYEOF'
import struct, zlib
def chunk(kind, data):
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', crc)
rows = b''.join(b'\x00' + b'\xff\x80\x00' * 4 for _ in range(4))
ihdr = struct.pack('>IIBBBBB', 4, 4, 8, 2, 0, 0, 0)
png = b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', ihdr) + chunk(b'IDAT', zlib.compress(rows))
open('dot.png', 'wb').write(png + chunk(b'IEND', b''))
open('notes.txt', 'w').write('alpha\nbeta needle\ngamma\n')
PYEOF"""


def _tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        b
        for m in body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    not (RECORD.exists() and CLAUDE.exists()), reason="Claude Code is not installed here"
)
def test_a_fresh_recording_rebuilds_byte_for_byte(tmp_path: Path) -> None:
    """Images in tool results, parallel tools, output with trailing whitespace, a ``--continue``
    run with a two-line prompt: every main-thread request rebuilt exactly, with and without the
    recorded wire."""
    out = tmp_path / "run"
    work = (out / "work").resolve()
    png, notes = str(work / "dot.png"), str(work / "notes.txt")
    plan = [
        [{"name": "Bash", "input": {"command": _PNG_SCRIPT, "description": "make the files"}}],
        [{"name": "Read", "input": {"file_path": png}}],
        [
            {"name": "Read", "input": {"file_path": notes}},
            {"name": "Grep", "input": {"pattern": "needle", "path": str(work)}},
            {"name": "Read", "input": {"file_path": png}},
        ],
        [{"name": "Bash", "input": {"command": "printf 'a\\tb\\t\\n'", "description": "tabs"}}],
        [{"name": "Read", "input": {"file_path": notes}}],  # numbered lines: ends "4\t"
        "first run done",
        [{"name": "Bash", "input": {"command": "echo second", "description": "again"}}],
        "second run done",
    ]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan), encoding="utf-8")
    done = subprocess.run(
        [str(RECORD), str(plan_file), str(out), "make and read the files",
         "--continue", "second prompt\nwith two lines"],  # the server takes a free port itself
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = (out / "claude.out").read_text(encoding="utf-8")
    assert "first run done" in said and "second run done" in said

    main = _bodies(out / "requests.jsonl", main_only=True)
    assert len(main) == len(plan)
    results = [b for body in main for b in _tool_results(body)]
    assert any(
        isinstance(b["content"], list) and any(x.get("type") == "image" for x in b["content"])
        for b in results
    ), "no image in a tool result"
    last_prompt = main[len(plan) - 2]["messages"][-1]["content"]
    assert any(b.get("text") == "second prompt\nwith two lines" for b in last_prompt)
    # a tool result recorded with trailing whitespace (Read's numbered lines end "4\\t"), which
    # the reminder folded into it strips
    loaded = load_transcript(out / "transcript.jsonl", recorded_wire=False)
    assert any(
        isinstance(b.get("content"), str) and b["content"] != b["content"].rstrip()
        for m in loaded.messages
        if m.type == "user"
        for b in m.blocks
        if b.get("type") == "tool_result"
    )

    sent = _sent_messages(main)
    for recorded_wire in (True, False):
        t = load_transcript(out / "transcript.jsonl", recorded_wire=recorded_wire)
        calls = find_calls(t.messages)
        assert len(calls) == len(sent)
        for call, got, expected in zip(calls, _rebuilt(t), sent, strict=True):
            assert got == expected, f"call {call.number}, recorded_wire={recorded_wire}"
        assert (t.wire_check.replaced, t.wire_check.unverified) == (0, 0)
        assert not t.unknown_types
