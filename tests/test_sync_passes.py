"""The synchronous client's passes: run to their end for the caller, in a worker thread on a
loop of their own, whatever loop the caller runs."""

from __future__ import annotations

import asyncio
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
