"""Transcripts under hostile conditions: values in error messages stay short, a byte order mark
at the start is accepted, and the writer never follows a planted link and keeps the
conversation private (file 0600, directories 0700)."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, SessionContext, TranscriptWriter, load_transcript
from pipeline.transcript.read import TranscriptError, TranscriptPathError
from tests.builders import json_paths

SESSION = "5f0c1e2a-0000-4000-8000-000000000001"


def _user(uuid: str, text: str, parent: str | None = None) -> dict[str, Any]:
    return {
        "type": "user",
        "uuid": uuid,
        "parentUuid": parent,
        "sessionId": SESSION,
        "message": {"role": "user", "content": text},
    }


def _lines(*records: Any) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# --------------------------------------------------------------------------------------------
# Error messages quote values briefly
# --------------------------------------------------------------------------------------------

HUGE_ENTRIES: list[tuple[str, dict[str, Any]]] = [
    ("id-a-huge-list", {"tool_use_id": [0] * 3_000_000, "replacement": "r"}),
    ("id-a-huge-dict", {"tool_use_id": {str(i): i for i in range(200_000)}, "replacement": "r"}),
    ("kind-a-huge-dict", {"tool_use_id": "t", "replacement": "r", "kind": {"k": "v" * 10**6}}),
    ("huge-id-no-replacement", {"tool_use_id": "x" * 5_000_000, "replacement": 5}),
    ("huge-id-bad-kind", {"tool_use_id": "x" * 5_000_000, "replacement": "r", "kind": [1]}),
    ("digest-a-huge-string", {"tool_use_id": "t", "replacement": "r", "digest": "0" * 5_000_000}),
    ("digest-a-huge-list", {"tool_use_id": "t", "replacement": "r", "digest": [0] * 3_000_000}),
]


@pytest.mark.parametrize("entry", [e for _, e in HUGE_ENTRIES], ids=[n for n, _ in HUGE_ENTRIES])
def test_a_hostile_value_is_quoted_briefly(tmp_path: Path, entry: dict[str, Any]) -> None:
    path = tmp_path / "t.jsonl"
    record = {"type": "content-replacement", "sessionId": SESSION, "replacements": [entry]}
    path.write_text(_lines(_user("u1", "hi"), record), encoding="utf-8")
    with pytest.raises(TranscriptError) as info:
        load_transcript(path)
    assert info.value.line == 2 and "replacement record" in info.value.reason
    assert len(str(info.value)) < len(str(path)) + 300
    lenient = load_transcript(path, strict=False)
    [problem] = lenient.problems
    assert len(problem.reason) < 300 and [m.uuid for m in lenient.messages] == ["u1"]


def test_a_short_bad_value_is_still_shown_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record = {"type": "content-replacement", "replacements": [{"tool_use_id": 42}]}
    path.write_text(_lines(record), encoding="utf-8")
    with pytest.raises(TranscriptError, match=r"bad tool_use_id 42$"):
        load_transcript(path)


@pytest.mark.parametrize("digest", ["abc", "0" * 31, "0" * 33, "A" * 32, 7])
def test_a_digest_that_is_not_32_hex_digits_is_refused(tmp_path: Path, digest: Any) -> None:
    path = tmp_path / "t.jsonl"
    entry = {"tool_use_id": "t", "replacement": "r", "digest": digest}
    path.write_text(_lines({"type": "content-replacement", "replacements": [entry]}), "utf-8")
    with pytest.raises(TranscriptError, match=rf"replacement record 't': bad digest {digest!r}$"):
        load_transcript(path)


# --------------------------------------------------------------------------------------------
# A byte order mark at the start of the file
# --------------------------------------------------------------------------------------------


def test_a_byte_order_mark_at_the_start_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _lines(_user("u1", "one"), _user("u2", "two")).encode())
    t = load_transcript(path)  # strict
    assert [m.uuid for m in t.messages] == ["u1", "u2"] and t.problems == []
    assert t.session_id == SESSION


def test_a_byte_order_mark_anywhere_else_is_still_malformed(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(_lines(_user("u1", "one")).encode() + b"\xef\xbb\xbf" + b"{}\n")
    with pytest.raises(TranscriptError) as info:
        load_transcript(path)
    assert info.value.line == 2


def test_appending_to_a_file_with_a_byte_order_mark_continues_its_chain(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _lines(_user("u1", "one")).encode())
    TranscriptWriter(path, SESSION).append_messages([Message.user("two", uuid="u2")])
    t = load_transcript(path)
    assert [m.uuid for m in t.messages] == ["u1", "u2"]
    last = json.loads(path.read_text(encoding="utf-8").splitlines()[-1])
    assert last["parentUuid"] == "u1"


# --------------------------------------------------------------------------------------------
# Writing: no link is followed, the conversation stays private
# --------------------------------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_a_symlink_planted_at_the_transcript_is_refused(tmp_path: Path, victim: Path) -> None:
    session = tmp_path / ".sluicegate" / "pred"
    session.mkdir(parents=True)
    (session / "transcript.jsonl").symlink_to(victim)
    with pytest.raises(TranscriptPathError, match="symbolic link"):
        TranscriptWriter(session / "transcript.jsonl", "pred")
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("hold_open", [False, True], ids=["opened-each-time", "held-open"])
def test_a_symlink_planted_after_the_writer_opened_is_refused(
    tmp_path: Path, victim: Path, hold_open: bool
) -> None:
    """Also by a writer that keeps its descriptor: the file it holds is no longer linked."""
    path = tmp_path / "s" / "transcript.jsonl"
    writer = TranscriptWriter(path, "s", hold_open=hold_open)
    writer.append_messages([Message.user("first")])
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(TranscriptPathError):
        writer.append_messages([Message.user("secret prompt")])
    assert victim.read_text() == "precious\n"


def test_a_dangling_symlink_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    path = tmp_path / "transcript.jsonl"
    target = tmp_path / "elsewhere.jsonl"
    path.symlink_to(target)
    with pytest.raises(TranscriptPathError):
        TranscriptWriter(path, "s").append_messages([Message.user("hello")])
    assert not target.exists()


def test_a_symlinked_session_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / ".sluicegate"
    root.mkdir()
    (root / "pred").symlink_to(elsewhere, target_is_directory=True)
    path = root / "pred" / "transcript.jsonl"
    with pytest.raises(TranscriptPathError, match="directory"):
        TranscriptWriter(path, "pred").append_messages([Message.user("hello")])
    assert list(elsewhere.iterdir()) == []


def _blocks_at_most(seconds: float, call: Callable[[], object], fifo: Path) -> BaseException | None:
    """Run ``call`` in a thread; fail when it blocks longer than ``seconds`` (then unblock it
    with a writer that opens the FIFO and closes it at once)."""
    caught: list[BaseException | None] = []

    def body() -> None:
        try:
            call()
            caught.append(None)
        except BaseException as exc:  # handed to the test thread
            caught.append(exc)

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=seconds)
        pytest.fail("the writer blocked on a FIFO")
    return caught[0]


def test_a_fifo_in_place_of_the_transcript_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "transcript.jsonl"
    os.mkfifo(path)
    error = _blocks_at_most(10, lambda: TranscriptWriter(path, "s"), path)
    assert isinstance(error, TranscriptPathError) and "regular file" in str(error)


def test_the_session_directories_and_transcript_are_private(
    tmp_path: Path, umask_zero: None
) -> None:
    root = tmp_path / "deep" / ".sluicegate"
    ctx = SessionContext(
        "s1", root, transcript=TranscriptWriter(root / "s1" / "transcript.jsonl", "s1")
    )
    assert ctx.transcript is not None
    ctx.transcript.append_messages([Message.user("hello")])
    for d in (tmp_path / "deep", root, root / "s1"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE((root / "s1" / "transcript.jsonl").stat().st_mode) == 0o600


def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)  # whatever the umask
    TranscriptWriter(shared / "t.jsonl", "s").append_messages([Message.user("hello")])
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # not ours to change
    assert stat.S_IMODE((shared / "t.jsonl").stat().st_mode) == 0o600


# --------------------------------------------------------------------------------------------
# Property: a huge value anywhere in a record never makes a long reason
# --------------------------------------------------------------------------------------------

RECORDS: list[dict[str, Any]] = [
    _user("u1", "hello"),
    {
        "type": "assistant",
        "uuid": "a1",
        "sessionId": SESSION,
        "message": {
            "id": "msg_1",
            "model": "m",
            "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}],
            "usage": {"input_tokens": 3, "output_tokens": 5},
            "stop_reason": "tool_use",
        },
    },
    {
        "type": "user",
        "uuid": "u2",
        "message": {"content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    },
    {
        "type": "content-replacement",
        "replacements": [{"kind": "tool-result", "tool_use_id": "t1", "replacement": "r"}],
    },
    {"type": "stage-record", "stage": "history_snip", "data": {"removed": ["u1"]}},
]


PLACES = [(i, p) for i, r in enumerate(RECORDS) for p in json_paths(r)]
HUGE: list[Any] = [
    [0] * 200_000,
    {f"k{i}": i for i in range(50_000)},
    "x" * 1_000_000,
    10**4000,
    [[[[["deep"] * 1_000]]]],
]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(place=st.sampled_from(PLACES), value=st.sampled_from(HUGE))
def test_a_huge_value_anywhere_gives_a_short_reason(
    tmp_path_factory: pytest.TempPathFactory, place: tuple[int, tuple[str | int, ...]], value: Any
) -> None:
    index, path = place
    records = json.loads(json.dumps(RECORDS))
    node: Any = records[index]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = tmp_path_factory.mktemp("huge") / "t.jsonl"
    file.write_text(_lines(*records), encoding="utf-8")
    loaded = load_transcript(file, strict=False)  # never raises
    assert all(len(p.reason) < 400 for p in loaded.problems)
