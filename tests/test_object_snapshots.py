"""Snapshots of a session's record objects: a worker new to a long conversation reads at most
three objects, and whatever it starts from it loads what the records alone give.

The store is obstore's in-memory one with a counting wrapper; the conversation goes through the
real :class:`~pipeline.dropin.adapter.WireSession` (the proxy's per-call work without HTTP).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import Pipeline, ToolPolicies
from pipeline.dropin.adapter import WireSession
from pipeline.store.object_records import ObjectRecordLog
from pipeline.store.object_snapshots import choose_chain, snapshot_name, snapshots_dir
from pipeline.store.sessions import SessionStates
from pipeline.testing import QuietLogger
from pipeline.transcript.read import Transcript
from stages import ToolResultBudget
from tests.builders import assistant, results, tool_result, tool_use
from tests.objectstore_support import Outage, Wrapped, keys_of

obstore = pytest.importorskip("obstore", reason="the objectstore extra is not installed")

PREFIX = "fleet"
SESSION = "snap-session"
CAP = 5_000


def growing(rounds: int) -> list[dict[str, Any]]:
    """A client's history of ``rounds`` tool rounds, every other result over the cap."""
    params: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for k in range(rounds):
        tid = f"toolu_{k:05d}"
        size = 6_000 if k % 2 else 300
        params.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "t", "input": {}}],
            }
        )
        params.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": f"{k} " * (size // 2)}
                ],
            }
        )
    return params


async def open_worker(store: Any, host: Path) -> WireSession:
    states = SessionStates("memory:///" + PREFIX, object_store=store, cool_down=None)
    return await WireSession.open(
        SESSION,
        host,
        Pipeline([ToolResultBudget()]),
        storage=states.open(SESSION),
        tool_policies=ToolPolicies(cap=CAP),
        logger=QuietLogger(keep=False),
    )


async def serve(session: WireSession, params: list[dict[str, Any]], n: int) -> list[Any]:
    """One call as the proxy makes it: the check for other writers, the pass, the response,
    the settle after it."""
    assert session.storage is not None
    await anyio.to_thread.run_sync(session.storage.changed_elsewhere)
    sent = await session.prepare(params)
    await session.observe_async(f"msg_{n:05d}", {"input_tokens": 100 + n, "output_tokens": 5}, "m")
    await session.settle()
    return list(sent)


def record_gets(store: Wrapped) -> list[str]:
    return [key for key, _options in store.gets if "/records" in key]


def test_a_new_worker_joins_a_1000_call_conversation_reading_at_most_three_objects(
    tmp_path: Path,
) -> None:
    """Worker A serves 1,000 calls; B, new, serves the next: it reads at most three record or
    snapshot objects and sends what A would have sent, byte for byte. (Without snapshots it
    reads one object per record: about 2,000.)"""
    memory = obstore.store.MemoryStore()
    store = Wrapped(memory)
    calls = 1_000
    params = growing(calls + 1)

    async def run() -> tuple[list[Any], list[Any], list[str]]:
        a = await open_worker(store, tmp_path / "a")
        for n in range(calls):
            await serve(a, params[: 2 * n + 1], n)
        store.gets.clear()
        b = await open_worker(store, tmp_path / "b")
        joined = await serve(b, params[: 2 * calls + 1], calls)
        read = record_gets(store)
        # the same call through A, which has held the conversation all along
        alone = await a.prepare(params[: 2 * calls + 1])
        return joined, list(alone), read

    joined, alone, read = anyio.run(run)
    assert len(read) <= 3, read
    assert json.dumps(joined, default=str) == json.dumps(alone, default=str)
    snapshots = [k for k in keys_of(memory, PREFIX) if "-snapshots/" in k]
    assert 1 <= len(snapshots) <= 60, len(snapshots)  # old chains are removed, not piling up


def _appends(log: ObjectRecordLog, n: int, start: int) -> None:
    for k in range(start, start + n):
        log.append_messages(
            [assistant(f"msg_{k}", tool_use(f"toolu_{k}", "t")), tool_result_message(k)]
        )
        log.append_stage_record(
            "response", {"index": k, "id": f"msg_{k}", "pad": "x" * (k % 7) * 40}
        )


def tool_result_message(k: int) -> Any:
    return results(tool_result(f"toolu_{k}", f"out {k}"))


def fingerprint(loaded: Transcript | None) -> str:
    assert loaded is not None
    return json.dumps(
        [[m.uuid, m.type, m.message_id, m.content] for m in loaded.messages]
        + [[r.stage, dict(r.data)] for r in loaded.stage_records],
        default=str,
        sort_keys=True,
    )


def log_on(store: Any, writer: str, delta_bytes: int = 2_000) -> ObjectRecordLog:
    return ObjectRecordLog(
        store,
        prefix=PREFIX,
        session_id=SESSION,
        writer_id=writer,
        delta_bytes=delta_bytes,
        logger=QuietLogger(keep=False),
    )


def plain_load(memory: Any) -> str:
    """What the records alone load to (snapshots taken away from a copy's view)."""
    copy = obstore.store.MemoryStore()
    for key in keys_of(memory, PREFIX):
        if "-snapshots/" not in key:
            copy.put(key, bytes(memory.get(key).bytes()))
    return fingerprint(log_on(copy, "plain").load())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("ab"),
            st.sampled_from(["call", "call", "append", "compact", "load"]),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from([0, 2_500, 10**9]),
)
def test_whatever_two_writers_append_and_compact_a_new_reader_loads_what_the_records_give(
    steps: list[tuple[str, str, int]], delta_bytes: int
) -> None:
    """Records ~1 KB a round; a new base every compaction, every few, or only the first."""
    memory = obstore.store.MemoryStore()
    logs = {name: log_on(memory, name, delta_bytes) for name in "ab"}
    counter = 0
    for name, action, n in steps:
        log = logs[name]
        if action in ("call", "append"):
            log.load()  # a worker catches up before it writes (as the proxy does)
            _appends(log, n, counter)
            counter += n
            if action == "call":
                log.compact()  # as the proxy does after each call
        elif action == "compact":
            log.compact()
        else:
            log.load()
    if counter == 0:
        return
    expected = plain_load(memory)
    store = Wrapped(memory)
    joined = log_on(store, "c")
    assert fingerprint(joined.load()) == expected
    for name in "ab":
        assert fingerprint(logs[name].load()) == expected


def test_a_join_reads_base_and_delta_then_the_records_after() -> None:
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=10**9)
    _appends(a, 3, 0)
    a.compact()  # a base: records 0-5
    _appends(a, 2, 3)
    a.compact()  # a delta: 6-9
    _appends(a, 1, 5)  # two records not in a snapshot yet
    store = Wrapped(memory)
    joined = log_on(store, "b")
    assert fingerprint(joined.load()) == plain_load(memory)
    directory = snapshots_dir(joined.layout.records_dir)
    assert [k for k, _ in store.gets] == [
        f"{directory}/{snapshot_name(0, 5)}",
        f"{directory}/{snapshot_name(6, 9)}",
        f"{joined.layout.records_dir}/000000000010.jsonl",
        f"{joined.layout.records_dir}/000000000011.jsonl",
    ]


def test_a_new_base_removes_older_chains_but_the_one_it_replaces() -> None:
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=600)
    directory = snapshots_dir(a.layout.records_dir)
    bases = []
    for k in range(12):
        _appends(a, 1, k)
        a.compact()
        chain = choose_chain(keys_of(memory, directory), directory)
        assert chain is not None and chain.last == 2 * k + 1
        if chain.delta is None:
            bases.append(chain.base)
    assert len(bases) >= 3
    left = keys_of(memory, directory)
    # the newest base, and the chain before it (a reader may be on it); nothing older
    assert bases[-1] in left and bases[-3] not in left
    assert len(left) <= 3


def test_a_snapshot_removed_while_a_worker_joins_leaves_it_reading_the_records() -> None:
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a")
    _appends(a, 4, 0)
    a.compact()
    directory = snapshots_dir(a.layout.records_dir)
    gone = keys_of(memory, directory)[0]

    def vanish(path: str, **_kwargs: Any) -> None:
        if path == gone:
            memory.delete(gone)

    store = Wrapped(memory, before={"get": vanish})
    assert fingerprint(log_on(store, "b").load()) == plain_load(memory)


def test_a_snapshot_that_cannot_be_written_is_an_oserror_and_the_next_call_writes_it(
    tmp_path: Path,
) -> None:
    memory = obstore.store.MemoryStore()
    switch = Outage(down=False)
    a = log_on(Wrapped(memory, before={"put": switch}), "a")
    _appends(a, 2, 0)
    switch.down = True
    with pytest.raises(OSError):
        a.compact()
    switch.down = False
    a.compact()
    directory = snapshots_dir(a.layout.records_dir)
    assert keys_of(memory, directory) == [f"{directory}/{snapshot_name(0, 3)}"]


def test_foreign_names_in_the_snapshot_directory_are_left_alone() -> None:
    directory = "p/s/records-snapshots"
    keys = [
        f"{directory}/{snapshot_name(0, 9)}",
        f"{directory}/{snapshot_name(10, 12)}",
        f"{directory}/{snapshot_name(10, 14)}",
        f"{directory}/{snapshot_name(0, 4)}",
        f"{directory}/{snapshot_name(9, 3)}",  # first past last
        f"{directory}/000000000000-000000000099.jsonl.tmp",
        f"{directory}/notes.txt",
        f"{directory}x/{snapshot_name(0, 99)}",
    ]
    chain = choose_chain(keys, directory)
    assert chain is not None
    assert (chain.base_last, chain.last) == (9, 14)
    assert chain.delta == f"{directory}/{snapshot_name(10, 14)}"
    assert choose_chain([f"{directory}/{snapshot_name(3, 9)}"], directory) is None


def stage_indexes(loaded: Transcript | None) -> list[Any]:
    assert loaded is not None
    return [r.data.get("index") for r in loaded.stage_records]


def test_a_load_and_a_compaction_of_one_log_at_once_hold_each_record_once() -> None:
    """The proxy compacts after a response (a worker thread) while the next request may load
    the same log. Here a load starts while a compaction writes its base, and would read the
    snapshots while the compaction rebuilds the pieces: it waits for the compaction instead,
    and neither sees the other's pieces halfway (before: records 5-7 twice, then in a base
    that every later worker loaded)."""
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=10**9)
    _appends(a, 5, 0)
    a.compact()  # a base: records 0-9
    _appends(a, 3, 5)  # 10-15
    results: list[Any] = []
    reading, compacted = threading.Event(), threading.Event()
    armed = {"on": False}

    def during_put(path: str, *_args: Any, **_kwargs: Any) -> None:
        if armed["on"] and "-snapshots/" in path:
            armed["on"] = False
            threading.Thread(target=lambda: results.append(r.load())).start()
            reading.wait(0.5)  # the load reads the snapshots now, unless it waits for this

    def at_delta(path: str, **_kwargs: Any) -> None:
        if "-snapshots/000000000010-" in path:
            reading.set()
            compacted.wait(5)  # the load reads on once the compaction has returned

    r = log_on(Wrapped(memory, before={"put": during_put, "get": at_delta}), "r", delta_bytes=0)
    r.load()
    _appends(a, 5, 8)  # 16-25
    a.compact()  # a delta on a's base: 10-25
    armed["on"] = True
    r.compact()  # a base 0-15 from r; a load of r starts while it is written
    compacted.set()
    for _ in range(100):
        if results:
            break
        time.sleep(0.05)
    assert stage_indexes(results[0]) == list(range(13))
    r.compact()
    assert stage_indexes(log_on(memory, "j").load()) == list(range(13))


def test_a_load_that_fails_after_reading_snapshots_leaves_the_conversation_changed() -> None:
    memory = obstore.store.MemoryStore()
    fault = Outage(down=False)

    def records_listing(prefix: str | None = None, **_kwargs: Any) -> None:
        if prefix is not None and prefix.endswith("/records"):
            fault()

    a = log_on(memory, "a", delta_bytes=10**9)
    w = log_on(Wrapped(memory, before={"list": records_listing}), "w")
    _appends(a, 5, 0)
    w.load()
    _appends(a, 5, 5)
    a.load()
    a.compact()  # a base holding 0-19
    assert w.changed_elsewhere()
    fault.down = True
    with pytest.raises(OSError):
        w.load()  # the snapshot is read, then the listing after it fails
    fault.down = False
    assert w.changed_elsewhere()  # still to be loaded: the worker loads again next call
    assert stage_indexes(w.load()) == list(range(10))


def test_a_log_taking_up_a_chain_keeps_the_records_past_it_it_holds() -> None:
    """Its own append past the chain is not read again (a read that lags would lose it)."""
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=10**9)
    _appends(a, 4, 0)  # 0-7
    lagging = {f"{a.layout.records_dir}/000000000003.jsonl"}

    def lag(path: str, **_kwargs: Any) -> None:
        if path in lagging:
            raise FileNotFoundError(path)

    store = Wrapped(memory, before={"get": lag})
    w = ObjectRecordLog(
        store, prefix=PREFIX, session_id=SESSION, read_attempts=1, logger=QuietLogger(keep=False)
    )
    w.load()  # 3 unreadable: 0-2 held, 4-7 kept apart
    a.compact()  # a base: 0-7
    w.append_stage_record("response", {"index": 99, "id": "own"})  # record 8, w's own
    lagging.clear()
    lagging.add(f"{a.layout.records_dir}/000000000008.jsonl")
    store.gets.clear()
    assert stage_indexes(w.load()) == [0, 1, 2, 3, 99]
    assert [k.rsplit("/", 1)[1] for k, _ in store.gets] == [snapshot_name(0, 7)]
    assert not w.changed_elsewhere()


def test_removal_leaves_foreign_names_and_survives_a_snapshot_already_gone() -> None:
    """Names the snapshots never have stay; a store that fails a batch delete because one of
    its keys is gone (Azure, local files) has removed the rest: they are not asked again."""
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=0)
    directory = snapshots_dir(a.layout.records_dir)
    memory.put(f"{directory}/notes.txt", b"x")
    memory.put(f"{directory}/archive/{snapshot_name(0, 99)}", b"x")

    def strict_delete(paths: Any) -> None:
        if any(not keys_of(memory, p) for p in ([paths] if isinstance(paths, str) else paths)):
            for p in [paths] if isinstance(paths, str) else paths:
                memory.delete(p)
            raise FileNotFoundError("one of them")

    b = log_on(Wrapped(memory, before={"delete": strict_delete}), "b", delta_bytes=0)
    for k in range(6):
        log = a if k % 2 == 0 else b
        log.load()
        _appends(log, 1, k)
        log.compact()
    left = keys_of(memory, directory)
    assert (
        f"{directory}/notes.txt" in left and f"{directory}/archive/{snapshot_name(0, 99)}" in left
    )
    assert len([k for k in left if "/archive/" not in k and k.endswith(".jsonl")]) <= 3
    assert len(b._snapshots) <= 3


def test_a_joiner_lists_only_what_follows_the_chain() -> None:
    memory = obstore.store.MemoryStore()
    a = log_on(memory, "a", delta_bytes=10**9)
    _appends(a, 40, 0)
    a.compact()
    store = Wrapped(memory)
    listings: list[Any] = []
    store.before["list"] = lambda prefix=None, offset=None: listings.append((prefix, offset))
    j = log_on(store, "j")
    j.load()
    assert not j.changed_elsewhere()
    records = [offset for prefix, offset in listings if prefix == j.layout.records_dir]
    assert records == [f"{j.layout.records_dir}/{79:012d}.jsonl"]
