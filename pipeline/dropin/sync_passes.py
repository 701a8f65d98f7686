"""The synchronous client's passes (``wrap`` of ``anthropic.Anthropic``): async code run to its
end for a caller that waits.

Each calling thread keeps an event loop of its own and runs its passes on it, in the thread
itself: no thread started and no loop made per call (those cost ~0.5 ms a call). A caller that
is inside a running event loop (a sync call made from async code, a pass that calls a wrapped
client itself) must not have that loop disturbed: its pass runs in a worker thread, on a loop
made for the call. Either way the pass runs in a copy of the caller's context (its span, its log
context) less the mark by which anyio, through sniffio, tells which event loop runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["in_worker", "run_pass"]

T = TypeVar("T")

_ASYNC_LIBRARY: contextvars.ContextVar[str | None] | None
_THREAD_LIBRARY: threading.local | None
try:
    from sniffio import current_async_library_cvar as _ASYNC_LIBRARY
    from sniffio import thread_local as _THREAD_LIBRARY
except ImportError:  # without sniffio, anyio asks asyncio, whose running loop is per thread
    _ASYNC_LIBRARY = _THREAD_LIBRARY = None


def _inside_a_loop() -> bool:
    """Whether an event loop runs in this thread: asyncio's, or one that tells sniffio (trio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return True
    if _THREAD_LIBRARY is not None and getattr(_THREAD_LIBRARY, "name", None) is not None:
        return True
    return _ASYNC_LIBRARY is not None and _ASYNC_LIBRARY.get() is not None


def _context() -> contextvars.Context:
    context = contextvars.copy_context()
    if _ASYNC_LIBRARY is not None:
        context.run(_ASYNC_LIBRARY.set, None)
    return context


def in_worker(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, in a copy of the caller's context (see the module
    docstring): no event loop runs there, whatever loop the caller runs."""
    context = _context()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(context.run, fn, *args).result()


class _Loop:
    """A thread's own event loop; closed once the thread, and with it this holder, is gone."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self.closing = weakref.finalize(self, self.loop.close)
        _loops.add(self)


_local = threading.local()
_loops: weakref.WeakSet[_Loop] = weakref.WeakSet()
_inherited: list[asyncio.AbstractEventLoop] = []
"""Loops a forked child inherited: never closed there, nor collected (closing one would take
its wake-up pipe off the epoll instance the parent's loop still waits on)."""


def _after_fork_in_child() -> None:
    global _local
    for held in list(_loops):
        held.closing.detach()
        _inherited.append(held.loop)
    _loops.clear()
    _local = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _thread_loop() -> asyncio.AbstractEventLoop:
    held: _Loop | None = getattr(_local, "held", None)
    # a forked child shares its parent's selector: it makes a loop of its own
    if held is None or held.pid != os.getpid() or held.loop.is_closed():
        held = _local.held = _Loop()
    return held.loop


async def _main(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


def run_pass(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` run to its end for a synchronous caller: its result, or its exception."""
    if _inside_a_loop():  # leave that loop alone
        return in_worker(lambda: anyio.run(_main, fn))
    loop = _thread_loop()
    task = loop.create_task(_main(fn), context=_context())
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if not task.done():  # interrupted (KeyboardInterrupt): the pass is not left half-run
            task.cancel()
            loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        raise
