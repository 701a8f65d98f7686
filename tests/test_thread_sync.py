"""Syncs grouped by a thread of the process (pipeline.dropin.thread_sync): each once per group,
off the caller's thread, none lost at a flush, one that raises logged; a forked child syncs in
a thread of its own."""

from __future__ import annotations

import os
import threading
import time

import pytest
import structlog.testing

from pipeline.dropin.thread_sync import ThreadSync
from tests.test_group_sync import Synced


def _until(done: object, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the group never ran"
        time.sleep(0.01)


def test_syncs_added_within_the_window_run_once_together_in_its_thread() -> None:
    synced = Synced()
    syncs = ThreadSync(window=0.2)
    for name in ("a", "b", "a", "a"):  # a's sync added three times: run once
        syncs.add(synced.of(name))
    _until(lambda: syncs.groups == 1 and len(synced.runs) == 2)
    assert [name for name, _ in synced.runs] == ["a", "b"]
    assert {thread for _, thread in synced.runs} != {threading.get_ident()}
    syncs.add(synced.of("a"))  # a later call's: the next group
    _until(lambda: syncs.groups == 2)
    assert [name for name, _ in synced.runs] == ["a", "b", "a"]


def test_a_flush_runs_what_waits_here_at_once() -> None:
    synced = Synced()
    syncs = ThreadSync(window=60)
    syncs.add(synced.of("a"))
    syncs.flush()
    assert synced.runs == [("a", threading.get_ident())]
    assert syncs.waiting == 0


def test_a_sync_that_raises_is_logged_and_its_group_goes_on() -> None:
    synced = Synced()
    syncs = ThreadSync(window=60)

    def broken() -> None:
        raise OSError("disk gone")

    syncs.add(broken)
    syncs.add(synced.of("b"))
    with structlog.testing.capture_logs() as logs:
        syncs.flush()
    assert [name for name, _ in synced.runs] == ["b"]
    assert [(e["event"], e["error"]) for e in logs] == [("group_sync.failed", "OSError")]


def test_a_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        ThreadSync(window=float("nan"))


def test_a_forked_child_syncs_in_a_thread_of_its_own() -> None:
    syncs = ThreadSync(window=0.05)
    syncs.add(lambda: None)  # the parent's thread is running
    _until(lambda: syncs.groups == 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's; its own starts at its first add
        try:
            ran = threading.Event()
            syncs.add(ran.set)
            os.write(write, b"1" if ran.wait(5) else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
