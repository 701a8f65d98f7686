"""Session state on a real S3 API (moto's server on 127.0.0.1): persists through the budget,
exclusive create between racing workers (threads and processes), immutable ordered records,
a server that goes away mid-session, read-back across workers, hostile ids.

The in-memory store runs the same code paths fast in ``test_objectstore_memory.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")

from obstore.exceptions import AlreadyExistsError

from pipeline import Message, Pipeline, SessionContext, ToolPolicies, to_api
from pipeline.replacement import ReplacementRecord
from pipeline.results.keys import PERSISTED_OUTPUT_TAG
from pipeline.store.files import FileToolResultStore, StoreError
from pipeline.store.object_reader import ObjectOutputReader
from pipeline.store.object_records import ObjectRecordLog
from pipeline.store.objects import ObjectLayout, ObjectToolResultStore
from pipeline.store.readback import PersistedOutputReader, ReadbackError
from pipeline.testing import QuietLogger, SpanRecorder
from pipeline.tracing import ATTR
from pipeline.transcript.read import TranscriptWriter
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use, user_text
from tests.objectstore_support import (
    ACCESS_KEY,
    SECRET_KEY,
    MotoS3,
    Wrapped,
    keys_of,
    start_moto,
)

SESSION = "sess-fleet"
PREFIX = "fleet/sessions"
ROOT = Path(__file__).resolve().parents[1]


def where(bucket: str, session_id: str = SESSION) -> dict[str, str]:
    return {"prefix": PREFIX, "session_id": session_id, "uri_base": f"s3://{bucket}"}


def result_uri(bucket: str, name: str) -> str:
    return f"s3://{bucket}/{PREFIX}/{SESSION}/tool-results/{name}"


def rows(tag: str, n: int) -> str:
    return "".join(f"{tag} row {i}: ü 字 😀\n" for i in range(n))


@dataclasses.dataclass
class Worker:
    """One worker's view of the shared session: its own S3 client, store, log and context."""

    store: ObjectToolResultStore
    records: ObjectRecordLog
    ctx: SessionContext
    spans: SpanRecorder
    logger: QuietLogger


def worker(moto: MotoS3, bucket: str, tmp_path: Path, *, writer: str = "w1") -> Worker:
    client = moto.store(bucket)
    store = ObjectToolResultStore(client, **where(bucket))
    records = ObjectRecordLog(client, writer_id=writer, **where(bucket))
    spans, logger = SpanRecorder(), QuietLogger()
    ctx = SessionContext(
        SESSION,
        tmp_path,
        store=store,
        transcript=records,
        tool_policies=ToolPolicies(cap=1_000),
        tracer=spans.tracer,
        logger=logger,
    )
    return Worker(store, records, ctx, spans, logger)


def sent_results(messages: list[Message]) -> dict[str, Any]:
    """tool_use_id -> the content its tool_result has in the request built from ``messages``."""
    out: dict[str, Any] = {}
    for m in to_api(messages):
        if m["role"] == "user" and isinstance(m["content"], list):
            for b in m["content"]:
                if b.get("type") == "tool_result":
                    out[b["tool_use_id"]] = b["content"]
    return out


def turn(tid: str, content: str) -> list[Message]:
    return [assistant(f"msg_{tid}", tool_use(tid, "Bash")), results(tool_result(tid, content))]


# --------------------------------------------------------------------------------------------
# conditional create on the server
# --------------------------------------------------------------------------------------------


def test_server_honours_if_none_match(moto_s3: MotoS3) -> None:
    """obstore's ``mode="create"`` sends ``If-None-Match: *`` (its default S3
    ``conditional_put="etag"``) and moto answers 412: the object keeps its first bytes. Without
    the condition a put replaces the object -- the condition is what keeps a result."""
    store = moto_s3.store(moto_s3.new_bucket())
    store.put("k.txt", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        store.put("k.txt", b"second", mode="create")
    assert bytes(store.get("k.txt").bytes()) == b"first"
    store.put("k.txt", b"second")
    assert bytes(store.get("k.txt").bytes()) == b"second"


# --------------------------------------------------------------------------------------------
# persists through the budget
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_budget_persists_into_s3(moto_s3: MotoS3, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    w = worker(moto_s3, bucket, tmp_path)
    big = rows("first", 400)
    out = await Pipeline([ToolResultBudget()]).run([user_text("go"), *turn("toolu_1", big)], w.ctx)

    uri = result_uri(bucket, "toolu_1.txt")
    sent = sent_results(out)["toolu_1"]
    assert sent.startswith(PERSISTED_OUTPUT_TAG)
    assert f"Full output saved to: {uri}\n" in sent
    assert bytes(w.store.store.get(f"{PREFIX}/{SESSION}/tool-results/toolu_1.txt").bytes()) == (
        big.encode()
    )
    (persisted,) = w.ctx.report.persisted
    assert persisted.path == uri
    (span,) = w.spans.decision_attributes("tool_result_budget")
    assert span[ATTR.DECISION] == "persist" and span[ATTR.PATH] == uri

    # the same content again (a resumed session, another worker): the same object
    assert await w.store.persist("toolu_1", big, "txt") == uri
    # different content under the same id: its own content-named object
    other = rows("second", 400)
    distinct = await w.store.persist("toolu_1", other, "txt")
    assert distinct != uri and distinct.startswith(uri.removesuffix(".txt") + ".")
    key = distinct.removeprefix(f"s3://{bucket}/")
    assert bytes(w.store.store.get(key).bytes()) == other.encode()
    assert bytes(w.store.store.get(uri.removeprefix(f"s3://{bucket}/")).bytes()) == big.encode()

    # the decision is a record object, loaded back by a worker that did not make it
    loaded = worker(moto_s3, bucket, tmp_path, writer="w2").records.load()
    assert loaded is not None
    assert [r.tool_use_id for r in loaded.replacement_records] == ["toolu_1"]
    assert loaded.replacement_records[0].replacement == sent


@pytest.mark.asyncio
async def test_racing_workers_keep_one_object(moto_s3: MotoS3, tmp_path: Path) -> None:
    """Two workers persist the same results at once, each through its own S3 client: one
    object per result, and both send the same URI, holding exactly the content."""
    bucket = moto_s3.new_bucket()
    a, b = worker(moto_s3, bucket, tmp_path), worker(moto_s3, bucket, tmp_path)
    texts = {f"toolu_{i:02d}": rows(f"result {i}", 200 + i) for i in range(12)}
    uris: dict[str, list[str]] = {t: [] for t in texts}

    async def persist(w: Worker, tid: str) -> None:
        uris[tid].append(await w.store.persist(tid, texts[tid], "txt"))

    async with anyio.create_task_group() as tg:
        for tid in texts:
            tg.start_soon(persist, a, tid)
            tg.start_soon(persist, b, tid)

    client = moto_s3.store(bucket)
    for tid, text in texts.items():
        assert uris[tid] == [result_uri(bucket, f"{tid}.txt")] * 2
        assert bytes(client.get(uris[tid][0].removeprefix(f"s3://{bucket}/")).bytes()) == (
            text.encode()
        )
    assert keys_of(client) == sorted(f"{PREFIX}/{SESSION}/tool-results/{t}.txt" for t in texts)


@pytest.mark.asyncio
async def test_racing_different_content_gets_two_names(moto_s3: MotoS3, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    a, b = worker(moto_s3, bucket, tmp_path), worker(moto_s3, bucket, tmp_path)
    texts = {"a": rows("from a", 300), "b": rows("from b", 300)}
    got: dict[str, str] = {}

    async def persist(name: str, w: Worker) -> None:
        got[name] = await w.store.persist("toolu_x", texts[name], "txt")

    async with anyio.create_task_group() as tg:
        tg.start_soon(persist, "a", a)
        tg.start_soon(persist, "b", b)
    assert got["a"] != got["b"]
    assert result_uri(bucket, "toolu_x.txt") in got.values()
    client = moto_s3.store(bucket)
    for name, uri in got.items():  # each URI holds what its worker persisted
        assert bytes(client.get(uri.removeprefix(f"s3://{bucket}/")).bytes()) == (
            texts[name].encode()
        )


_PERSIST_SCRIPT = """
import sys, anyio
from pipeline.store.sessions import open_session_state
url, sid, tid, n = sys.argv[1:5]
text = "".join(f"shared row {i}\\n" for i in range(int(n)))
storage = open_session_state(url, sid, retry_config={"max_retries": 1})
print(anyio.run(storage.store.persist, tid, text, "txt"))
"""


def test_two_processes_persist_one_object_and_read_back(moto_s3: MotoS3) -> None:
    """Two worker processes, configured only by the environment (``AWS_ENDPOINT_URL``,
    ``AWS_ALLOW_HTTP``, credentials), persist the same result at once; this process -- a third
    worker -- pages through it by the URI they return."""
    bucket = moto_s3.new_bucket()
    env = {**os.environ, **moto_s3.env(), "PYTHONPATH": str(ROOT)}
    url = f"s3://{bucket}/{PREFIX}"
    args = [sys.executable, "-c", _PERSIST_SCRIPT, url, SESSION, "toolu_shared", "5000"]
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    uri = result_uri(bucket, "toolu_shared.txt")
    assert [out.strip() for out, _ in outputs] == [uri, uri]
    client = moto_s3.store(bucket)
    assert keys_of(client) == [f"{PREFIX}/{SESSION}/tool-results/toolu_shared.txt"]
    text = "".join(f"shared row {i}\n" for i in range(5000))
    assert bytes(client.get(keys_of(client)[0]).bytes()) == text.encode()

    reader = ObjectOutputReader(client, ObjectLayout(**where(bucket)))
    page = anyio.run(reader, {"path": uri, "offset": 4001, "limit": 3})
    assert page == (
        "shared row 4000\nshared row 4001\nshared row 4002\n"
        "\n[lines 4001-4003 of 5000; next: offset=4004]"
    )


# --------------------------------------------------------------------------------------------
# records: immutable objects, ordered, nothing lost
# --------------------------------------------------------------------------------------------


def test_record_create_conflict_takes_the_next_number(moto_s3: MotoS3) -> None:
    """A writer whose listing lags (or that shares its id with another) picks a number that is
    taken: the server refuses the create, the writer lists again and takes the next; both
    records land, in the order they were made."""
    bucket = moto_s3.new_bucket()
    first = ObjectRecordLog(moto_s3.store(bucket), writer_id="w", **where(bucket))
    lagging = Wrapped(moto_s3.store(bucket))
    second = ObjectRecordLog(lagging, writer_id="w", **where(bucket))
    first.append_stage_record("probe", {"n": 1})
    lagging.stale_lists = 1  # its next listing sees nothing yet
    second.append_stage_record("probe", {"n": 2})
    assert lagging.calls["put"] == 2  # the first create was refused
    records_dir = f"{PREFIX}/{SESSION}/records"
    assert keys_of(moto_s3.store(bucket), records_dir) == [
        f"{records_dir}/000000000000.jsonl",
        f"{records_dir}/000000000001.jsonl",
    ]
    loaded = ObjectRecordLog(moto_s3.store(bucket), **where(bucket)).load()
    assert loaded is not None
    assert [r.data["n"] for r in loaded.stage_records] == [1, 2]


def test_concurrent_writers_lose_nothing(moto_s3: MotoS3) -> None:
    """Two writers append at the same time from two threads: every record lands once, each
    writer's records keep their order, and every reader loads the same total order."""
    bucket = moto_s3.new_bucket()
    logs = {w: ObjectRecordLog(moto_s3.store(bucket), writer_id=w, **where(bucket)) for w in "ab"}
    count = 25
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def append(w: str) -> None:
        try:
            start.wait()
            for i in range(count):
                logs[w].append_stage_record("probe", {"writer": w, "i": i})
        except BaseException as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=append, args=(w,)) for w in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    loads = [ObjectRecordLog(moto_s3.store(bucket), **where(bucket)).load() for _ in range(2)]
    orders = [[(r.data["writer"], r.data["i"]) for r in t.stage_records] for t in loads if t]
    assert len(orders) == 2 and orders[0] == orders[1]
    assert sorted(orders[0]) == sorted((w, i) for w in "ab" for i in range(count))
    for w in "ab":
        assert [i for who, i in orders[0] if who == w] == list(range(count))
    keys = keys_of(moto_s3.store(bucket), f"{PREFIX}/{SESSION}/records")
    assert len(keys) == 2 * count


def test_load_equals_what_was_written(moto_s3: MotoS3, tmp_path: Path) -> None:
    """Messages, replacements and stage records from two writers load back as written, and a
    writer's objects hold byte for byte the lines a transcript file gets for the same
    appends."""
    bucket = moto_s3.new_bucket()
    a = ObjectRecordLog(moto_s3.store(bucket), writer_id="a", **where(bucket))
    b = ObjectRecordLog(moto_s3.store(bucket), writer_id="b", **where(bucket))
    file = TranscriptWriter(tmp_path / "same.jsonl", SESSION)
    stamp = "2026-01-01T00:00:00.000Z"
    first = [
        dataclasses.replace(user_text("go"), timestamp=stamp),
        *(dataclasses.replace(m, timestamp=stamp) for m in turn("toolu_1", "x" * 10)),
    ]
    replacement = [ReplacementRecord("toolu_1", "<persisted-output>\nR\n</persisted-output>")]
    later = [
        dataclasses.replace(assistant("msg_2", {"type": "text", "text": "ok"}), timestamp=stamp)
    ]
    for log in (a, file):
        log.append_messages(first)
        log.append_replacements(replacement)
    b.append_stage_record("probe", {"from": "b"})
    for log in (a, file):
        log.append_messages(later)
        log.append_stage_record("probe", {"from": "a"})

    client = moto_s3.store(bucket)
    records_dir = f"{PREFIX}/{SESSION}/records"
    keys = keys_of(client, records_dir)
    assert len(keys) == 5  # numbers 0-4, no gap: a took 0, 1, 3, 4 and b took 2
    mine = [k for i, k in enumerate(keys) if i != 2]
    assert b"".join(bytes(client.get(k).bytes()) for k in mine) == file.path.read_bytes()

    loaded = ObjectRecordLog(client, **where(bucket)).load()
    assert loaded is not None and loaded.problems == []
    assert [m.uuid for m in loaded.messages] == [m.uuid for m in first + later]
    assert loaded.messages[0].content == "go"
    assert loaded.replacement_records == replacement
    assert [r.data for r in loaded.stage_records] == [{"from": "b"}, {"from": "a"}]
    assert loaded.session_id == SESSION


# --------------------------------------------------------------------------------------------
# the server goes away mid-session
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_server_gone_mid_session_sends_the_original(tmp_path: Path) -> None:
    moto = start_moto()  # its own server, stopped below; moto's buckets are process-wide
    bucket = moto.new_bucket()
    w = worker(moto, bucket, tmp_path)
    pipe = Pipeline([ToolResultBudget()])
    history = [user_text("go"), *turn("toolu_1", rows("one", 300))]
    out = await pipe.run(history, w.ctx)
    first = sent_results(out)["toolu_1"]
    assert first.startswith(PERSISTED_OUTPUT_TAG)

    moto.stop()
    second = rows("two", 300)
    history += turn("toolu_2", second)
    out = await pipe.run(history, w.ctx)  # no exception escapes the pass

    sent = sent_results(out)
    assert sent["toolu_2"] == second  # the original, byte for byte
    assert sent["toolu_1"] == first  # the earlier decision is re-applied
    assert w.ctx.report.persist_failed == ["toolu_2"]
    spans = {
        str(s[ATTR.TOOL_CALL_ID]): s for s in w.spans.decision_attributes("tool_result_budget")
    }
    failed = spans["toolu_2"]
    assert failed[ATTR.DECISION] == "persist_failed"
    assert failed[ATTR.ERROR] == "GenericError"  # the type only: obstore's text has the URL
    assert ATTR.PATH not in failed
    # the decision record could not be written either: logged, not raised
    assert any(
        level == "error" and event == "stage_record.write_failed" and kw["error"] == "StoreError"
        for level, event, kw in w.logger.events
    )
    told = repr([dict(s.attributes or {}) for s in w.spans.spans]) + repr(w.logger.events)
    for secret in (SECRET_KEY, ACCESS_KEY, moto.endpoint):
        assert secret not in told


# --------------------------------------------------------------------------------------------
# read-back across workers
# --------------------------------------------------------------------------------------------


def _mixed_text() -> str:
    """30,000 lines: CRLF, lone CR and LF endings, multi-byte text, a few long lines."""
    ends = ("\n", "\r\n", "\r")
    parts = []
    for i in range(30_000):
        body = f"line {i} ü 字 😀" + ("x" * 900 if i % 7_001 == 0 else "")
        parts.append(body + ends[i % 3])
    return "".join(parts) + "no line end at the very end"


@pytest.mark.asyncio
async def test_readback_pages_as_the_local_reader_does(moto_s3: MotoS3, tmp_path: Path) -> None:
    """A second worker pages through a result by its s3:// URI: every page is the page the
    local reader gives for the same file, and a page far into the result reads only a
    bounded range, not the whole object."""
    bucket = moto_s3.new_bucket()
    text = _mixed_text()
    uri = await ObjectToolResultStore(moto_s3.store(bucket), **where(bucket)).persist(
        "toolu_big", text, "txt"
    )
    local = FileToolResultStore(tmp_path / "root", SESSION)
    path = await local.persist("toolu_big", text, "txt")
    counted = Wrapped(moto_s3.store(bucket))
    remote = ObjectOutputReader(counted, ObjectLayout(**where(bucket)), max_chars=600)
    here = PersistedOutputReader(local.directory, max_chars=600)

    async def both(offset: int, limit: int) -> tuple[str, str]:
        pages: list[str] = []
        for reader, name in ((remote, uri), (here, path)):
            try:
                pages.append(await reader({"path": name, "offset": offset, "limit": limit}))
            except ReadbackError as exc:
                pages.append(f"error: {exc}".replace(name, "<name>"))
        return pages[0], pages[1]

    cases = [(1, 3), (2, 2), (999, 4), (1_000, 1), (1_001, 2), (7_001, 2), (7_002, 1)]
    cases += [(12_345, 30), (29_998, 5), (30_001, 1), (30_002, 1), (40_000, 1), (1, 2_000)]
    for offset, limit in cases:
        mine, theirs = await both(offset, limit)
        assert mine == theirs, (offset, limit)

    counted.gets.clear()
    page = await remote({"path": uri, "offset": 25_000, "limit": 5})
    assert page.startswith("line 24999 ü 字 😀")
    size = len(text.encode())
    fetched = sum(opts["range"][1] - opts["range"][0] for _key, opts in counted.gets)
    assert all("range" in opts for _key, opts in counted.gets)
    assert fetched < size // 2


@pytest.mark.asyncio
async def test_readback_refuses_other_uris(moto_s3: MotoS3) -> None:
    bucket = moto_s3.new_bucket()
    client = moto_s3.store(bucket)
    other_session = ObjectToolResultStore(client, **where(bucket, "sess-other"))
    foreign = await other_session.persist("toolu_1", "secret of another session\n", "txt")
    mine = await ObjectToolResultStore(client, **where(bucket)).persist("toolu_1", "mine\n", "txt")
    reader = ObjectOutputReader(client, ObjectLayout(**where(bucket)))
    assert await reader({"path": mine}) == "mine\n"
    refused = [
        foreign,
        mine.replace(bucket, "another-bucket"),
        mine.replace(PREFIX, "other/prefix"),
        mine.replace("tool-results/", "tool-results/../../sess-other/tool-results/"),
        mine.replace("toolu_1.txt", "%2e%2e/toolu_1.txt"),
        mine + "?versionId=1",
        mine.replace("s3://", "gs://"),
        mine.replace("/tool-results/", "/records/").replace(".txt", ".jsonl"),
        f"{PREFIX}/{SESSION}/tool-results/toolu_1.txt",  # a bare key
        "/etc/passwd",
    ]
    for uri in refused:
        with pytest.raises(ReadbackError, match="no readable output"):
            await reader({"path": uri})
    with pytest.raises(ReadbackError, match=r"not found"):
        await reader({"path": mine.replace("toolu_1", "toolu_2")})


# --------------------------------------------------------------------------------------------
# hostile ids
# --------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_hostile_ids_stay_inside_the_prefix(moto_s3: MotoS3) -> None:
    bucket = moto_s3.new_bucket()
    client = moto_s3.store(bucket)
    store = ObjectToolResultStore(client, **where(bucket))
    reader = ObjectOutputReader(client, ObjectLayout(**where(bucket)))
    hostile = ["../../x", "../../../etc/passwd", "a\x00b", "x" * 10_240, "CON", "a/b", "%2e%2e", ""]
    uris = {}
    for i, tid in enumerate(hostile):
        uris[tid] = await store.persist(tid, f"content {i}\n", "txt")
    head = f"{PREFIX}/{SESSION}/tool-results/"
    for i, uri in enumerate(uris.values()):
        assert uri.startswith(f"s3://{bucket}/{head}unsafe.") and uri.endswith(".txt")
        assert len(uri) < 200
        assert await reader({"path": uri}) == f"content {i}\n"
    assert len(set(uris.values())) == len(hostile)
    assert all(k.startswith(head) for k in keys_of(client))
    assert len(keys_of(client)) == len(hostile)
    with pytest.raises(ValueError, match="session_id"):
        ObjectToolResultStore(client, prefix=PREFIX, session_id="../x", uri_base=f"s3://{bucket}")


def test_records_objects_are_jsonl_of_the_session(moto_s3: MotoS3) -> None:
    """What an append writes is readable JSONL naming the session (no framing of our own)."""
    bucket = moto_s3.new_bucket()
    log = ObjectRecordLog(moto_s3.store(bucket), writer_id="w", **where(bucket))
    log.append_stage_record("probe", {"k": [1, 2]})
    (key,) = keys_of(moto_s3.store(bucket))
    (line,) = bytes(moto_s3.store(bucket).get(key).bytes()).decode().splitlines()
    assert json.loads(line) == {
        "type": "stage-record",
        "sessionId": SESSION,
        "stage": "probe",
        "data": {"k": [1, 2]},
    }
    with pytest.raises(StoreError):
        ObjectRecordLog(Wrapped(moto_s3.store("no-such-bucket-here")), **where(bucket)).load()
