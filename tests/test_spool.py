"""The spool of results an object store could not take: a result persisted while the store is
down gets the URI the store's write would have given, is read back from the spool on that
worker, and reaches the store (conditionally) once it answers again."""

from __future__ import annotations

import hashlib
import stat
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline.store.object_reader import ObjectOutputReader
from pipeline.store.objects import ObjectLayout, ObjectToolResultStore, place_object
from pipeline.store.spool import Spool
from tests.objectstore_support import Outage, Wrapped, keys_of

obstore = pytest.importorskip("obstore", reason="the objectstore extra is not installed")

WHERE: dict[str, str] = {"prefix": "p", "session_id": "sess-spool", "uri_base": "memory://"}


def stores(tmp_path: Path, **spool: Any) -> tuple[Any, Outage, ObjectToolResultStore, Spool]:
    memory = obstore.store.MemoryStore()
    down = Outage()
    wrapped = Wrapped(memory, before=down.hooks())
    kept = Spool(tmp_path / "spool", **spool)
    store = ObjectToolResultStore(wrapped, content_named=True, spool=kept, **WHERE)
    return memory, down, store, kept


def test_a_result_persisted_while_the_store_is_down_is_read_back_then_written(
    tmp_path: Path,
) -> None:
    memory, down, store, spool = stores(tmp_path)
    text = "".join(f"line {i}\n" for i in range(500))
    uri = anyio.run(store.persist, "toolu_1", text, "txt")
    down.down = False
    up_uri = anyio.run(
        ObjectToolResultStore(memory, content_named=True, **WHERE).persist, "toolu_x", text, "txt"
    )
    down.down = True
    # the URI the store itself gives the same bytes (another worker's, say)
    assert uri == up_uri.replace("toolu_x", "toolu_1")
    assert len(spool) == 1 and not [k for k in keys_of(memory, "p") if "toolu_1" in k]
    # this worker reads it back from its spool while the store is down
    reader = ObjectOutputReader(store.store, store.layout, spool=spool)
    page = anyio.run(reader, {"path": uri, "offset": 499, "limit": 5})
    assert page == "line 498\nline 499\n"
    # a file of this user's only
    (body,) = (tmp_path / "spool").glob("*.txt")
    assert stat.S_IMODE(body.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700

    assert store.drain(force=True) == (0, 1)  # still down: it waits
    down.down = False
    assert store.drain(force=True) == (1, 0)
    key = uri.removeprefix("memory:///")
    assert bytes(memory.get(key).bytes()) == text.encode()
    assert len(spool) == 0 and not spool.waiting()
    assert anyio.run(reader, {"path": uri, "offset": 499, "limit": 5}) == page  # from the store


def test_draining_keeps_what_the_store_holds(tmp_path: Path) -> None:
    """A spooled object another worker wrote first with the same bytes counts as written; one
    whose key holds other bytes is dropped (never written over)."""
    memory, down, store, _spool = stores(tmp_path)
    same = anyio.run(store.persist, "toolu_1", "same\n" * 100, "txt")
    other = anyio.run(store.persist, "toolu_2", "mine\n" * 100, "txt")
    same_key, other_key = (u.removeprefix("memory:///") for u in (same, other))
    memory.put(same_key, ("same\n" * 100).encode())
    memory.put(other_key, b"theirs")
    down.down = False
    assert store.drain(force=True) == (1, 0)
    assert bytes(memory.get(other_key).bytes()) == b"theirs"


def test_a_full_spool_leaves_the_store_error_to_the_budget(tmp_path: Path) -> None:
    """Past ``max_bytes`` a result is not spooled: the store's error propagates (the budget
    then sends the result whole, as without a spool)."""
    _memory, _down, store, spool = stores(tmp_path, max_bytes=1_000)
    anyio.run(store.persist, "toolu_1", "a" * 600, "txt")
    with pytest.raises(OSError, match="unreachable"):
        anyio.run(store.persist, "toolu_2", "b" * 600, "txt")
    assert len(spool) == 1
    # the same bytes again take no more room: the object is there already
    anyio.run(store.persist, "toolu_1", "a" * 600, "txt")
    assert len(spool) == 1


def test_what_a_crash_leaves_in_the_spool_is_passed_over(tmp_path: Path) -> None:
    """An object without both its files (a crash between them), a temporary file and a
    counted spool reopened by a new process: only whole objects are drained."""
    memory, down, store, _spool = stores(tmp_path)
    anyio.run(store.persist, "toolu_1", "kept\n" * 50, "txt")
    directory = tmp_path / "spool"
    (directory / ("0" * 64 + ".key")).write_text("p/sess-spool/tool-results/half.txt")
    (directory / ".x.txt.1.2.tmp").write_bytes(b"torn")
    reopened = Spool(directory)
    assert len(reopened) == 1 and reopened.waiting()
    down.down = False
    drained = ObjectToolResultStore(memory, content_named=True, spool=reopened, **WHERE)
    assert drained.drain(force=True) == (1, 0)
    assert not [k for k in keys_of(memory, "p") if "half" in k]


def test_a_spool_takes_no_bad_size() -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            Spool("/tmp/x", max_bytes=bad)  # type: ignore[arg-type]


def test_a_reader_without_the_spooled_result_says_it_is_not_there(tmp_path: Path) -> None:
    """Another worker (no spool of its own) cannot read a result still waiting in this
    worker's spool: it is told the output is not found."""
    memory, _down, store, _spool = stores(tmp_path)
    uri = anyio.run(store.persist, "toolu_1", "x\n" * 10, "txt")
    other = ObjectOutputReader(memory, ObjectLayout(**WHERE))
    with pytest.raises(Exception, match="not found"):
        anyio.run(other, {"path": uri})


def test_one_drain_at_a_time_and_at_most_one_a_second(tmp_path: Path) -> None:
    """Each call's settle asks for a drain: while one runs another returns at once, and one
    that ran less than a second ago is not run again (unless forced)."""
    memory, down, store, spool = stores(tmp_path)
    anyio.run(store.persist, "toolu_1", "a\n" * 50, "txt")
    down.down = False
    started, release = threading.Event(), threading.Event()

    def slow_place(key: str, data: bytes) -> bool:
        started.set()
        release.wait(5)
        return place_object(memory, key, data)

    first = threading.Thread(target=spool.drain, args=(slow_place,), kwargs={"force": True})
    first.start()
    assert started.wait(5)
    assert spool.drain(slow_place, force=True) == (0, -1)  # the first one drains
    release.set()
    first.join(5)
    assert len(spool) == 0 and not spool.waiting()
    anyio.run(store.persist, "toolu_2", "b\n" * 50, "txt")  # straight to the store now
    assert spool.drain(slow_place) == (0, -1)  # drained less than a second ago


def test_a_drain_passes_over_an_object_the_store_refuses(tmp_path: Path) -> None:
    """One object the store keeps refusing does not hold up the others; three failures in a
    row end the drain (the store is down)."""
    memory, _down, store, spool = stores(tmp_path)
    uris = [anyio.run(store.persist, f"toolu_{i}", f"{i}\n" * 50, "txt") for i in range(5)]
    refused = uris[2].removeprefix("memory:///")

    def place(key: str, data: bytes) -> bool:
        if key == refused:
            raise PermissionError("denied (test)")
        return place_object(memory, key, data)

    assert spool.drain(place, force=True) == (4, 1)
    assert [k for k in keys_of(memory, "p") if "tool-results" in k] == sorted(
        u.removeprefix("memory:///") for u in uris if u != uris[2]
    )

    def down(key: str, data: bytes) -> bool:
        raise OSError("down (test)")

    anyio.run(store.persist, "toolu_9", "9\n" * 50, "txt")  # wait: the store is still down
    assert spool.drain(down, force=True) == (0, 2)


def test_a_spool_trusts_only_what_it_wrote(tmp_path: Path) -> None:
    """A key file whose name is not its key's digest, or whose key is not a tool result's, is
    never written to the store; a spool directory others can write to is refused."""
    memory, _down, store, spool = stores(tmp_path)
    anyio.run(store.persist, "toolu_1", "a\n" * 50, "txt")
    directory = tmp_path / "spool"
    forged = "p/other-session/records/000000000007.jsonl"
    (directory / (hashlib.sha256(forged.encode()).hexdigest() + ".key")).write_text(forged)
    (directory / (hashlib.sha256(forged.encode()).hexdigest() + ".txt")).write_text("{}")
    (directory / ("0" * 64 + ".key")).write_text("p/sess-spool/tool-results/toolu_x.txt")
    (directory / ("0" * 64 + ".txt")).write_text("x")
    assert len(spool) == 1
    assert spool.drain(lambda k, d: place_object(memory, k, d), force=True) == (1, 0)
    assert [k for k in keys_of(memory, "p") if "records" in k or "toolu_x" in k] == []

    open_dir = tmp_path / "shared-spool"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match="alone"):
        Spool(open_dir).put("p/s/tool-results/r.txt", b"x")
    assert not Spool(tmp_path / "s2").put("p/s/records/000000000001.jsonl", b"x")


def test_a_persist_in_an_outage_says_so_on_its_span(tmp_path: Path) -> None:
    """The budget's decision span of a result that went to the spool carries
    ``sluicegate.spooled``; one the store took does not."""
    from pipeline import Pipeline, SessionContext, ToolPolicies
    from pipeline.testing import QuietLogger, SpanRecorder
    from pipeline.tracing import ATTR
    from stages import ToolResultBudget
    from tests.builders import assistant, results, tool_result, tool_use, user_text

    _memory, down, store, _spool = stores(tmp_path)
    spans = SpanRecorder()
    ctx = SessionContext(
        "sess-spool",
        store=store,
        tracer=spans.tracer,
        tool_policies=ToolPolicies(cap=1_000),
        logger=QuietLogger(keep=False),
    )
    history = [user_text("go")]
    for k, outage in enumerate((True, False)):
        down.down = outage
        history += [
            assistant(f"m{k}", tool_use(f"toolu_{k}")),
            results(tool_result(f"toolu_{k}", f"{k} " * 2_000)),
        ]
        anyio.run(Pipeline([ToolResultBudget()]).run, history, ctx)
    spooled, stored = spans.decision_attributes("tool_result_budget")
    assert spooled[ATTR.DECISION] == stored[ATTR.DECISION] == "persist"
    assert spooled.get(ATTR.SPOOLED) is True and ATTR.SPOOLED not in stored


def test_a_result_is_spooled_only_while_its_last_write_left_it_there(tmp_path: Path) -> None:
    """Persisted again once the store answers, a result that still waits in the spool from
    the outage is not "spooled" (the store took it this time); drained, nothing is."""
    _memory, down, store, _spool = stores(tmp_path)
    uri = anyio.run(store.persist, "toolu_1", "text\n" * 50, "txt")
    assert store.spooled(uri)
    down.down = False
    assert anyio.run(store.persist, "toolu_1", "text\n" * 50, "txt") == uri
    assert not store.spooled(uri)
    down.down = True
    other = anyio.run(store.persist, "toolu_2", "more\n" * 50, "txt")
    assert store.spooled(other)
    down.down = False
    store.drain(force=True)
    assert not store.spooled(other)
