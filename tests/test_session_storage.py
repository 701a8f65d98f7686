"""One location, a session's whole state: the local default unchanged, object store URLs, the
errors for a bad URL, and wire sessions of a fleet sharing decisions through the store."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")

from obstore.store import MemoryStore

from pipeline import FileToolResultStore, Pipeline, ToolPolicies, TranscriptWriter
from pipeline.dropin.adapter import WireSession
from pipeline.store.files import StoreError
from pipeline.store.object_locations import _with_in_turn_defaults
from pipeline.store.object_reader import ObjectOutputReader
from pipeline.store.object_records import ObjectRecordLog
from pipeline.store.objects import ObjectToolResultStore
from pipeline.store.readback import PersistedOutputReader
from pipeline.store.records import RecordLog
from pipeline.store.sessions import (
    DECISIONS_FILE,
    STORE_RETRIES,
    SessionStates,
    SessionStorage,
    in_turn_options,
    open_session_state,
)
from pipeline.testing import QuietLogger
from stages import ToolResultBudget
from tests.objectstore_support import SECRET_KEY, MotoS3, keys_of, start_moto

SESSION = "conv-1"


def test_a_directory_is_the_file_backend(tmp_path: Path) -> None:
    storage = open_session_state(tmp_path / "root", SESSION, writer_id="ignored-here")
    assert isinstance(storage.store, FileToolResultStore)
    assert isinstance(storage.records, TranscriptWriter)
    assert isinstance(storage.reader, PersistedOutputReader)
    assert isinstance(storage.records, RecordLog)
    assert storage.records.path == tmp_path / "root" / SESSION / DECISIONS_FILE
    assert storage.load() is None
    path = anyio.run(storage.store.persist, "toolu_1", "x\n", "txt")
    # the form the model sees stays Claude Code's: the absolute local path
    assert path == str((tmp_path / "root" / SESSION / "tool-results" / "toolu_1.txt").absolute())
    storage.records.append_stage_record("s", {"n": 1})
    loaded = storage.load()
    assert loaded is not None and [r.data for r in loaded.stage_records] == [{"n": 1}]
    assert anyio.run(storage.reader, {"path": path}) == "x\n"
    with pytest.raises(ValueError, match="object store URLs"):
        open_session_state(tmp_path, SESSION, retry_config={})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://bucket/x", "unsupported store URL scheme 'gs'"),
        ("ftp://host/x", "unsupported store URL scheme 'ftp'"),
        ("file:///tmp/x", "unsupported store URL scheme 'file'"),
        ("s3://", "not a valid S3 bucket name"),
        ("s3://Upper-Case/x", "not a valid S3 bucket name"),
        ("s3://b/x", "not a valid S3 bucket name"),
        ("s3://bucket:99/x", "no port"),
        ("s3://bucket:notaport/x", "malformed store URL"),
        ("s3://bucket/x?versionId=1", "no port, query or fragment"),
        ("s3://bucket/x#frag", "no port, query or fragment"),
        ("s3://bucket/../x", "segment"),
        ("s3://bucket/a//b/./c", "segment"),
        ("s3://bucket/a b", "segment"),
        ("memory://host/x", "no host"),
    ],
)
def test_bad_urls_are_refused_clearly(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_session_state(url, SESSION)


def test_credentials_in_a_url_are_refused_unseen() -> None:
    with pytest.raises(ValueError, match="credentials") as caught:
        open_session_state("s3://AKIDX:hunter2secret@bucket/x", SESSION)
    assert "hunter2secret" not in str(caught.value) and "AKIDX" not in str(caught.value)
    with pytest.raises(ValueError) as bad_option:
        open_session_state("s3://bucket/x", SESSION, no_such_option="hunter2secret")
    assert "hunter2secret" not in str(bad_option.value)
    with pytest.raises(ValueError, match="session_id"):
        open_session_state("memory:///x", "../escape")


def test_memory_urls_share_a_given_store() -> None:
    memory = MemoryStore()
    a = open_session_state("memory:///team/", SESSION, object_store=memory, writer_id="a")
    b = open_session_state("memory:///team", SESSION, object_store=memory, writer_id="b")
    assert a.location == "memory:///team"
    assert isinstance(a.store, ObjectToolResultStore) and isinstance(a.records, ObjectRecordLog)
    assert isinstance(a.reader, ObjectOutputReader)
    assert isinstance(a.records, RecordLog)
    uri = anyio.run(a.store.persist, "toolu_1", "shared\n", "txt")
    assert uri == f"memory:///team/{SESSION}/tool-results/toolu_1.txt"
    assert anyio.run(b.reader, {"path": uri}) == "shared\n"
    assert open_session_state("memory://", SESSION).location == "memory://"


def test_s3_configured_by_the_environment(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    storage = open_session_state(f"s3://{bucket}/team/sessions", SESSION, writer_id="w1")
    assert storage.location == f"s3://{bucket}/team/sessions"
    uri = anyio.run(storage.store.persist, "toolu_1", "on s3\n", "txt")
    assert uri == f"s3://{bucket}/team/sessions/{SESSION}/tool-results/toolu_1.txt"
    storage.records.append_stage_record("s", {"n": 1})
    assert keys_of(moto_s3.store(bucket)) == [
        f"team/sessions/{SESSION}/records/000000000000.jsonl",
        f"team/sessions/{SESSION}/tool-results/toolu_1.txt",
    ]
    again = open_session_state(f"s3://{bucket}/team/sessions", SESSION)
    assert anyio.run(again.reader, {"path": uri}) == "on s3\n"
    loaded = again.load()
    assert loaded is not None and [r.data for r in loaded.stage_records] == [{"n": 1}]


# --------------------------------------------------------------------------------------------
# a fleet of wire sessions
# --------------------------------------------------------------------------------------------


class Client:
    """A client re-sending its whole history each call; large tool outputs every turn."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing jobs"}]
        self.turn = 0

    def answer(self) -> tuple[str, dict[str, int]]:
        ids = [f"toolu_{self.turn:02d}_{i}" for i in range(2 + self.turn % 3)]
        self.params.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": t, "name": "get_log", "input": {}} for t in ids
                ],
            }
        )
        self.params.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": t,
                        "content": f"[{t}]\n" + "log line\n" * (300 + 200 * i),
                    }
                    for i, t in enumerate(ids)
                ],
            }
        )
        self.turn += 1
        return f"msg_{self.turn:04d}", {"input_tokens": 100 * self.turn, "output_tokens": 5}


def _session(root: Path, storage: SessionStorage | None) -> WireSession:
    return WireSession(
        SESSION,
        root,
        Pipeline([ToolResultBudget(3_000)]),
        storage=storage,
        tool_policies=ToolPolicies(cap=2_000),
        logger=QuietLogger(),
    )


async def _calls(sessions: Any, calls: int) -> list[str]:
    client = Client()
    sent = []
    for call in range(calls):
        session = sessions(call)
        request = await session.prepare(client.params)
        sent.append(json.dumps(request))
        response_id, usage = client.answer()
        session.observe(response_id, usage, model="claude-test")
    return sent


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_a_fleet_without_affinity_sends_what_one_process_sends(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Every call of a conversation goes to a new worker (alternately two hosts, each with
    its own local directory for the calibration), all sharing one object store: the requests
    are those of one long-lived local session, byte for byte (with the file paths shown as
    the store's URIs)."""
    if backend == "s3":
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        bucket = moto.new_bucket()
        url = f"s3://{bucket}/fleet"

        def storage(writer: str) -> SessionStorage:
            return open_session_state(
                url, SESSION, writer_id=writer, object_store=moto.store(bucket)
            )
    else:
        memory = MemoryStore()
        url = "memory:///fleet"

        def storage(writer: str) -> SessionStorage:
            return open_session_state(url, SESSION, writer_id=writer, object_store=memory)

    calls = 12
    local_root = tmp_path / "local"
    one = _session(local_root, None)
    alone = anyio.run(_calls, lambda _call: one, calls)

    def worker(call: int) -> WireSession:
        host = "ab"[call % 2]
        return _session(tmp_path / f"host-{host}", storage(f"{host}{call}"))

    fleet = anyio.run(_calls, worker, calls)
    local_dir = str(local_root / SESSION / "tool-results")
    shared_dir = f"{url}/{SESSION}/tool-results"
    assert sum(r.count("<persisted-output>") for r in alone) > 10
    assert fleet == [r.replace(local_dir, shared_dir) for r in alone]


def test_storage_of_another_session_is_refused(tmp_path: Path) -> None:
    other = open_session_state("memory:///x", "conv-2")
    with pytest.raises(ValueError, match="conv-2"):
        _session(tmp_path, other)


# --------------------------------------------------------------------------------------------
# one worker's sessions, and how long a call may wait on the store
# --------------------------------------------------------------------------------------------


def test_in_turn_options_bound_every_request() -> None:
    options = in_turn_options(2.0, 3)
    assert options["client_options"] == {
        "timeout": timedelta(seconds=2),
        "connect_timeout": timedelta(seconds=1),
    }
    retry = options["retry_config"]
    assert retry["max_retries"] == 3 and retry["retry_timeout"] == timedelta(seconds=8)
    assert in_turn_options()["retry_config"]["max_retries"] == STORE_RETRIES
    assert in_turn_options(0.5)["client_options"]["connect_timeout"] == timedelta(seconds=0.5)
    for timeout, retries in ((0, 2), (-1, 2), (601, 2), (True, 2), (3, -1), (3, 11), (3, 1.5)):
        with pytest.raises(ValueError, match="store"):
            in_turn_options(timeout, retries)  # type: ignore[arg-type]


def test_client_options_come_from_code_then_environment_then_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """obstore forgets the environment's client options (AWS_ALLOW_HTTP...) once any are
    passed: they are read and merged, below what the code gives and above the defaults."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_TIMEOUT", "9s")
    merged = _with_in_turn_defaults({"client_options": {"user_agent": "fleet"}, "region": "x"})
    assert merged["client_options"] == {
        "timeout": "9s",
        "connect_timeout": timedelta(seconds=1),
        "allow_http": "true",
        "user_agent": "fleet",
    }
    assert merged["region"] == "x" and merged["retry_config"]["max_retries"] == STORE_RETRIES
    mine = {"max_retries": 0}
    assert _with_in_turn_defaults({"retry_config": mine})["retry_config"] is mine
    with pytest.raises(ValueError, match="client_options"):
        _with_in_turn_defaults({"client_options": "timeout=1s"})


def test_session_states_open_many_sessions_on_one_store(
    moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in moto_s3.env().items():
        monkeypatch.setenv(name, value)
    bucket = moto_s3.new_bucket()
    states = SessionStates(f"s3://{bucket}/team/", writer_id="w")
    assert states.shared and states.location == f"s3://{bucket}/team"
    states.check()  # the bucket answers
    one, two = states.open("conv-1"), states.open("conv-2")
    assert isinstance(one.store, ObjectToolResultStore)
    assert isinstance(two.store, ObjectToolResultStore)
    assert one.store.store is two.store.store  # one client, one connection pool
    one.records.append_stage_record("s", {"n": 1})
    assert two.changed_elsewhere() is False and one.changed_elsewhere() is False
    assert keys_of(moto_s3.store(bucket)) == ["team/conv-1/records/000000000000.jsonl"]
    local = SessionStates(tmp_path)
    assert not local.shared
    local.check()  # a directory: nothing to ask
    assert local.open("conv-1").changed_elsewhere() is False
    with pytest.raises(ValueError, match="session_id"):
        states.open("../escape")

    gone = start_moto()
    monkeypatch.setenv("AWS_ENDPOINT_URL", gone.endpoint)
    gone.stop()
    unreachable = SessionStates(f"s3://{bucket}/team", retry_config={"max_retries": 0})
    with pytest.raises(StoreError) as caught:
        unreachable.check()
    assert "cannot list the store" in str(caught.value)
    assert SECRET_KEY not in str(caught.value) and gone.endpoint not in str(caught.value)


def test_a_local_log_tells_another_writers_records_from_its_own(tmp_path: Path) -> None:
    """A local store's conversation asks for news as an object store's does: its own
    appends are none, another writer's (another client of the store, another program) are,
    until it loads again; a log removed is news too."""
    ours = open_session_state(tmp_path, "s")
    theirs = open_session_state(tmp_path, "s")
    assert ours.load() is None and not ours.changed_elsewhere()
    ours.records.append_stage_record("test", {"k": 1})
    ours.records.append_stage_record("test", {"k": 2})
    assert not ours.changed_elsewhere()
    assert theirs.load() is not None and not theirs.changed_elsewhere()
    theirs.records.append_stage_record("test", {"k": 3})
    assert ours.changed_elsewhere() and not theirs.changed_elsewhere()
    loaded = ours.load()
    assert loaded is not None and len(loaded.stage_records) == 3
    assert not ours.changed_elsewhere()
    ours.records.append_stage_record("test", {"k": 4})
    assert theirs.changed_elsewhere() and not ours.changed_elsewhere()
    (tmp_path / "s" / "decisions.jsonl").unlink()
    assert ours.changed_elsewhere()


def test_a_log_another_writer_made_first_is_news(tmp_path: Path) -> None:
    """A conversation made without loading (new to the store) whose log another writer made
    first: that is news, also after it appends, until it loads."""
    late = open_session_state(tmp_path, "s")
    first = open_session_state(tmp_path, "s")
    assert first.load() is None
    first.records.append_stage_record("test", {"k": 1})
    assert late.changed_elsewhere()
    late.records.append_stage_record("test", {"k": 2})
    assert late.changed_elsewhere()  # its own append hides nothing
    assert late.load() is not None and not late.changed_elsewhere()
