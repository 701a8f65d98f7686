"""Passes run off the caller's event loop: the synchronous client's (``wrap`` of
``anthropic.Anthropic``), async code run to its end for a caller that waits, and the proxy's
long ones (:func:`in_worker_loop`), awaited while its loop serves other requests.

Each pass runs in a worker thread, on an event loop other than the caller's: whatever loop the
caller runs (a sync call made from async code) is left alone. Each thread that calls the synchronous
client keeps one such loop, in a daemon thread started on its first call and stopped once the
caller thread has ended (:func:`run_pass`): a thread and a loop made for each call cost about
half a millisecond, more than a short pass itself. Callers never share a loop, so one caller's
long pass never holds up another's, and a pass that calls a wrapped client itself (from the
loop's thread, or a worker thread of it) is a caller of its own, on a loop of its own. The pass
runs in a copy of the caller's context (its span, its log context) less the mark by which
anyio, through sniffio, tells which event loop runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import weakref
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


class _Passes:
    """One event loop's passes: what its thread and the callers that send it passes share."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.guard = threading.Lock()
        """Held to send a pass, and by the loop's thread to stop taking them."""
        self.stopped = False
        self.pending: set[concurrent.futures.Future[Any]] = set()
        """The passes sent to the loop and not yet ended."""
        self.tasks: set[asyncio.Task[None]] = set()
        """Their tasks (a loop keeps only weak references to its tasks)."""
        self.escaped: BaseException | None = None
        """What escaped the loop and stopped it, for the passes it cut short."""


class _PassLoop:
    """A caller thread's event loop for its passes, running in a daemon thread of its own for
    as long as the caller thread lives: the caller's thread-local storage holds this object
    (and only it: the loop's thread holds the :class:`_Passes`), so once the caller thread is
    gone the loop stops and its thread ends."""

    def __init__(self) -> None:
        self.passes = _Passes()
        self.thread = threading.Thread(target=_serve, args=(self.passes,), name="sluicegate-passes")
        self.thread.daemon = True
        # not at exit: a daemon thread that is mid-pass then would hear of a stopped loop
        weakref.finalize(self, _stop, self.passes.loop).atexit = False
        self.thread.start()

    def taking(self) -> bool:
        """Whether its loop still runs passes (a forked child's copy has no thread)."""
        return not self.passes.stopped and self.thread.is_alive()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # closed already: its thread ended on its own
        loop.call_soon_threadsafe(loop.stop)


def _serve(passes: _Passes) -> None:
    loop = passes.loop
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    except BaseException as exc:  # what escaped a task (a SystemExit raised in a task group)
        passes.escaped = exc
    finally:
        with passes.guard:
            passes.stopped = True  # no pass is sent here from now on
        try:
            # what is left ends as anyio.run would end it: cancelled, its cleanup run (a lock
            # a cut pass holds is released before its caller hears of it and goes on)
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            for done in list(passes.pending):  # whoever still waits hears of it, never waits on
                _fail(done, passes)


def _fail(done: concurrent.futures.Future[Any], passes: _Passes) -> None:
    if not done.done():
        done.set_exception(passes.escaped or RuntimeError("the passes' event loop stopped"))


_MINE = threading.local()
"""Each caller thread's :class:`_PassLoop` (its ``passes``)."""


def _passes() -> _PassLoop:
    mine: _PassLoop | None = getattr(_MINE, "passes", None)
    if mine is None or not mine.taking():  # first use; or its loop stopped, or forked
        mine = _MINE.passes = _PassLoop()
    return mine


async def _into(
    fn: Callable[[], Awaitable[T]], done: concurrent.futures.Future[T], passes: _Passes
) -> None:
    try:
        result = await fn()
    except BaseException as exc:  # a KeyboardInterrupt raised in the pass too: the caller's
        if passes.escaped is not None:  # cancelled as the loop stopped: why it stopped
            _fail(done, passes)
        elif not done.done():
            done.set_exception(exc)  # (the loop goes on)
    else:
        done.set_result(result)


def run_pass(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` run to its end for a synchronous caller, on its thread's passes' event
    loop in a worker thread (see the module): its result, or its exception."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    context = _context()
    while True:
        passes = _passes().passes
        loop = passes.loop

        def start(passes: _Passes = passes, loop: asyncio.AbstractEventLoop = loop) -> None:
            # on the loop, in ``context``: the task runs in a copy of it
            if passes.stopped:  # sent as the loop stopped: its caller hears why
                _fail(done, passes)
                return
            task = loop.create_task(_into(fn, done, passes))
            passes.tasks.add(task)
            task.add_done_callback(passes.tasks.discard)

        with passes.guard:
            if passes.stopped:  # it stopped since: another
                continue
            passes.pending.add(done)
            done.add_done_callback(passes.pending.discard)
            loop.call_soon_threadsafe(start, context=context)
        break
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
