"""Passes run off the caller's event loop: the synchronous client's (``wrap`` of
``anthropic.Anthropic``), async code run to its end for a caller that waits, and the proxy's
long ones (:func:`in_worker_loop`), awaited while its loop serves other requests.

Each pass runs in a worker thread, on an event loop of its own: whatever loop the caller runs
(a sync call made from async code) is left alone. The synchronous client's passes share one
such loop, in a daemon thread started on first use (:func:`run_pass`): a thread and a loop made
for each call cost about half a millisecond, more than a short pass itself. A pass that calls a
wrapped client itself gets a thread and a loop made for it (its own loop is busy with it). The
pass runs in a copy of the caller's context (its span, its log context) less the mark by which
anyio, through sniffio, tells which event loop runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

__all__ = ["LONG_PASSES_AT_ONCE", "LongPasses", "in_worker", "in_worker_loop", "run_pass"]

LONG_PASSES_AT_ONCE = 2
"""Long passes a :class:`LongPasses` runs at once; more wait their turn."""

T = TypeVar("T")

_ASYNC_LIBRARY: contextvars.ContextVar[str | None] | None
try:
    from sniffio import current_async_library_cvar as _ASYNC_LIBRARY
except ImportError:  # without sniffio, anyio asks asyncio, whose running loop is per thread
    _ASYNC_LIBRARY = None


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


async def _main(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


class _PassLoop:
    """The event loop the synchronous client's passes share, in a daemon thread of its own
    (started on first use; again after a fork, whose child has no such thread)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._guard:
            if self._loop is None or self.thread is None or not self.thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name="sluicegate-passes", daemon=True
                )
                thread.start()
                self._loop, self.thread = loop, thread
            return self._loop

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    def forget(self) -> None:
        """After a fork: the thread is the parent's; the child starts its own on first use."""
        self._guard = threading.Lock()
        self._loop, self.thread = None, None


_PASSES = _PassLoop()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PASSES.forget)


_RUNNING: set[asyncio.Task[None]] = set()
"""The passes running on the shared loop (a loop keeps only weak references to its tasks)."""


async def _into(fn: Callable[[], Awaitable[T]], done: concurrent.futures.Future[T]) -> None:
    try:
        result = await fn()
    except BaseException as exc:  # a KeyboardInterrupt raised in the pass too: the caller's
        done.set_exception(exc)  # (the shared loop goes on)
    else:
        done.set_result(result)


def run_pass(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` run to its end for a synchronous caller, on the passes' shared event loop
    in a worker thread (see the module): its result, or its exception."""
    if threading.current_thread() is _PASSES.thread:  # a pass's own call: its loop is busy
        return in_worker(lambda: anyio.run(_main, fn))
    loop = _PASSES.loop()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    context = _context()

    def start() -> None:  # on the loop, in ``context``: the task runs in a copy of it
        task = loop.create_task(_into(fn, done))
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)

    loop.call_soon_threadsafe(start, context=context)
    try:
        return done.result()
    except BaseException:
        # interrupted while waiting (a KeyboardInterrupt here): the pass still ends before the
        # caller goes on, as it did in a thread of its own
        concurrent.futures.wait([done])
        raise


async def in_worker_loop(
    fn: Callable[[], Awaitable[T]], *, limiter: anyio.CapacityLimiter | None = None
) -> T:
    """``await fn()`` on an event loop made for it in a worker thread (one of ``limiter``'s,
    default anyio's), awaited from this one: this loop goes on serving while a long pass of
    CPU work runs there (in a copy of this context, as :func:`run_pass`). A cancellation
    through anyio's scopes waits for the pass to end, so a pass is never left half done; an
    asyncio task cancelled directly (a server's forced stop) returns at once, and its process
    exits once the thread has. Only for async work bound to no loop (nothing it awaits was
    made on this one)."""
    context = _context()

    def on_its_loop() -> T:
        return context.run(lambda: anyio.run(_main, fn))

    return await anyio.to_thread.run_sync(on_its_loop, limiter=limiter)


class LongPasses:
    """The proxy's long passes, each by :func:`in_worker_loop`, :data:`LONG_PASSES_AT_ONCE` at
    most at a time: a burst of them (every session resumed after a restart) shares one
    interpreter lock, and a few threads at once leave the server's loop its share. Its limiter
    is made on first use, in the server's loop."""

    def __init__(self, at_once: int = LONG_PASSES_AT_ONCE) -> None:
        self.at_once = at_once
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` off this loop (:func:`in_worker_loop`), when a turn is free."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.at_once)
        return await in_worker_loop(fn, limiter=self._limiter)
