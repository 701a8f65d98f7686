"""The C allocator set for a server whose request bodies grow a little every call (glibc only).

A conversation re-sends its whole history each call, so each body is a little larger than the
last. glibc takes a block past its mmap threshold from the system with ``mmap`` and gives it
back on ``free``; the threshold follows the largest block freed so far, so a body larger than
every earlier one -- the next call of a growing conversation -- is always past it: each call's
few body-sized buffers (the bytes read, their join, what is written) came as fresh pages, each
page a fault. At 10,000 messages (~11 MB a body) the proxy took 1,000-1,900 page faults a call
and 12.3-13.7 ms of CPU; with the thresholds fixed, none and 9.0-9.3 ms (two runs, against the
proxy before beside it).

What it costs: memory freed is kept for the next body rather than given back, up to
:data:`KEEP_FREED` at the top of each of glibc's heaps, and at most :data:`ARENAS` heaps are
made for threads (the interpreter's lock lets one thread allocate at a time anyway): at most
64 MiB more resident than what is in use, after a burst of large bodies. So that the memory is
not kept while nothing comes, :class:`IdleTrim` gives every free page of the heaps back once
the proxy has answered everything and :data:`IDLE_TRIM` seconds have passed with no request
(``malloc_trim``, ~1 ms for a heap of 50 MiB): the holes freed bodies leave between what the
conversations hold were 0.4x of their wire text at rest.

Left as it is where an operator chose otherwise: an allocator preloaded in place of glibc's
(``LD_PRELOAD``), or glibc's own settings given in the environment (``GLIBC_TUNABLES`` naming a
``glibc.malloc`` setting, ``MALLOC_*`` variables), which a later call here would override.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

__all__ = [
    "ARENAS",
    "HEAP_BLOCKS",
    "IDLE_TRIM",
    "KEEP_FREED",
    "IdleTrim",
    "heap_trimmer",
    "tune_allocator",
]

HEAP_BLOCKS = 32 * 2**20
"""Blocks up to this size come from the heap, not from ``mmap``: glibc's largest allowed
threshold on 64-bit systems (32 MiB; a body at the API's limit, with its headers, is just
past it)."""
KEEP_FREED = HEAP_BLOCKS
"""Free memory at the top of a heap kept rather than given back."""
ARENAS = 2
"""The most heaps glibc makes (the main one and one for threads); its default is eight per
CPU, each keeping up to :data:`KEEP_FREED`."""

IDLE_TRIM = 1.0
"""Seconds with no request in flight after which :class:`IdleTrim` gives free pages back."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_allocator(environ: Mapping[str, str] | None = None) -> str | None:
    """Fix glibc's thresholds (see the module) for this process; None when set, else why not:
    the C library is not glibc (musl, macOS, Windows), another allocator is preloaded, the
    environment already sets glibc's allocator (``environ``, default ``os.environ``), or glibc
    refuses a value (a 32-bit system, where the threshold's limit is 512 KiB)."""
    env = os.environ if environ is None else environ
    if not _on_glibc():
        return "the C library is not glibc"
    if "malloc" in env.get("LD_PRELOAD", ""):
        return "another allocator is preloaded (LD_PRELOAD)"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(
        k.startswith("MALLOC_") for k in env
    ):
        return "the environment sets glibc's allocator (GLIBC_TUNABLES, MALLOC_*)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "mallopt is not found"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either one turns glibc's moving thresholds off, and
    # the trim threshold alone would leave the mmap threshold at 128 KiB (every body mmap'd)
    if not mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS):
        return "glibc refuses a 32 MiB mmap threshold"
    mallopt(_M_TRIM_THRESHOLD, KEEP_FREED)
    mallopt(_M_ARENA_MAX, ARENAS)
    return None


def _on_glibc() -> bool:
    version: str | None = None
    with contextlib.suppress(AttributeError, ValueError, OSError):  # not a GNU system
        version = os.confstr("CS_GNU_LIBC_VERSION")
    return bool(version) and str(version).startswith("glibc ")


def heap_trimmer() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``: every whole free page of its heaps given back to the
    system; None where the C library is not glibc."""
    if not _on_glibc():
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int

    def trimmed() -> None:
        trim(0)

    return trimmed


_Scope = MutableMapping[str, Any]
_App = Callable[
    [_Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]


class IdleTrim:
    """An ASGI app around ``app`` that runs ``trim`` (on a worker thread) once no request has
    been in flight for ``idle`` seconds, at most once a quiet spell: the first request after it
    takes its body's pages afresh, a cost the spell paid for (see the module)."""

    def __init__(self, app: _App, trim: Callable[[], None], idle: float = IDLE_TRIM) -> None:
        self.app = app
        self.trim = trim
        self.idle = idle
        self.trims = 0
        """How many times it trimmed."""
        self._busy = 0
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(
        self,
        scope: _Scope,
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._busy += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            await self.app(scope, receive, send)
        finally:
            self._busy -= 1
            if not self._busy:
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self.idle, self._quiet, loop)

    def _quiet(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._busy:
            return
        self.trims += 1
        # off the loop: a large heap takes milliseconds, and a request may come meanwhile
        with contextlib.suppress(RuntimeError):  # the loop's executor already shut down
            loop.run_in_executor(None, self.trim)
