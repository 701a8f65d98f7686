"""The synchronous client's passes: run to their end for the caller, in its thread on a loop
kept for it, or in a worker when the caller is inside a running event loop."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import anyio
import pytest

from pipeline.dropin.sync_passes import run_pass


async def _where() -> tuple[int, int]:
    await anyio.sleep(0)  # anyio works on the kept loop
    return threading.get_ident(), id(asyncio.get_running_loop())


def test_a_pass_gives_its_result_or_raises_its_exception() -> None:
    async def fails() -> None:
        raise ValueError("no")

    assert run_pass(_where)[0] == threading.get_ident()
    with pytest.raises(ValueError, match="no"):
        run_pass(fails)
    assert run_pass(_where) == run_pass(_where)  # the same loop, call after call


def test_an_interrupted_pass_leaves_the_loop_usable() -> None:
    async def interrupted() -> None:
        await anyio.sleep(0)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pass(interrupted)
    assert run_pass(_where)[0] == threading.get_ident()


def test_inside_a_running_loop_the_pass_runs_in_a_worker() -> None:
    async def caller() -> tuple[int, int]:
        return run_pass(_where)  # a blocking call from async code

    thread, loop = asyncio.run(caller())
    assert thread != threading.get_ident()
    assert loop != run_pass(_where)[1]


def test_a_forked_child_leaves_the_parents_loop_working() -> None:
    """A child inherits the thread's loop, whose epoll instance it shares with the parent:
    its own passes may not close it under the parent (whose next pass would then never hear a
    worker thread's result)."""

    async def hop() -> int:
        return await anyio.to_thread.run_sync(lambda: 7)  # wakes the loop from another thread

    got: list[object] = []

    def scenario() -> None:  # in a thread of its own: a hang fails the join, not the run
        got.append(run_pass(hop))
        pid = os.fork()
        if pid == 0:  # the child: a pass of its own, its inherited loop let go and collected
            ok = run_pass(hop) == 7
            gc.collect()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        got.append(os.waitstatus_to_exitcode(status))
        got.append(run_pass(hop))

    thread = threading.Thread(target=scenario, daemon=True)
    thread.start()
    thread.join(20)
    assert got == [7, 0, 7]
