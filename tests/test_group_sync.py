"""Syncs grouped (pipeline.dropin.group_sync): each once per group, all of a group in one
worker thread, none lost to a cancellation or a shutdown."""

from __future__ import annotations

import threading

import anyio
import pytest
import structlog.testing

from pipeline.dropin.group_sync import GroupSync


class Synced:
    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []

    def of(self, name: str) -> Sync:
        return Sync(self, name)


class Sync:
    """A sync that records its name and thread; equal to another of the same name, as a
    session's bound method is equal to itself."""

    def __init__(self, log: Synced, name: str) -> None:
        self.log, self.name = log, name

    def __call__(self) -> None:
        self.log.runs.append((self.name, threading.get_ident()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sync) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


@pytest.mark.asyncio
async def test_a_group_runs_each_sync_once_in_one_worker_thread() -> None:
    log, group = Synced(), GroupSync(window=0.05)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(group.run)
        for name in ("a", "b", "a", "a", "c"):
            group.add(log.of(name))
        await anyio.sleep(0.2)
        assert [n for n, _ in log.runs] == ["a", "b", "c"] and group.groups == 1
        assert len({t for _, t in log.runs}) == 1 and log.runs[0][1] != threading.get_ident()
        group.add(log.of("a"))  # a later call: the next group
        await anyio.sleep(0.2)
        assert [n for n, _ in log.runs] == ["a", "b", "c", "a"] and group.groups == 2
        tasks.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_what_waits_when_the_server_stops_is_synced_by_flush() -> None:
    log, group = Synced(), GroupSync(window=60)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(group.run)
        group.add(log.of("a"))
        await anyio.sleep(0.05)
        tasks.cancel_scope.cancel()  # the server's task group ends before the window
    assert log.runs == [] and group.waiting == 1
    await group.flush()
    assert [n for n, _ in log.runs] == ["a"] and group.waiting == 0


@pytest.mark.asyncio
async def test_a_sync_that_raises_is_logged_and_the_others_go_on() -> None:
    log, group = Synced(), GroupSync(window=0.01)

    def broken() -> None:
        raise RuntimeError("a broken sync")

    with structlog.testing.capture_logs() as lines:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group.run)
            await anyio.sleep(0.01)
            assert group.running
            group.add(broken)
            group.add(log.of("a"))
            await anyio.sleep(0.1)
            group.add(log.of("b"))  # the next group: the runner lives on
            await anyio.sleep(0.1)
            tasks.cancel_scope.cancel()
    assert [n for n, _ in log.runs] == ["a", "b"] and not group.running
    assert [(x["event"], x["error"]) for x in lines] == [("group_sync.failed", "RuntimeError")]


def test_a_window_must_be_a_number_of_seconds() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="window"):
            GroupSync(window=bad)
