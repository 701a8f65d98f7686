"""The synchronous client's passes: run to their end for the caller, in a worker thread on a
loop of their own, whatever loop the caller runs."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import signal
import threading
from collections.abc import Callable

import anyio
import pytest

from pipeline.dropin.sync_passes import run_pass


async def _where() -> tuple[int, int]:
    await anyio.sleep(0)  # anyio works there
    return threading.get_ident(), id(asyncio.get_running_loop())


def test_a_pass_gives_its_result_or_raises_its_exception() -> None:
    async def fails() -> None:
        raise ValueError("no")

    assert run_pass(_where)[0] != threading.get_ident()  # a worker's
    with pytest.raises(ValueError, match="no"):
        run_pass(fails)


def test_an_interrupted_pass_leaves_the_next_one_alone() -> None:
    async def interrupted() -> None:
        await anyio.sleep(0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pass(interrupted)
    assert run_pass(_where)[0] != threading.get_ident()


def test_inside_a_running_loop_the_pass_runs_in_a_worker() -> None:
    async def caller() -> tuple[int, int, int]:
        thread, loop = run_pass(_where)  # a blocking call from async code
        return thread, loop, id(asyncio.get_running_loop())  # both loops alive: ids differ

    thread, loop, mine = asyncio.run(caller())
    assert thread != threading.get_ident()
    assert loop != mine


async def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _ends(target: Callable[[], object], within: float = 20.0) -> list[object]:
    """What ``target`` returned or raised, run in a thread that must end ``within`` seconds (a
    deadlock fails the test instead of hanging it)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # the test looks at what was raised
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), "deadlocked"
    return out


def test_each_caller_thread_keeps_its_loop_between_calls() -> None:
    """A thread and a loop made for each call cost more than a short pass: a caller thread's
    passes run on one loop, kept between its calls; another caller has its own."""
    mine = run_pass(_loop)
    assert run_pass(_loop) is mine
    (theirs,) = _ends(lambda: (run_pass(_loop), run_pass(_loop)))
    assert isinstance(theirs, tuple)
    assert theirs[0] is theirs[1]
    assert theirs[0] is not mine


def test_a_callers_loop_ends_with_the_caller_thread() -> None:
    async def thread() -> threading.Thread:
        return threading.current_thread()

    (served,) = _ends(lambda: run_pass(thread))
    assert isinstance(served, threading.Thread)
    gc.collect()  # the caller's thread-local storage is gone with it
    served.join(10)
    assert not served.is_alive()


def test_passes_inside_passes_end() -> None:
    """A pass that calls a wrapped client, whose pass calls one again: each call is a caller
    of its own, on a loop of its own."""

    async def inner() -> str:
        return "inner"

    async def middle() -> str:
        return run_pass(inner)

    async def outer() -> tuple[str, asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return run_pass(middle), asyncio.get_running_loop(), run_pass(_loop)

    ((said, mine, nested),) = _ends(lambda: run_pass(outer))  # type: ignore[misc]
    assert said == "inner"
    assert nested is not mine


def test_one_callers_blocking_pass_holds_up_no_other_caller() -> None:
    """A pass that blocks its thread (a stage's synchronous call, a lock a caller holds) waits
    on another caller's pass: callers never share a loop, so that one runs."""
    other_done = threading.Event()
    conversation = threading.Lock()  # a conversation's sync_lock

    async def blocked() -> bool:
        with conversation:  # held by the other caller until its own pass has run
            return other_done.is_set()

    async def quick() -> str:
        return "quick"

    def other() -> None:
        with conversation:
            started.set()
            run_pass(quick)
            other_done.set()

    started = threading.Event()
    caller = threading.Thread(target=other, daemon=True)
    caller.start()
    started.wait(10)
    assert _ends(lambda: run_pass(blocked)) == [True]
    caller.join(10)


def test_what_escapes_a_task_of_a_pass_reaches_its_caller_once_the_pass_has_cleaned_up() -> None:
    """A SystemExit raised in a task group's child escapes the loop itself: what was left runs
    its cleanup (a lock the pass held is released, as a conversation's lock must be), then the
    caller gets the SystemExit (and its next pass a loop of its own) rather than waiting for
    ever."""
    lock = anyio.Lock()
    cleaned: list[bool] = []

    async def child() -> None:
        raise SystemExit(3)

    async def escapes() -> None:
        async with lock:
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(child)
                    await anyio.sleep(5)
            finally:
                cleaned.append(True)

    async def takes_the_lock() -> bool:
        with anyio.fail_after(5):
            async with lock:
                return threading.current_thread() is not threading.main_thread()

    def twice() -> tuple[object, object]:
        try:
            run_pass(escapes)
        except SystemExit as exc:
            first: object = (exc.code, cleaned == [True])
        else:
            first = None
        return first, run_pass(takes_the_lock)

    assert _ends(twice) == [((3, True), True)]


_TRACE: contextvars.ContextVar[str] = contextvars.ContextVar("trace", default="none")


def test_a_pass_sees_its_callers_context_and_not_another_callers() -> None:
    async def read() -> str:
        await anyio.sleep(0)
        return _TRACE.get()

    def caller(name: str, out: dict[str, str]) -> None:
        _TRACE.set(name)
        out[name] = run_pass(read)

    out: dict[str, str] = {}
    callers = [threading.Thread(target=caller, args=(f"c{k}", out)) for k in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert out == {f"c{k}": f"c{k}" for k in range(6)}
    assert run_pass(read) == "none"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_its_passes_on_a_loop_of_its_own() -> None:
    parent = run_pass(_where)
    child = os.fork()
    if child == 0:  # the child: the parent's passes' thread is not here
        code = 1
        try:
            signal.alarm(20)  # a pass sent to the parent's thread would wait for ever
            code = 0 if run_pass(_where)[0] != threading.get_ident() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert run_pass(_where)[0] == parent[0]  # the parent's thread serves on
