"""Passes run off the caller's event loop: the synchronous client's (``wrap`` of
``anthropic.Anthropic``), async code run to its end for a caller that waits, and the proxy's
long ones (:func:`in_worker_loop`), awaited while its loop serves other requests.

Each pass runs in a worker thread, on an event loop made for the call: whatever loop the caller
runs (a sync call made from async code, a pass that calls a wrapped client itself) is left
alone. The pass runs in a copy of the caller's context (its span, its log context) less the
mark by which anyio, through sniffio, tells which event loop runs.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
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


def run_pass(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` run to its end for a synchronous caller, on an event loop made for the
    call in a worker thread: its result, or its exception."""
    return in_worker(lambda: anyio.run(_main, fn))


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
