"""The synchronous client's passes: run to their end for the caller, in a worker thread on a
loop of their own, whatever loop the caller runs."""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading

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


def test_the_passes_share_one_loop_in_one_thread() -> None:
    """A thread and a loop made for each call cost more than a short pass: the passes of any
    caller thread run on one loop, kept between calls."""
    first = run_pass(_loop)
    seen: list[asyncio.AbstractEventLoop] = []
    callers = [threading.Thread(target=lambda: seen.append(run_pass(_loop))) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert run_pass(_loop) is first
    assert seen == [first] * 4


def test_a_pass_that_runs_a_pass_itself_gets_a_loop_of_its_own() -> None:
    async def outer() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return asyncio.get_running_loop(), run_pass(_loop)  # a wrapped client's call inside

    mine, inner = run_pass(outer)
    assert mine is run_pass(_loop)
    assert inner is not mine


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
