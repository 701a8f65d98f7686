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
64 MiB more resident than what is in use, after a burst of large bodies.

Left as it is where an operator chose otherwise: an allocator preloaded in place of glibc's
(``LD_PRELOAD``), or glibc's own settings given in the environment (``GLIBC_TUNABLES`` naming a
``glibc.malloc`` setting, ``MALLOC_*`` variables), which a later call here would override.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Mapping

__all__ = ["ARENAS", "HEAP_BLOCKS", "KEEP_FREED", "tune_allocator"]

HEAP_BLOCKS = 32 * 2**20
"""Blocks up to this size come from the heap, not from ``mmap``: glibc's largest allowed
threshold on 64-bit systems (32 MiB; a body at the API's limit, with its headers, is just
past it)."""
KEEP_FREED = HEAP_BLOCKS
"""Free memory at the top of a heap kept rather than given back."""
ARENAS = 2
"""The most heaps glibc makes (the main one and one for threads); its default is eight per
CPU, each keeping up to :data:`KEEP_FREED`."""

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
