"""The object-store backend on obstore's in-memory store: the same code as on S3, fast, with
faults put at single calls of a real store (``Wrapped``)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")

from obstore.exceptions import GenericError
from obstore.store import MemoryStore

from pipeline import Message, Pipeline, SessionContext, ToolPolicies, to_api
from pipeline.gate import describe_error
from pipeline.results.keys import PERSISTED_OUTPUT_TAG, content_digest
from pipeline.store import object_reader as objectreader
from pipeline.store.files import StoreError
from pipeline.store.object_reader import ObjectOutputReader, index_lines
from pipeline.store.object_records import APPEND_ATTEMPTS, ObjectRecordLog
from pipeline.store.objects import ObjectLayout, ObjectToolResultStore, normalize_prefix
from pipeline.store.readback import PersistedOutputReader, ReadbackError, _count_lines
from pipeline.testing import QuietLogger, SpanRecorder
from pipeline.tracing import ATTR
from pipeline.transcript.read import (
    TranscriptError,
    jsonl_lines,
    load_transcript,
    load_transcript_lines,
)
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.objectstore_support import Outage, Wrapped, keys_of

SESSION = "sess-mem"
WHERE: dict[str, str] = {"prefix": "p", "session_id": SESSION, "uri_base": "memory://"}
RESULTS = f"p/{SESSION}/tool-results"
RECORDS = f"p/{SESSION}/records"


def _sent_results(out: list[Message]) -> list[dict[str, Any]]:
    """The tool_result blocks of the request built from ``out``."""
    return [
        b
        for m in to_api(out)
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


def _turn(tid: str, content: str) -> list[Message]:
    return [assistant(f"m_{tid}", tool_use(tid, "Bash")), results(tool_result(tid, content))]


# --------------------------------------------------------------------------------------------
# the tool-result store
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_persist_reuse_and_content_named_objects() -> None:
    memory = MemoryStore()
    store = ObjectToolResultStore(memory, **WHERE)
    uri = await store.persist("toolu_1", "abc\n", "txt")
    assert uri == f"memory:///{RESULTS}/toolu_1.txt"
    assert await store.persist("toolu_1", "abc\n", "txt") == uri
    other = await store.persist("toolu_1", "abd\n", "txt")
    assert other.startswith(f"memory:///{RESULTS}/toolu_1.") and other.endswith(".txt")
    assert await store.persist("toolu_1", "abd\n", "txt") == other
    # other bytes under both names (planted): nowhere left to put it
    planted = ObjectToolResultStore(memory, **WHERE)
    memory.put(f"{RESULTS}/toolu_2.txt", b"one\n")
    digest = hashlib.sha256(b"two\n").hexdigest()[:12]
    memory.put(f"{RESULTS}/toolu_2.{digest}.txt", b"owt\n")
    with pytest.raises(StoreError) as caught:
        await planted.persist("toolu_2", "two\n", "txt")
    assert caught.value.errno == errno.EEXIST
    assert bytes(memory.get(f"{RESULTS}/toolu_2.txt").bytes()) == b"one\n"  # left alone
    with pytest.raises(ValueError, match="extension"):
        await store.persist("toolu_3", "x", "exe")


@pytest.mark.asyncio
async def test_an_object_that_vanishes_after_a_conflict_fails_cleanly() -> None:
    memory = MemoryStore()
    memory.put(f"{RESULTS}/toolu_1.txt", b"theirs\n")
    wrapped = Wrapped(memory)

    def gone(*_args: Any, **_kw: Any) -> None:
        raise FileNotFoundError("pruned meanwhile")

    wrapped.before["get"] = gone
    with pytest.raises(StoreError) as caught:
        await ObjectToolResultStore(wrapped, **WHERE).persist("toolu_1", "mine\n", "txt")
    assert caught.value.errno == errno.EAGAIN
    assert wrapped.calls["put"] == 2  # tried to create it again once


@pytest.mark.asyncio
async def test_a_store_error_becomes_persist_failed_without_its_text(tmp_path: Path) -> None:
    """Whatever a store raises, the budget sends the original and names the error by type:
    obstore's messages carry URLs and server replies."""
    wrapped = Wrapped(MemoryStore())

    def refuse(*_args: Any, **_kw: Any) -> None:
        raise GenericError("PUT https://bucket.s3/x?X-Amz-Credential=AKIDLEAK failed")

    wrapped.before["put"] = refuse
    spans, logger = SpanRecorder(), QuietLogger()
    ctx = SessionContext(
        SESSION,
        tmp_path,
        store=ObjectToolResultStore(wrapped, **WHERE),
        transcript=ObjectRecordLog(wrapped, **WHERE),
        tool_policies=ToolPolicies(cap=100),
        tracer=spans.tracer,
        logger=logger,
    )
    big = "x" * 500
    out = await Pipeline([ToolResultBudget()]).run([user_text("go"), *_turn("toolu_1", big)], ctx)
    (request_result,) = _sent_results(out)
    assert request_result["content"] == big
    assert ctx.report.persist_failed == ["toolu_1"]
    (span,) = spans.decision_attributes("tool_result_budget")
    assert span[ATTR.DECISION] == "persist_failed" and span[ATTR.ERROR] == "GenericError"
    assert "AKIDLEAK" not in repr([dict(s.attributes or {}) for s in spans.spans])
    assert "AKIDLEAK" not in repr(logger.events)
    # the decision record failed too (the same store): an OSError, logged
    assert ("error", "stage_record.write_failed") in [(lv, ev) for lv, ev, _ in logger.events]


# --------------------------------------------------------------------------------------------
# the record log
# --------------------------------------------------------------------------------------------


def test_appends_number_objects_and_chain_messages() -> None:
    memory = MemoryStore()
    log = ObjectRecordLog(memory, writer_id="w", **WHERE)
    assert log.load() is None  # nothing recorded yet: as a missing transcript file
    first, second = user_text("a"), user_text("b")
    log.append_messages([first])
    log.append_messages([second])
    log.append_replacements([])  # nothing to record: no object
    assert keys_of(memory) == [f"{RECORDS}/000000000000.jsonl", f"{RECORDS}/000000000001.jsonl"]
    other = ObjectRecordLog(memory, writer_id="v", **WHERE)
    loaded = other.load()
    assert loaded is not None and [m.content for m in loaded.messages] == ["a", "b"]
    third = user_text("c")
    other.append_messages([third])  # chains from the last message it loaded
    again = ObjectRecordLog(memory, **WHERE).load()
    assert again is not None
    assert [m.uuid for m in again.messages] == [first.uuid, second.uuid, third.uuid]
    line = bytes(memory.get(f"{RECORDS}/000000000002.jsonl").bytes())
    assert f'"parentUuid": "{second.uuid}"'.encode() in line


def test_conflicts_past_the_limit_fail_the_append() -> None:
    memory = MemoryStore()
    for n in range(APPEND_ATTEMPTS):
        memory.put(f"{RECORDS}/{n:012d}.jsonl", b"\n")
    blind = Wrapped(memory, stale_lists=10**6)  # it never sees what is there
    with pytest.raises(StoreError) as caught:
        ObjectRecordLog(blind, writer_id="w", **WHERE).append_stage_record("s", {})
    assert caught.value.errno == errno.EEXIST
    assert blind.calls["put"] == APPEND_ATTEMPTS


def test_store_failures_are_oserrors() -> None:
    """A record log's callers catch ``OSError`` (a failed append is logged, the turn goes on):
    a store's own exceptions come out as ``StoreError``."""
    wrapped = Wrapped(MemoryStore())

    def down(*_args: Any, **_kw: Any) -> None:
        raise GenericError("connection refused")

    wrapped.before["put"] = down
    log = ObjectRecordLog(wrapped, writer_id="w", **WHERE)
    with pytest.raises(StoreError) as caught:
        log.append_stage_record("s", {})
    assert describe_error(caught.value) == "StoreError: EIO (record append failed (GenericError))"
    del wrapped.before["put"]
    wrapped.before["list"] = down
    with pytest.raises(StoreError, match="listing"):
        log.append_stage_record("s", {})
    with pytest.raises(StoreError, match="listing"):
        log.load()


@pytest.mark.usefixtures("structlog_unconfigured")
def test_a_read_in_a_worker_thread_logs_with_the_callers_context(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the objects are read by a thread pool: its events must still say the call and the
    # trace they belong to, as every other event does
    from structlog.contextvars import bound_contextvars

    from pipeline.logs import LOGGER_NAME, get_logger

    memory = MemoryStore()
    ObjectRecordLog(memory, writer_id="w", **WHERE).append_stage_record("s", {"n": 0})
    lagging = Wrapped(memory)

    def never(path: str, **_kw: Any) -> None:
        raise FileNotFoundError(path)

    lagging.before["get"] = never
    reader = ObjectRecordLog(lagging, read_attempts=1, retry_delay=0, logger=get_logger(), **WHERE)
    spans = SpanRecorder()
    with (
        caplog.at_level("WARNING", logger=LOGGER_NAME),
        bound_contextvars(call=7),
        spans.tracer.start_as_current_span("load") as span,
    ):
        reader.load()
    [record] = [
        r for r in caplog.records if getattr(r, "event", None) == "records.unreadable_object"
    ]
    assert record.call == 7  # type: ignore[attr-defined]
    assert record.trace_id == format(span.get_span_context().trace_id, "032x")  # type: ignore[attr-defined]


def test_load_waits_for_a_listed_object_then_skips_it() -> None:
    memory = MemoryStore()
    writer = ObjectRecordLog(memory, writer_id="w", **WHERE)
    for n in range(3):
        writer.append_stage_record("s", {"n": n})
    lagging = Wrapped(memory)
    misses = {f"{RECORDS}/000000000001.jsonl": 2, f"{RECORDS}/000000000002.jsonl": 99}

    def not_yet(path: str, **_kw: Any) -> None:
        if misses.get(path, 0) > 0:
            misses[path] -= 1
            raise FileNotFoundError(path)

    lagging.before["get"] = not_yet
    logger = QuietLogger()
    reader = ObjectRecordLog(lagging, read_attempts=4, retry_delay=0, logger=logger, **WHERE)
    loaded = reader.load()
    assert loaded is not None
    assert [r.data["n"] for r in loaded.stage_records] == [0, 1]  # 1 on its third try
    assert [ev for _lv, ev, _kw in logger.events] == ["records.unreadable_object"]
    assert logger.events[0][2]["key"] == f"{RECORDS}/000000000002.jsonl"
    assert lagging.calls["get"] == 1 + 3 + 4
    # the object skipped is still to be loaded: a worker asking for news is told so
    assert reader.changed_elsewhere() is True
    misses.clear()
    again = reader.load()
    assert again is not None and [r.data["n"] for r in again.stage_records] == [0, 1, 2]
    assert lagging.calls["get"] == 1 + 3 + 4 + 1  # only the one it had not read
    assert reader.changed_elsewhere() is False


def test_torn_and_foreign_objects_are_skipped_like_bad_lines() -> None:
    memory = MemoryStore()
    log = ObjectRecordLog(memory, writer_id="w", **WHERE)
    log.append_stage_record("s", {"n": 0})
    # a torn object (no line end) followed by a good one: the good one's line stands alone
    memory.put(f"{RECORDS}/000000000001.jsonl", b'{"type": "stage-record", "sess')
    memory.put(f"{RECORDS}/000000000002.jsonl", b"not json\n" + log_line(1))
    memory.put(f"{RECORDS}/notes.txt", b"ignored: not a record name\n")
    memory.put(f"{RECORDS}/000000000003-bad id.jsonl", log_line(99))
    memory.put(f"{RECORDS}/12-x.jsonl", log_line(98))
    logger = QuietLogger()
    loaded = ObjectRecordLog(memory, logger=logger, **WHERE).load()
    assert loaded is not None
    assert [r.data["n"] for r in loaded.stage_records] == [0, 1]
    assert [p.line for p in loaded.problems] == [2, 3]
    warned = [(kw["key"], kw["line"]) for _lv, ev, kw in logger.events if ev.endswith("line")]
    assert warned == [
        (f"{RECORDS}/000000000001.jsonl", 1),
        (f"{RECORDS}/000000000002.jsonl", 1),
    ]


def log_line(n: int) -> bytes:
    return b'{"type": "stage-record", "sessionId": "s", "stage": "s", "data": {"n": %d}}\n' % n


def test_bad_names_and_places_are_refused() -> None:
    memory = MemoryStore()
    for bad in ("a b", "", "x" * 65, "a/b", "é"):
        with pytest.raises(ValueError, match="writer_id"):
            ObjectRecordLog(memory, writer_id=bad, **WHERE)
    for prefix in ("a/../b", "./a", "a//b/..", "a b", "a?b"):
        with pytest.raises(ValueError, match="segment"):
            normalize_prefix(prefix)
    assert normalize_prefix("/a/b/") == "a/b"
    for base in ("s3:/bucket", "bucket", "s3://b?x=1", 5):
        with pytest.raises(ValueError, match="uri_base"):
            ObjectLayout(SESSION, "", base)  # type: ignore[arg-type]
    assert ObjectLayout(SESSION, "", "s3://b/").uri("k") == "s3://b/k"
    assert ObjectLayout(SESSION, "", "memory://").uri("k") == "memory:///k"


# --------------------------------------------------------------------------------------------
# reading records from memory = reading the file
# --------------------------------------------------------------------------------------------

_TRANSCRIPT = (
    "\ufeff"
    '{"type": "user", "uuid": "u1", "sessionId": "s", "message": {"role": "user", '
    '"content": "a\\u2028b"}}\n'
    '{"type": "user", "uuid": "u2", "sessionId": "s",\r "message": {"role": "user", '
    '"content": "line\u2028sep\u0085nel"}}\n'
    "\n"
    '{"type": "stage-record", "sessionId": "s", "stage": "x", "data": {}}\n'
    '{"type": "content-replacement", "replacements": [{"tool_use_id": "t", "replacement": 5}]}\n'
    '{"type": "user", "uuid": "u3", "message": {"role": "us'
)


@pytest.mark.parametrize("strict", [False, True])
def test_lines_from_memory_load_as_the_file_does(tmp_path: Path, strict: bool) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(_TRANSCRIPT.encode())
    if strict:
        with pytest.raises(TranscriptError) as from_file:
            load_transcript(path)
        with pytest.raises(TranscriptError) as from_memory:
            load_transcript_lines(jsonl_lines(_TRANSCRIPT), path)
        assert str(from_memory.value) == str(from_file.value)
        return
    expected = load_transcript(path, strict=False)
    loaded = load_transcript_lines(jsonl_lines(_TRANSCRIPT), path, strict=False)
    assert repr(loaded) == repr(expected)  # records compare by identity: by their fields
    assert [m.content for m in loaded.messages] == ["a\u2028b", "line\u2028sep\u0085nel"]
    assert [p.line for p in loaded.problems] == [5, 6]
    assert list(jsonl_lines("a\rb\u2028c\nd")) == ["a\rb\u2028c\n", "d"]


# --------------------------------------------------------------------------------------------
# read-back: the same pages as the local reader, whatever the text
# --------------------------------------------------------------------------------------------

_PIECES = st.sampled_from(["a", "é", "字", "😀", "\n", "\r", "\r\n", " ", "xxxxxxxx", "\t"])


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(_PIECES, max_size=120).map("".join),
    offset=st.integers(1, 40),
    limit=st.integers(1, 12),
    max_chars=st.integers(1, 60),
)
def test_object_pages_equal_file_pages(text: str, offset: int, limit: int, max_chars: int) -> None:
    """Marks every 3 lines or 16 bytes (instead of 1,000 / 1 MiB) so that pages start from
    marks; the page, its footer and its errors are the local reader's, byte for byte."""
    memory = MemoryStore()
    store = ObjectToolResultStore(memory, **WHERE)
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as tmp:
        patch.setattr(objectreader, "MARK_LINES", 3)
        patch.setattr(objectreader, "MARK_BYTES", 16)
        uri = anyio.run(store.persist, "toolu_1", text, "txt")
        (Path(tmp) / "r.txt").write_bytes(text.encode())
        remote = ObjectOutputReader(memory, ObjectLayout(**WHERE), max_chars=max_chars)
        here = PersistedOutputReader(tmp, max_chars=max_chars)
        pages = []
        for reader, path in ((remote, uri), (here, str(Path(tmp) / "r.txt"))):
            try:
                pages.append(anyio.run(reader, {"path": path, "offset": offset, "limit": limit}))
            except ReadbackError as exc:
                pages.append(f"error: {exc}")
        assert pages[0] == pages[1]


@given(st.lists(_PIECES, max_size=200).map("".join), st.integers(1, 7))
def test_line_index_counts_as_the_reader_does(text: str, chunk: int) -> None:
    data = text.encode()
    index = index_lines(data[i : i + chunk] for i in range(0, len(data), chunk))
    wrapper = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline="")
    assert index.total == _count_lines(wrapper)
    for before, at in zip(index.lines_before, index.offsets, strict=True):
        # a mark stands where line ``before + 1`` starts: after ``before`` line ends
        assert at == 0 or data[at - 1 : at] in (b"\n", b"\r")
        assert not (data[at - 1 : at] == b"\r" and data[at : at + 1] == b"\n")
        head = io.TextIOWrapper(io.BytesIO(data[:at]), encoding="utf-8", newline="")
        assert _count_lines(head) == before


def test_readers_share_one_definition() -> None:
    remote = ObjectOutputReader(MemoryStore(), ObjectLayout(**WHERE))
    assert remote.definition == PersistedOutputReader("/tmp").definition
    assert remote.as_tool().max_result_size_chars == float("inf")


@pytest.mark.asyncio
async def test_in_memory_session_through_the_budget(tmp_path: Path) -> None:
    """The whole path on the in-memory store: persist, replacement naming the URI, read-back,
    decisions loaded by another worker."""
    memory = MemoryStore()
    ctx = SessionContext(
        SESSION,
        tmp_path,
        store=ObjectToolResultStore(memory, **WHERE),
        transcript=ObjectRecordLog(memory, writer_id="a", **WHERE),
        tool_policies=ToolPolicies(cap=100),
        logger=QuietLogger(),
    )
    big = "".join(f"row {i}\n" for i in range(50))
    out = await Pipeline([ToolResultBudget()]).run([user_text("go"), *_turn("toolu_1", big)], ctx)
    uri = f"memory:///{RESULTS}/toolu_1.txt"
    (sent,) = _sent_results(out)
    assert sent["content"].startswith(PERSISTED_OUTPUT_TAG)
    assert f"Full output saved to: {uri}\n" in sent["content"]
    reader = ObjectOutputReader(memory, ObjectLayout(**WHERE))
    assert await reader({"path": uri, "offset": 49, "limit": 5}) == "row 48\nrow 49\n"
    loaded = ObjectRecordLog(memory, writer_id="b", **WHERE).load()
    assert loaded is not None
    assert [dataclasses.astuple(r) for r in loaded.replacement_records] == [
        ("toolu_1", sent["content"], "tool-result", content_digest(big))
    ]


def test_a_create_whose_reply_was_lost_is_not_appended_twice() -> None:
    """The client sends a create again when the reply to the first was lost: the server says
    it exists, and it holds exactly these bytes -- this append's own record, counted once."""
    memory = MemoryStore()
    lossy = Wrapped(memory)

    def lost_reply(path: str, file: bytes, *, mode: Any = None) -> None:
        memory.put(path, file, mode=mode)  # it landed; the client never heard

    lossy.before["put"] = lost_reply
    log = ObjectRecordLog(lossy, writer_id="w", **WHERE)
    log.append_stage_record("s", {"n": 0})
    del lossy.before["put"]
    log.append_stage_record("s", {"n": 1})
    assert keys_of(memory) == [f"{RECORDS}/000000000000.jsonl", f"{RECORDS}/000000000001.jsonl"]
    loaded = ObjectRecordLog(memory, **WHERE).load()
    assert loaded is not None and [r.data["n"] for r in loaded.stage_records] == [0, 1]


def test_a_log_tells_when_another_writer_recorded_and_reads_only_what_is_new() -> None:
    """A worker that keeps a session asks before each call whether others recorded since:
    one HEAD, True until it loads again; its own appends never count; a load after a move
    reads only the objects it has not read or written before (objects are immutable)."""
    memory = MemoryStore()
    mine = Wrapped(memory)
    first = ObjectRecordLog(mine, **WHERE, writer_id="a", logger=QuietLogger())
    other = ObjectRecordLog(memory, **WHERE, writer_id="b")
    first.append_stage_record("s", {"n": 1})
    assert first.changed_elsewhere() is False  # its own record
    other.append_stage_record("s", {"n": 2})
    assert first.changed_elsewhere() is True
    assert first.changed_elsewhere() is True  # still unloaded: asking again changes nothing
    gets = len(mine.gets)
    loaded = first.load()
    assert loaded is not None and [r.data["n"] for r in loaded.stage_records] == [1, 2]
    assert [key for key, _ in mine.gets[gets:]] == [f"{RECORDS}/000000000001.jsonl"]
    assert first.changed_elsewhere() is False
    # another writer's record seen by an append's own listing counts too
    other.append_stage_record("s", {"n": 3})
    first.append_stage_record("s", {"n": 4})
    assert first.changed_elsewhere() is True
    gets = len(mine.gets)
    loaded = first.load()
    assert loaded is not None and [r.data["n"] for r in loaded.stage_records] == [1, 2, 3, 4]
    assert [key for key, _ in mine.gets[gets:]] == [f"{RECORDS}/000000000002.jsonl"]


def test_the_check_for_news_is_one_head_of_the_next_number() -> None:
    """No listing: a HEAD of the number after the highest seen, however many records there
    are; it finds a record another writer added, and a worker that served the call before."""
    memory = MemoryStore()
    watched = Wrapped(memory)
    mine = ObjectRecordLog(watched, **WHERE, writer_id="a")
    other = ObjectRecordLog(memory, **WHERE, writer_id="b")
    for n in range(5):
        mine.append_stage_record("s", {"n": n})
    watched.calls.clear()
    assert mine.changed_elsewhere() is False
    other.append_stage_record("s", {"n": 5})  # number 5: the one after the highest seen
    assert mine.changed_elsewhere() is True
    assert watched.calls == {"head": 2}


def test_a_log_that_cannot_ask_the_store_says_so_and_keeps_what_it_knew() -> None:
    memory = MemoryStore()
    failing = Wrapped(memory)
    log = ObjectRecordLog(failing, **WHERE, writer_id="a", logger=QuietLogger())
    ObjectRecordLog(memory, **WHERE, writer_id="b").append_stage_record("s", {"n": 1})

    def down(*_args: Any, **_kwargs: Any) -> None:
        raise GenericError("http://127.0.0.1:1/bucket?X-Amz-Credential=secret")

    failing.before["head"] = down
    with pytest.raises(StoreError) as caught:
        log.changed_elsewhere()
    assert "secret" not in str(caught.value) and "127.0.0.1" not in str(caught.value)
    del failing.before["head"]
    assert log.changed_elsewhere() is True  # nothing was lost by the failed listing


def test_a_record_written_after_a_lagging_listing_is_still_seen_by_every_worker() -> None:
    """Worker A's listing lags and misses B's newest record: A's append still gets a number of
    its own (after a conflict), B's next check for news sees it, and every reader loads the
    records in the order they were committed."""
    memory = MemoryStore()
    lagging = Wrapped(memory)
    a = ObjectRecordLog(lagging, writer_id="a", **WHERE)
    b = ObjectRecordLog(memory, writer_id="b", **WHERE)
    b.append_stage_record("b", {"n": 0})
    b.append_stage_record("b", {"n": 1})
    a.load()
    b.append_stage_record("b", {"n": 2})
    assert b.changed_elsewhere() is False  # B's cursor is now past its own third record
    lagging.stale_lists = 1  # A's next listing sees nothing new
    a.append_stage_record("a", {"n": 0})
    assert keys_of(memory) == [f"{RECORDS}/{n:012d}.jsonl" for n in range(4)]
    assert b.changed_elsewhere() is True  # the record A wrote is found
    loaded = ObjectRecordLog(memory, **WHERE).load()
    assert loaded is not None
    assert [(r.stage, r.data["n"]) for r in loaded.stage_records] == [
        ("b", 0),
        ("b", 1),
        ("b", 2),
        ("a", 0),
    ]


def test_a_load_that_fails_midway_leaves_the_log_asking_for_another() -> None:
    """A read that fails after the listing: the log has counted the listed records as seen (its
    next number is past them) without holding them; until a load ends well, the check for
    news says True, so the worker loads again rather than go on without them."""
    memory = MemoryStore()
    other = ObjectRecordLog(memory, **WHERE, writer_id="b")
    for n in range(3):
        other.append_stage_record("s", {"n": n})
    fault = Outage(down=True)

    def second_read(path: str, **_kwargs: Any) -> None:
        if path.endswith("000000000001.jsonl"):
            fault()

    log = ObjectRecordLog(
        Wrapped(memory, before={"get": second_read}), **WHERE, writer_id="a", logger=QuietLogger()
    )
    with pytest.raises(StoreError):
        log.load()
    assert log.changed_elsewhere() is True
    fault.down = False
    loaded = log.load()
    assert loaded is not None and [r.data["n"] for r in loaded.stage_records] == [0, 1, 2]
    assert log.changed_elsewhere() is False
