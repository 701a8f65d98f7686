"""The agent against a misbehaving API and damaged transcripts: a typed error or a repair, never
a traceback, never a record its own loader rejects, never a session that cannot be resumed.

The real SDK talks to the scripted server over HTTP; the CLI runs as a subprocess.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import (
    Message,
    Pipeline,
    SessionContext,
    TranscriptWriter,
    load_transcript,
    stage,
    to_api,
)
from pipeline.agent import (
    INTERRUPTED_RESULT,
    Agent,
    AgentAPIError,
    RetryPolicy,
    SessionBusyError,
    TurnLog,
    repair_pairing,
    session_lock,
    store_root_of,
)
from pipeline.agent.retry import retry_after_seconds
from pipeline.testing import (
    QuietLogger,
    RawReply,
    Reply,
    ScriptedMessagesServer,
    ScriptError,
    without_cache_control,
)
from pipeline.tools import tool
from pipeline.wire.pairing import PairingError, check_pairing
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.sdk_support import sdk_client

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
PARTLY_ANSWERED = (
    CORPUS / "claude-code_durban-designer-vsla" / "f6108699-47cc-4b21-8ca6-3223992990b3.jsonl"
)

Script = Callable[[dict[str, Any]], Reply | ScriptError | RawReply]


_IDS = itertools.count()


def _message(**over: Any) -> bytes:
    """A response body; its id new each time (a response never reuses one) unless given."""
    body: dict[str, Any] = {
        "id": f"msg_{next(_IDS)}",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    body.update(over)
    return json.dumps(body).encode()


@tool(input_schema={"type": "object", "properties": {}})
async def ping() -> str:
    """Answer pong."""
    return "pong"


def _agent(server: ScriptedMessagesServer, root: Path, sid: str = "s1", **kw: Any) -> Agent:
    client = sdk_client(server.base_url)
    ctx = SessionContext(
        sid,
        root,
        transcript=TranscriptWriter(root / sid / "transcript.jsonl", sid),
        logger=QuietLogger(),
    )
    return Agent(client, model="m", pipeline=Pipeline([]), ctx=ctx, tools=[ping], **kw)


def _uses(*ids: str) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": t, "name": "ping", "input": {}} for t in ids]


MALFORMED: dict[str, bytes] = {
    "invalid JSON": b"{not json",
    "empty body": b"",
    "HTML": b"<html><body>Bad gateway</body></html>",
    "wrong shape": b'{"foo": 1}',
    "null content": _message(content=None),
    "string content": _message(content="a string"),
    "null usage": _message(usage=None),
    "negative usage": _message(usage={"input_tokens": -5, "output_tokens": 1}),
    "huge usage": _message(usage={"input_tokens": 10**13, "output_tokens": 1}),
    "text is a number": _message(content=[{"type": "text", "text": 5}]),
    "model is a number": _message(model=5),
    "tool_use without id": _message(
        content=[{"type": "tool_use", "name": "ping", "input": {}}], stop_reason="tool_use"
    ),
    "tool_use id is an int": _message(
        content=[{"type": "tool_use", "id": 5, "name": "ping", "input": {}}]
    ),
    "duplicate tool_use ids": _message(content=_uses("dup", "dup"), stop_reason="tool_use"),
    "tool_use input null": _message(
        content=[{"type": "tool_use", "id": "t", "name": "ping", "input": None}]
    ),
    "tool_use input missing": _message(content=[{"type": "tool_use", "id": "t", "name": "ping"}]),
    "tool_use input a string": _message(
        content=[{"type": "tool_use", "id": "t", "name": "ping", "input": "abc"}]
    ),
    # two ids that would be one on the wire (lone surrogates become U+FFFD there)
    "ids that are not text": _message(content=_uses("t\ud800", "t\ud801"), stop_reason="tool_use"),
    "nested past the decoder": _message(content=[{"type": "text", "text": "x"}]).replace(
        b'"text": "x"', b'"text": "x", "deep": ' + b"[" * 3_000 + b"]" * 3_000
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_200_response_is_a_typed_api_error_and_nothing_is_recorded(
    tmp_path: Path, case: str
) -> None:
    body = MALFORMED[case]
    with ScriptedMessagesServer(lambda _b: RawReply(body)) as server:
        agent = _agent(server, tmp_path)
        with pytest.raises(anthropic.APIError) as info:
            anyio.run(agent.run, "hello")
    error = info.value
    assert isinstance(error, AgentAPIError)
    assert error.kind == "bad_response" and error.status == 200
    assert "malformed message" in str(error)
    loaded = load_transcript(tmp_path / "s1" / "transcript.jsonl")  # strict: every line loads
    assert [m.type for m in loaded.messages] == ["user"]  # the prompt, nothing of the reply


@stage("latest_prompt_only")
async def latest_prompt_only(messages: list[Message], ctx: SessionContext) -> list[Message]:
    """Sends only a fresh prompt (as a stage that drops old rounds would)."""
    last = messages[-1]
    return [last] if isinstance(last.content, str) else messages


def test_an_id_reused_from_rounds_the_request_no_longer_holds_is_refused(tmp_path: Path) -> None:
    replies = iter(
        [
            _message(content=_uses("same"), stop_reason="tool_use"),
            _message(),
            _message(content=_uses("same"), stop_reason="tool_use"),  # not in that request
        ]
    )
    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent = _agent(server, tmp_path)
        agent.pipeline = Pipeline([latest_prompt_only])
        anyio.run(agent.run, "hello")
        with pytest.raises(AgentAPIError, match="already used"):
            anyio.run(agent.run, "again")
    loaded = load_transcript(tmp_path / "s1" / "transcript.jsonl")
    assert check_pairing(to_api(loaded.messages)) == []


def test_a_response_id_reused_from_an_earlier_turn_is_refused(tmp_path: Path) -> None:
    """A response answering with an earlier one's id would be sent as a part of that one (the
    two merged into one message, the next request broken): refused as a malformed answer,
    nothing of it recorded."""
    replies = iter(
        [_message(id="msg_a", content=_uses("t1"), stop_reason="tool_use"), _message(id="msg_a")]
    )
    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent = _agent(server, tmp_path)
        with pytest.raises(AgentAPIError, match="an earlier response's") as caught:
            anyio.run(agent.run, "hello")
    assert caught.value.kind == "bad_response"
    loaded = load_transcript(tmp_path / "s1" / "transcript.jsonl")
    assert [m.message_id for m in loaded.messages if m.type == "assistant"] == ["msg_a"]
    assert check_pairing(to_api(loaded.messages)) == []


def test_a_tool_use_id_reused_from_an_earlier_turn_is_refused(tmp_path: Path) -> None:
    replies = iter([_message(content=_uses("same"), stop_reason="tool_use") for _ in range(2)])
    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent = _agent(server, tmp_path)
        with pytest.raises(AgentAPIError, match="already used"):
            anyio.run(agent.run, "hello")
    loaded = load_transcript(tmp_path / "s1" / "transcript.jsonl")
    assert check_pairing(to_api(loaded.messages)) == []  # resumable as it stands


def _cli(
    server: ScriptedMessagesServer | None, cwd: Path, *args: str, **env_over: str
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ANTHROPIC_"))}
    if server is not None:
        env |= {"ANTHROPIC_BASE_URL": server.base_url, "ANTHROPIC_API_KEY": "test-key"}
    env |= env_over
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "agent", "--model", "m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_cli_reports_a_malformed_response_in_one_line(tmp_path: Path) -> None:
    with ScriptedMessagesServer(lambda _b: RawReply(b"<html>oops</html>")) as server:
        done = _cli(server, tmp_path, "hello", "--session-id", "bad")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "sluicegate: error: API error: bad_response" in done.stderr


def test_lone_surrogates_never_make_a_request_unencodable(tmp_path: Path) -> None:
    # a result cut in the middle of an emoji, as JavaScript writes it, in a transcript ...
    path = tmp_path / "s1" / "transcript.jsonl"
    writer = TranscriptWriter(path, "s1")
    cut = "x" * 100 + "\ud83d"
    writer.append_messages(
        [
            user_text("go"),
            assistant("msg_0", tool_use("t0", "ping")),
            results(tool_result("t0", cut)),
        ]
    )
    # ... and a response that carries one too
    replies = iter(
        [
            Reply([{"type": "text", "text": "half \ud800 an emoji"}]),
            Reply([{"type": "text", "text": "fine"}]),
        ]
    )
    with ScriptedMessagesServer(lambda _b: next(replies)) as server:
        client = sdk_client(server.base_url)
        agent = Agent.resume(path, client, model="m", pipeline=Pipeline([]), tools=[ping])
        anyio.run(agent.run, None)
        anyio.run(agent.run, "and again")
        sent = server.requests
    assert len(sent) == 2
    first = json.dumps(sent[0])
    assert "x" * 100 + "\ufffd" in json.loads(first)["messages"][2]["content"][0]["content"]
    assert sent[1]["messages"][3]["content"][0]["text"] == "half \ufffd an emoji"
    # the records keep what was said; a later resume sends the same again
    assert "\ud800" in load_transcript(path).messages[3].content[0]["text"]


def test_what_the_caller_gives_encodes_too(tmp_path: Path) -> None:
    @tool(input_schema={"type": "object", "properties": {}})
    async def cut() -> str:
        """A description cut in an emoji \ud83d."""
        return "ok"

    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "fine"}])) as server:
        client = sdk_client(server.base_url)
        ctx = SessionContext("s1", tmp_path, logger=QuietLogger())
        agent = Agent(
            client,
            model="m\udcff",
            pipeline=Pipeline([]),
            ctx=ctx,
            tools=[cut],
            system="sys \ud83d",
        )
        anyio.run(agent.run, "hello")
        body = server.requests[0]
    assert body["system"] == "sys \ufffd" and body["model"] == "m\ufffd"
    assert body["tools"][0]["description"].endswith("emoji \ufffd.")


def test_the_cli_prints_an_answer_with_a_lone_surrogate(tmp_path: Path) -> None:
    answer = Reply([{"type": "text", "text": "final \ud83d cut"}])
    with ScriptedMessagesServer(lambda _b: answer) as server:
        done = _cli(server, tmp_path, "hi")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "final \ufffd cut" in done.stdout


def _partly_answered(tmp_path: Path) -> Path:
    path = tmp_path / "s1" / "transcript.jsonl"
    TranscriptWriter(path, "s1").append_messages(
        [
            user_text("go"),
            assistant("msg_0", tool_use("a", "ping"), tool_use("b", "ping"), tool_use("c", "ping")),
            results(tool_result("a", "A")),  # the process died before b and c were recorded
            user_text("continue please"),
            assistant("msg_1", {"type": "text", "text": "ok"}),
        ]
    )
    return path


def test_resume_answers_every_unanswered_call_not_only_a_trailing_one(tmp_path: Path) -> None:
    path = _partly_answered(tmp_path)
    lines_before = path.read_text().count("\n")
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "done"}])) as server:
        client = sdk_client(server.base_url)
        agent = Agent.resume(path, client, model="m", pipeline=Pipeline([]), tools=[ping])
        anyio.run(agent.run, "next")
        again = Agent.resume(path, client, model="m", pipeline=Pipeline([]), tools=[ping])
        anyio.run(again.run, "and next")
        sent = server.requests
    assert check_pairing(sent[0]["messages"]) == []
    answers = {
        b["tool_use_id"]: b for b in sent[0]["messages"][2]["content"] if b["type"] == "tool_result"
    }
    assert answers["a"]["content"] == "A"
    assert answers["b"]["content"] == answers["c"]["content"] == INTERRUPTED_RESULT
    # the repair is not written mid-history; every resume makes the same one
    assert path.read_text().count("\n") == lines_before + 4  # two prompts, two replies
    # the second resume sends the first one's request again, byte for byte, as its prefix
    first, again = (without_cache_control(s["messages"]) for s in sent)  # breakpoints move
    assert json.dumps(again[: len(first) - 1]) == json.dumps(first[:-1])


def test_repair_moves_a_late_result_and_drops_orphans_and_second_answers() -> None:
    history = [
        user_text("go"),
        assistant("msg_0", tool_use("a", "ping"), tool_use("b", "ping")),
        results(tool_result("a", "A"), tool_result("a", "A again"), tool_result("zz", "orphan")),
        user_text("more"),
        assistant("msg_1", {"type": "text", "text": "ok"}),
        results(tool_result("b", "B, too late")),
    ]
    repair = repair_pairing(history)
    assert repair.remaining == []
    request = to_api(repair.messages)
    assert check_pairing(request) == []
    first_results = [b for b in request[2]["content"] if b["type"] == "tool_result"]
    assert sorted((b["tool_use_id"], b["content"]) for b in first_results) == [
        ("a", "A"),
        ("b", "B, too late"),
    ]
    assert sorted(repair.dropped) == ["a", "zz"] and repair.moved == ["b"]
    assert repair.trailing == []  # nothing stands at the end: nothing to append
    assert len(history) == 6 and history[2].content[1]["content"] == "A again"  # not modified


def test_repair_never_loses_a_late_result_behind_a_copied_line() -> None:
    history = [
        user_text("go"),
        assistant("msg_0", tool_use("t0", "ping"), tool_use("t1", "ping")),
        results(tool_result("t1", "out t1")),
        results(tool_result("t1", "out t1")),  # the same line, copied
        assistant("msg_1", {"type": "text", "text": "ok"}),
        results(tool_result("t0", "REAL OUTPUT of t0")),
    ]
    repair = repair_pairing(history)
    request = to_api(repair.messages)
    assert check_pairing(request) == [] and repair.moved == ["t0"] and repair.answered == []
    sent = {b["tool_use_id"]: b["content"] for b in request[2]["content"]}
    assert sent == {"t0": "REAL OUTPUT of t0", "t1": "out t1"}


def test_repair_answers_a_call_whose_response_was_recorded_around_another() -> None:
    # a later fragment of X recorded after an interleaved response Y
    history = [
        user_text("go"),
        assistant("X", tool_use("a", "ping")),
        assistant("Y", tool_use("b", "ping")),
        results(tool_result("b", "B")),
        assistant("X", {"type": "text", "text": "and more"}),
    ]
    repair = repair_pairing(history)
    assert repair.remaining == [] and repair.answered == ["a"]
    assert check_pairing(to_api(repair.messages)) == []


def test_a_history_that_cannot_be_repaired_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s1" / "transcript.jsonl"
    TranscriptWriter(path, "s1").append_messages(
        [
            user_text("go"),
            assistant("msg_0", tool_use("dup", "ping")),
            results(tool_result("dup", "1")),
            assistant("msg_1", tool_use("dup", "ping")),
            results(tool_result("dup", "2")),
        ]
    )
    before = path.read_bytes()
    client = sdk_client("http://127.0.0.1:9", max_retries=2)
    with pytest.raises(PairingError, match="duplicate_tool_use"):
        Agent.resume(path, client, model="m", pipeline=Pipeline([]))
    assert path.read_bytes() == before
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "x"}])) as server:
        done = _cli(server, tmp_path, "--resume", str(path), "next")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cannot resume" in done.stderr


@pytest.mark.skipif(not PARTLY_ANSWERED.exists(), reason="corpus not available")
def test_the_partly_answered_corpus_session_resumes(tmp_path: Path) -> None:
    copy = tmp_path / "x.jsonl"
    shutil.copyfile(PARTLY_ANSWERED, copy)
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        done = _cli(server, tmp_path, "--resume", str(copy), "continue please")
        sent = server.requests
    assert done.returncode == 0, done.stderr
    assert len(sent) == 1 and check_pairing(sent[0]["messages"]) == []


def test_cut_between_two_parallel_results_at_every_line(tmp_path: Path) -> None:
    full = tmp_path / "full.jsonl"
    TranscriptWriter(full, "s1").append_messages(
        [
            user_text("go"),
            assistant("msg_0", tool_use("a", "ping"), tool_use("b", "ping")),
            results(tool_result("a", "A")),
            results(tool_result("b", "B")),
            assistant("msg_1", tool_use("c", "ping")),
            results(tool_result("c", "C")),
            assistant("msg_2", {"type": "text", "text": "done"}),
        ]
    )
    lines = full.read_text().splitlines(keepends=True)
    client = sdk_client("http://127.0.0.1:9", max_retries=2)
    for n in range(1, len(lines) + 1):
        cut = tmp_path / f"cut{n}" / "s1" / "transcript.jsonl"
        cut.parent.mkdir(parents=True)
        cut.write_text("".join(lines[:n]))
        agent = Agent.resume(cut, client, model="m", pipeline=Pipeline([]))
        assert check_pairing(to_api(agent.history)) == [], n


def test_one_process_per_session(tmp_path: Path) -> None:
    one, two = tmp_path / "s1" / "transcript.jsonl", tmp_path / "s2" / "transcript.jsonl"
    with session_lock(one):
        with pytest.raises(SessionBusyError), session_lock(one):
            pass
        with session_lock(two):  # another session is free
            pass
    with session_lock(one):  # released
        pass
    assert one.stat().st_mode & 0o777 == 0o600
    assert one.parent.stat().st_mode & 0o777 == 0o700
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "s1")
    with pytest.raises(OSError, match="symlink"), session_lock(linked / "transcript.jsonl"):
        pass


def test_the_cli_refuses_a_session_in_use_or_a_reused_id(tmp_path: Path) -> None:
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "x"}])) as server:
        first = _cli(server, tmp_path, "first task", "--session-id", "dup")
        assert first.returncode == 0, first.stderr
        again = _cli(server, tmp_path, "second task", "--session-id", "dup")
        assert again.returncode == 2 and "already exists" in again.stderr
        transcript = ".sluicegate/dup/transcript.jsonl"
        with session_lock(tmp_path / transcript):
            busy = _cli(server, tmp_path, "--resume", transcript, "go on")
            # another store root, another directory: the lock is the transcript's own
            other = _cli(server, tmp_path, "--resume", transcript, "go", "--store", "other")
            (tmp_path / "elsewhere").mkdir()
            away = _cli(server, tmp_path / "elsewhere", "--resume", f"../{transcript}", "go")
        for done in (busy, other, away):
            assert done.returncode == 1 and "in use by another process" in done.stderr
        assert len(server.requests) == 1
    t = load_transcript(tmp_path / ".sluicegate" / "dup" / "transcript.jsonl")
    assert [m.type for m in t.messages] == ["user", "assistant"]


def test_resume_from_another_directory_keeps_the_store_of_the_session(tmp_path: Path) -> None:
    a = tmp_path / "A"
    big = "line\n" * 20_000
    replies = iter(
        [
            Reply([{"type": "tool_use", "id": "t1", "name": "emit", "input": {}}], "tool_use"),
            Reply([{"type": "text", "text": "saved"}]),
            Reply([{"type": "text", "text": "read"}]),
        ]
    )

    @tool(input_schema={"type": "object", "properties": {}})
    async def emit() -> str:
        """Emit a lot."""
        return big

    with ScriptedMessagesServer(lambda _b: next(replies)) as server:
        client = sdk_client(server.base_url)
        sid = "mv1"
        ctx = SessionContext(
            sid,
            a / ".sluicegate",
            transcript=TranscriptWriter(a / ".sluicegate" / sid / "transcript.jsonl", sid),
        )
        agent = Agent(
            client, model="m", pipeline=Pipeline([ToolResultBudget()]), ctx=ctx, tools=[emit]
        )
        anyio.run(agent.run, "go")
        path = a / ".sluicegate" / sid / "transcript.jsonl"
        elsewhere = tmp_path / "B"
        elsewhere.mkdir()
        cwd = Path.cwd()
        os.chdir(elsewhere)
        try:
            assert (
                store_root_of(Path("..") / "A" / ".sluicegate" / sid / "transcript.jsonl", sid)
                == (a / ".sluicegate").resolve()
            )
            resumed = Agent.resume(path, client, model="m", pipeline=Pipeline([ToolResultBudget()]))
        finally:
            os.chdir(cwd)
    assert Path(resumed.ctx.root).resolve() == (a / ".sluicegate").resolve()
    saved = a / ".sluicegate" / sid / "tool-results" / "t1.txt"
    assert saved.read_text() == big
    assert not (elsewhere / ".sluicegate").exists()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["hi"], {"ANTHROPIC_API_KEY": ""}, "no API key"),
        (["hi", "--max-retries", "-5"], {}, "--max-retries must be from 0 to 10"),
        (["hi"], {"ANTHROPIC_BASE_URL": "http://[::1"}, "ANTHROPIC_BASE_URL"),
        (["hi"], {"ANTHROPIC_BASE_URL": "ftp://host"}, "ANTHROPIC_BASE_URL"),
        (["hi", "--store", "afile"], {}, "not a directory"),
        (["hi", "--session-id", "../../etc"], {}, "--session-id"),
        (["hi"], {"ANTHROPIC_BASE_URL": "http://a\x7f/"}, "ANTHROPIC_BASE_URL"),
        (["hi"], {"ANTHROPIC_API_KEY": "k\u00ff"}, "ANTHROPIC_API_KEY"),
        (["hi", "--timeout", "-1"], {}, "--timeout"),
        (["hi", "--timeout", "nan"], {}, "--timeout"),
        (["--resume", "nosid.jsonl", "go"], {}, "no session id"),
        (["--resume", "badsid.jsonl", "go"], {}, "cannot resume"),
    ],
)
def test_setup_errors_are_one_line_and_leave_nothing_behind(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "afile").write_text("x")
    record = {
        "type": "user",
        "uuid": "u1",
        "message": {"role": "user", "content": "hi"},
    }
    (tmp_path / "nosid.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "badsid.jsonl").write_text(json.dumps({**record, "sessionId": "../../etc"}) + "\n")
    base = {"ANTHROPIC_API_KEY": "k", "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"}
    done = _cli(None, tmp_path, *args, **(base | env))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    assert not (tmp_path / ".sluicegate").exists()


def test_a_stalled_api_fails_after_the_timeout(tmp_path: Path) -> None:
    released = threading.Event()

    def stall(_body: dict[str, Any]) -> Reply:
        released.wait(120)  # the reply comes only once the command has ended
        return Reply([{"type": "text", "text": "too late"}])

    with ScriptedMessagesServer(stall) as server:
        try:
            done = _cli(server, tmp_path, "hi", "--timeout", "1", "--max-retries", "0")
        finally:
            released.set()
    # it ended before any reply existed: it did not wait for one
    assert done.returncode == 1 and "API error: timeout" in done.stderr, done.stderr


def test_retries_are_bounded_in_number_and_in_wait(tmp_path: Path) -> None:
    replies: list[Reply | ScriptError] = [
        ScriptError(529, "overloaded_error", "busy", headers={"retry-after": "0"}),
        Reply([{"type": "text", "text": "after one retry"}]),
    ]
    it = iter(replies)
    with ScriptedMessagesServer(lambda _b: next(it)) as server:
        agent = _agent(server, tmp_path, retry=RetryPolicy(retries=2))
        result = anyio.run(agent.run, "hello")
    assert result.text == "after one retry" and len(server.requests) == 2

    # the API asks for a day: refused at once, not waited for
    far = ScriptError(429, "rate_limit_error", "slow down", headers={"retry-after": "100000"})
    with ScriptedMessagesServer(lambda _b: far) as server:
        agent = _agent(server, tmp_path / "2", retry=RetryPolicy(retries=5, max_wait=60))
        with pytest.raises(AgentAPIError) as info:
            anyio.run(agent.run, "hello")
        assert len(server.requests) == 1
    assert info.value.kind == "rate_limited" and info.value.retry_after == 100_000

    policy = RetryPolicy(retries=3, base_delay=0.5, max_delay=2)
    assert [policy.wait_before(n, "server", None) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, None]
    assert policy.wait_before(1, "bad_request", None) is None
    assert policy.wait_before(1, "bad_response", None) is None
    with pytest.raises(ValueError):
        RetryPolicy(retries=-5)
    with pytest.raises(ValueError):
        RetryPolicy(max_wait=float("nan"))
    assert retry_after_seconds({"retry-after-ms": "1500"}) == 1.5
    assert retry_after_seconds({"retry-after": "nonsense"}) is None
    # a wait past any max_wait (or past any calendar) means: do not retry
    assert retry_after_seconds({"retry-after": "inf"}) == math.inf
    assert retry_after_seconds({"retry-after": "nan"}) is None
    assert retry_after_seconds({"retry-after": "Mon, 01 Jan 99999 00:00:00 GMT"}) == math.inf
    assert policy.wait_before(1, "server", math.inf) is None


def test_a_retry_after_date_past_any_calendar_is_a_typed_error(tmp_path: Path) -> None:
    far = ScriptError(
        429, "rate_limit_error", "slow", headers={"retry-after": "Mon, 01 Jan 99999 00:00:00 GMT"}
    )
    with ScriptedMessagesServer(lambda _b: far) as server:
        agent = _agent(server, tmp_path, retry=RetryPolicy(retries=3))
        with pytest.raises(AgentAPIError) as info:
            anyio.run(agent.run, "hello")
        assert len(server.requests) == 1
    assert info.value.kind == "rate_limited" and info.value.retry_after == math.inf


# -- fuzz: any body a server may answer with ---------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["id", "type", "role", "model", "content", "stop_reason", "usage"]
BLOCK_FIELDS = ["type", "text", "id", "name", "input", "thinking"]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A valid message with some fields (or block fields) replaced by arbitrary JSON, or
    removed; now and then raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    body: dict[str, Any] = json.loads(_message(content=_uses("t1", "t2"), stop_reason="tool_use"))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        if draw(st.booleans()):
            body[name] = draw(JSON)
        else:
            body.pop(name, None)
    if isinstance(body.get("content"), list) and body["content"] and draw(st.booleans()):
        block = body["content"][0]
        if isinstance(block, dict):
            block[draw(st.sampled_from(BLOCK_FIELDS))] = draw(JSON)
    if isinstance(body.get("usage"), dict) and draw(st.booleans()):
        body["usage"]["input_tokens"] = draw(JSON)
    return json.dumps(body).encode()


@pytest.mark.slow
def test_fuzz_any_response_body_is_a_record_or_a_typed_error(tmp_path: Path) -> None:
    current: list[bytes] = [b""]
    with ScriptedMessagesServer(lambda _b: RawReply(current[0])) as server:
        counter = iter(range(10**6))

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(bodies())
        def check(body: bytes) -> None:
            current[0] = body
            root = tmp_path / str(next(counter))
            agent = _agent(server, root)
            agent.history = [user_text("hello")]
            try:
                message = anyio.run(agent.turn)
            except AgentAPIError as exc:
                assert exc.kind == "bad_response" and len(str(exc)) < 400
                path = root / "s1" / "transcript.jsonl"
                assert not path.exists() or not path.read_text()  # nothing of it is written
                return
            # accepted: what was recorded loads back strictly as the same record
            loaded = load_transcript(root / "s1" / "transcript.jsonl").messages
            assert loaded[0].content == message.content
            assert check_pairing(to_api(agent.history)) == []

        check()


def test_the_agent_asks_for_its_prefix_to_be_cached(tmp_path: Path) -> None:
    replies = iter(
        [
            _message(content=_uses("c1"), stop_reason="tool_use"),
            _message(),
        ]
    )
    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent = _agent(server, tmp_path)
        anyio.run(agent.run, "hello")
        first, second = (r["messages"] for r in server.requests)
    # the first request is a plain string prompt: it stays one, with nothing to mark
    assert first == [{"role": "user", "content": "hello"}]
    marked = [
        (i, b["type"]) for i, m in enumerate(second) for b in m["content"]
        if isinstance(m["content"], list) and "cache_control" in b
    ]  # fmt: skip
    assert marked == [(2, "tool_result")]  # one breakpoint, on the last block
    recorded = load_transcript(tmp_path / "s1" / "transcript.jsonl").messages
    assert "cache_control" not in json.dumps([m.content for m in recorded])


def test_a_breakpoint_on_an_older_message_is_taken_back_next_turn(tmp_path: Path) -> None:
    """The agent's request is the wire cache's own list, updated in place. When the last
    messages cannot carry a breakpoint (string prompts, a thinking-only reply), it goes on an
    older message, which the next request must restore: every request carries exactly one."""
    thinking = [{"type": "thinking", "thinking": "hm", "signature": "sig"}]
    replies = iter([_message(), _message(id="msg_t", content=thinking), _message(id="msg_z")])
    logs: list[TurnLog] = []
    seen: list[str] = []

    def keep(log: TurnLog) -> None:
        logs.append(log)
        seen.append(json.dumps(log.request))

    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent = _agent(server, tmp_path, on_turn=keep)
        for prompt in ("one", "two", "three"):
            anyio.run(agent.run, prompt)
        sent = [r["messages"] for r in server.requests]
    marks = [
        [i for i, m in enumerate(request) if "cache_control" in json.dumps(m)] for request in sent
    ]
    # "three" follows a thinking-only reply and a string prompt: the mark goes back to index 1
    assert marks == [[], [1], [1]]
    assert len(sent[2]) == 5  # the mark sits before the last two messages (the cache's own)
    for request, log, before in zip(sent, logs, seen, strict=True):
        assert json.dumps(log.request) == before  # an observer's copy never changes later
        assert json.loads(before) == request  # and it is what was sent
    replies = iter([_message(id="msg_4")])
    with ScriptedMessagesServer(lambda _b: RawReply(next(replies))) as server:
        agent.client = sdk_client(server.base_url)
        anyio.run(agent.run, "four")
        fourth = server.requests[0]["messages"]
    # a new last message that can carry the mark: the older one is restored, unmarked
    assert [i for i, m in enumerate(fourth) if "cache_control" in json.dumps(m)] == [5]
    assert without_cache_control(fourth) == json.loads(json.dumps(to_api(agent.history[:-1])))


def test_two_runs_of_one_agent_at_once_each_send_their_own_request(tmp_path: Path) -> None:
    """The request cache's list serves one turn at a time: a turn that starts while another
    waits to retry builds a list of its own, and the retry resends what it first sent."""
    calls = iter(range(10))
    refused = threading.Event()

    def script(_body: dict[str, Any]) -> Reply | ScriptError:
        if next(calls) == 0:  # the first run's first attempt: retried after 1.5 s
            refused.set()
            return ScriptError(529, "overloaded_error", "busy", headers={"retry-after": "1.5"})
        return Reply([{"type": "text", "text": "done"}])

    logs: list[str] = []
    with ScriptedMessagesServer(script) as server:
        agent = _agent(
            server,
            tmp_path,
            retry=RetryPolicy(retries=2),
            on_turn=lambda log: logs.append(json.dumps(log.request)),
        )

        async def both() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent.run, "from A")
                await anyio.to_thread.run_sync(refused.wait, 60)  # A is to wait and retry
                tg.start_soon(agent.run, "from B")  # its call goes out in A's wait

        anyio.run(both)
        sent = [json.dumps(r["messages"]) for r in server.requests]
    first, retry = sent[0], sent[2]
    assert first == retry == json.dumps([{"role": "user", "content": "from A"}])
    assert logs[-1] == first  # A's turn ends last, and logs what it sent
    assert "from B" in logs[0] and "from B" in sent[1]


def test_an_id_another_run_recorded_during_the_call_is_refused(tmp_path: Path) -> None:
    """The ids a response may not reuse are read when it arrives: a run of the same agent that
    recorded "dup" while this call was in flight makes this response's "dup" a bad response,
    and the history (and its transcript) keeps one "dup"."""

    @tool(input_schema={"type": "object", "properties": {}})
    async def slow() -> str:
        """Answer (its name is what the calls use)."""
        return "pong"

    a_in_flight, b_recorded = threading.Event(), threading.Event()

    def script(body: dict[str, Any]) -> Reply:
        text = json.dumps(body["messages"])
        dup = [{"type": "tool_use", "id": "dup", "name": "slow", "input": {}}]
        if "from A" in text and "from B" not in text:  # A's first call: answered last
            a_in_flight.set()
            b_recorded.wait(60)
            return Reply(dup, stop_reason="tool_use")
        if "from B" in text and '"dup"' not in text:  # B's first call: at once
            return Reply(dup, stop_reason="tool_use")
        if "from B" in text:  # B's next call answers "dup": B recorded it
            b_recorded.set()
        return Reply([{"type": "text", "text": "done"}])

    errors: list[str] = []
    with ScriptedMessagesServer(script) as server:
        client = sdk_client(server.base_url)
        ctx = SessionContext("s1", tmp_path, logger=QuietLogger())
        agent = Agent(client, model="m", pipeline=Pipeline([]), ctx=ctx, tools=[slow])

        async def run(prompt: str) -> None:
            try:
                await agent.run(prompt)
            except AgentAPIError as error:
                errors.append(error.kind)

        async def both() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "from A")
                await anyio.to_thread.run_sync(a_in_flight.wait, 60)  # A's call is in flight
                tg.start_soon(run, "from B")

        anyio.run(both)
    assert errors == ["bad_response"]
    uses = [
        b.get("id") for m in agent.history if m.type == "assistant" for b in m.blocks
        if b.get("type") == "tool_use"
    ]  # fmt: skip
    assert uses.count("dup") == 1
    assert check_pairing(to_api(agent.history)) == []
